#!/usr/bin/env python3
"""Picks at most MAX_FILES inputs (and MAX_BYTES) from a libFuzzer merge control file by greedy
set cover: each step takes the input adding the most new edges, then the most new features.
libFuzzer's own -merge=1 keeps every input that adds a feature, often several hundred; the
committed corpora stay small (tests/fuzz/CMakeLists.txt). usage: select_corpus.py CONTROL OUT_DIR
"""
import os
import shutil
import sys

MAX_FILES = 200
MAX_BYTES = 2 * 1024 * 1024 - 64 * 1024


def main():
    control, out = sys.argv[1], sys.argv[2]
    lines = open(control).read().split("\n")
    n = int(lines[0])
    files = lines[2:2 + n]
    cov, ft = {}, {}
    for line in lines[2 + n:]:
        p = line.split()
        if p and p[0] == "COV":
            cov[int(p[1])] = set(map(int, p[2:]))
        elif p and p[0] == "FT":
            ft[int(p[1])] = set(map(int, p[2:]))
    sizes = {i: os.path.getsize(files[i]) for i in range(n)}
    chosen, edges, feats, total = [], set(), set(), 0
    while len(chosen) < MAX_FILES:
        best, score = None, (0, 0)
        for i in range(n):
            if i in chosen:
                continue
            s = (len(cov.get(i, set()) - edges), len(ft.get(i, set()) - feats))
            if s > score or (best is not None and s == score and s != (0, 0)
                             and sizes[i] < sizes[best]):
                best, score = i, s
        if best is None or total + sizes[best] > MAX_BYTES:
            break
        chosen.append(best)
        edges |= cov.get(best, set())
        feats |= ft.get(best, set())
        total += sizes[best]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for i in chosen:
        shutil.copy(files[i], out)
    all_edges = set().union(*cov.values()) if cov else set()
    print("%d of %d inputs, %d bytes, %d of %d edges" % (len(chosen), n, total, len(edges),
                                                        len(all_edges)))


if __name__ == "__main__":
    main()
