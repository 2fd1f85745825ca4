"""The manifest digest of a safetensors checkpoint, as RolloutCore's C++ computes it.

The definition lives in effects/manifest.h (canonical form, SHA-256) and the header rules in
effects/nccl/weight_source.h (ParseSafetensorsHeader); this is their Python twin, so that an
engine can compute the digest of the checkpoint it is about to load from its own disk
(rolloutcore.vllm_ext.RolloutCoreWorkerExtension.rc_checkpoint_manifest). Standard library only.

One file: its tensors in data-offset order (ties by name), digested as

    "rolloutcore-manifest-v1\\n" + ("<name>\\t<torch dtype>\\t<d0>,<d1>,...\\n" per tensor)

A file is accepted exactly when the C++ parser accepts it: an 8-byte little-endian header length
of at most HEADER_BYTES_MAX that fits the file, a JSON object header, known dtypes, shapes of rank
<= RANK_MAX, byte ranges that tile the data section, each as long as its dtype and shape say.

A directory: the files vLLM 0.25.1's default loader would read from it (checkpoint_files), in
name order, their tensors concatenated in that order; tensor names must be unique across files.
A directory holding one file has that file's digest.

Errors name tensors by position, never by a name or value read from the file, as the C++ does.
"""
import fnmatch
import hashlib
import json
import os
import stat
import struct

MANIFEST_PREFIX = b"rolloutcore-manifest-v1\n"
HEADER_BYTES_MAX = 100 << 20    # kSafetensorsHeaderBytesMax
TENSORS_MAX = 1 << 20           # kTensorsMax, over the whole checkpoint
NAME_BYTES_MAX = 1024           # kTensorNameBytesMax
RANK_MAX = 8                    # kTensorRankMax
CHECKPOINT_BYTES_MAX = 1 << 50  # Manifest::Validate's 1 PiB
FILES_MAX = 4096                # safetensors files in one checkpoint
DIR_ENTRIES_MAX = 65536         # directory entries looked at
INDEX_BYTES_MAX = 64 << 20      # model.safetensors.index.json

# safetensors dtype -> (torch name, bytes per element); effects/manifest.cc kNames.
DTYPES = {
    "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "I8": ("int8", 1), "U8": ("uint8", 1), "I32": ("int32", 4), "I64": ("int64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
}

# vLLM 0.25.1's load formats whose loader (DefaultModelLoader) reads safetensors files from a
# directory, and the (pattern, index file) each reads. "auto" turns into "mistral" when the
# directory holds consolidated*.safetensors, else into "hf" (default_loader.py _prepare_weights).
_DEFAULT = ("*.safetensors", "model.safetensors.index.json")
_MISTRAL = ("consolidated*.safetensors", "consolidated.safetensors.index.json")
SAFETENSORS_FORMATS = {"auto": None, "hf": _DEFAULT, "safetensors": _DEFAULT,
                       "fastsafetensors": _DEFAULT, "instanttensor": _DEFAULT, "mistral": _MISTRAL}


class ManifestError(ValueError):
    """The checkpoint cannot be described; the message says why (never quoting file content)."""


def _read_exact(fd, offset, n):
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise ManifestError("file truncated while reading")
        out += chunk
    return bytes(out)


def _open_regular(path):
    """(fd, size) of a regular file; O_NONBLOCK so a FIFO cannot block the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ManifestError(f"open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ManifestError(f"{path}: not a regular file")
    return fd, st.st_size


def _not_json(constant):
    raise ValueError(f"{constant} is not JSON")


def _header_json(fd, file_bytes):
    if file_bytes < 8:
        raise ManifestError("safetensors: file shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", _read_exact(fd, 0, 8))
    if header_len > HEADER_BYTES_MAX:
        raise ManifestError(f"safetensors: header length exceeds {HEADER_BYTES_MAX} "
                            "(not a safetensors file?)")
    if header_len > file_bytes - 8:
        raise ManifestError("safetensors: header length runs past the end of a "
                            f"{file_bytes}-byte file (truncated?)")
    try:
        text = _read_exact(fd, 8, header_len).decode("utf-8")
        # As nlohmann::json: a leading byte-order mark is skipped, NaN and Infinity are not JSON.
        header = json.loads(text[1:] if text.startswith("\ufeff") else text,
                            parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise ManifestError("safetensors: header is not a JSON object")
    return header, 8 + header_len


def _u64(v):
    return type(v) is int and 0 <= v < 1 << 64


def _entry(name, t, who, data_bytes):
    """(name, torch dtype, shape, itemsize, begin, end) of one header entry."""
    if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= t.keys():
        raise ManifestError(f"{who} lacks dtype, shape or data_offsets")
    if not isinstance(t["dtype"], str):
        raise ManifestError(f"{who}: dtype not a string")
    if t["dtype"] not in DTYPES:
        raise ManifestError(f"{who}: unsupported dtype")
    shape = t["shape"]
    if not isinstance(shape, list) or len(shape) > RANK_MAX:
        raise ManifestError(f"{who}: shape must be an array of rank <= {RANK_MAX}")
    if not all(_u64(d) for d in shape):
        raise ManifestError(f"{who}: shape holds a non-integer or negative")
    off = t["data_offsets"]
    if not (isinstance(off, list) and len(off) == 2 and _u64(off[0]) and _u64(off[1])
            and off[0] <= off[1]):
        raise ManifestError(f"{who}: data_offsets must be [begin<=end]")
    if off[1] > data_bytes:
        raise ManifestError(f"{who}: data_offsets end beyond the data section "
                            f"({data_bytes} bytes; truncated?)")
    torch_name, itemsize = DTYPES[t["dtype"]]
    return (name, torch_name, list(shape), itemsize, off[0], off[1])


def _entries(header, data_bytes):
    entries = []
    for name, t in header.items():
        if name == "__metadata__":
            if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
                raise ManifestError("safetensors: __metadata__ must map strings to strings")
            continue
        if len(entries) >= TENSORS_MAX:
            raise ManifestError("safetensors: too many tensors")
        entries.append(_entry(name, t, f"safetensors: tensor #{len(entries)}", data_bytes))
    return entries


def _nbytes(shape, itemsize, who):
    """Bytes of one tensor, refusing what Manifest::Validate refuses."""
    n = 1
    for d in shape:
        if d != 0 and n > CHECKPOINT_BYTES_MAX // d:
            raise ManifestError(f"{who}: shape overflows")
        n *= d
    if n * itemsize > CHECKPOINT_BYTES_MAX:
        raise ManifestError("manifest larger than 1 PiB")
    return n * itemsize


def _placed(entries, data_bytes):
    """The entries in data-offset order, checked to tile the data section exactly."""
    # The C++ walks its header in name order (a std::map) before sorting by offsets: ties keep it.
    entries = sorted(sorted(entries, key=lambda e: e[0].encode("utf-8", "surrogatepass")),
                     key=lambda e: (e[4], e[5]))
    cursor = 0
    for i, (_, _, shape, itemsize, begin, end) in enumerate(entries):
        who = f"safetensors: tensor #{i}"
        if begin != cursor:
            raise ManifestError(f"{who}: data does not start where the previous tensor's ends"
                                + (" (overlap)" if begin < cursor else " (gap)"))
        cursor = end
    if cursor != data_bytes:
        raise ManifestError("safetensors: tensors do not cover the data section (the file holds "
                            f"{data_bytes} data bytes)")
    return entries


def read_safetensors_manifest(path):
    """[(name, torch dtype, shape, nbytes)] of one safetensors file, in data-offset order."""
    fd, file_bytes = _open_regular(path)
    try:
        header, data_start = _header_json(fd, file_bytes)
    finally:
        os.close(fd)
    entries = _placed(_entries(header, file_bytes - data_start), file_bytes - data_start)
    out = []
    for i, (name, torch_name, shape, itemsize, begin, end) in enumerate(entries):
        who = f"safetensors: tensor #{i}"
        nbytes = _nbytes(shape, itemsize, who)
        if end - begin != nbytes:
            raise ManifestError(f"{who}: byte range does not match its dtype and shape")
        out.append((name, torch_name, shape, nbytes))
    return out


def manifest_digest(tensors):
    """SHA-256 hex of the canonical form of [(name, torch dtype, shape, ...)] (effects/manifest.h)."""
    h = hashlib.sha256(MANIFEST_PREFIX)
    for name, torch_name, shape, *_ in tensors:
        line = f"{name}\t{torch_name}\t{','.join(str(d) for d in shape)}\n"
        h.update(line.encode("utf-8"))
    return h.hexdigest()


def _check_manifest(tensors):
    """Manifest::Validate over the whole checkpoint: bounded, unique, non-empty names."""
    if len(tensors) > TENSORS_MAX:
        raise ManifestError("too many tensors")
    names, total = set(), 0
    for i, (name, _, _, nbytes) in enumerate(tensors):
        raw = name.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError: caught by caller
        if not raw or len(raw) > NAME_BYTES_MAX:
            raise ManifestError(f"tensor #{i}: name empty or longer than {NAME_BYTES_MAX}")
        if name in names:
            raise ManifestError(f"tensor #{i}: duplicate name")
        names.add(name)
        total += nbytes
        if total > CHECKPOINT_BYTES_MAX:
            raise ManifestError("manifest larger than 1 PiB")


def _listing(directory):
    """Names in `directory`, bounded by DIR_ENTRIES_MAX."""
    names = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if len(names) >= DIR_ENTRIES_MAX:
                    raise ManifestError(f"{directory}: more than {DIR_ENTRIES_MAX} entries")
                names.append(entry.name)
    except OSError as e:
        raise ManifestError(f"{directory}: {e.strerror}") from None
    return names


def _index_files(directory, index_name):
    """The files an index names (vLLM filter_duplicate_safetensors_files), or None without one."""
    path = os.path.join(directory, index_name)
    if not os.path.isfile(path):
        return None
    fd, size = _open_regular(path)
    try:
        if size > INDEX_BYTES_MAX:
            raise ManifestError(f"{index_name}: larger than {INDEX_BYTES_MAX} bytes")
        raw = _read_exact(fd, 0, size)
    finally:
        os.close(fd)
    try:
        weight_map = json.loads(raw.decode("utf-8"))["weight_map"]
        return {os.path.join(directory, f) for f in weight_map.values()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ManifestError(f"{index_name}: not JSON with a weight_map of file names") from None


def _pattern_and_index(names, load_format):
    if load_format == "dummy":
        raise ManifestError("the engine runs --load-format dummy, whose loader cannot read a "
                            "checkpoint: reload_weights would raise NotImplementedError")
    if load_format not in SAFETENSORS_FORMATS:
        raise ManifestError(f"load_format '{load_format}': RolloutCore reloads only safetensors "
                            "through vLLM's default loader (auto, hf, safetensors, "
                            "fastsafetensors, instanttensor, mistral)")
    chosen = SAFETENSORS_FORMATS[load_format]
    if chosen is None:  # auto
        mistral = any(fnmatch.fnmatchcase(n, _MISTRAL[0]) and not n.startswith(".") for n in names)
        chosen = _MISTRAL if mistral else _DEFAULT
    return chosen


def checkpoint_files(directory, load_format):
    """The safetensors files vLLM 0.25.1 would load from `directory` with `load_format`, sorted."""
    names = _listing(directory)
    pattern, index_name = _pattern_and_index(names, load_format)
    # glob's "*" skips names that start with "." (glob.glob in _prepare_weights).
    files = sorted(os.path.join(directory, n) for n in names
                   if not n.startswith(".") and fnmatch.fnmatchcase(n, pattern))
    indexed = _index_files(directory, index_name)
    if indexed is not None:
        files = [f for f in files if f in indexed]
    if not files:
        raise ManifestError(f"no {pattern} file in {directory} that vLLM would load "
                            "(it would fall back to other formats or fail)")
    if len(files) > FILES_MAX:
        raise ManifestError(f"{directory}: more than {FILES_MAX} checkpoint files")
    return files


def _weights_dir(path, load_format):
    """(the directory reload_weights must be given, the files it will load) for `path`."""
    if os.path.isdir(path):
        return path, checkpoint_files(path, load_format)
    directory = os.path.dirname(path)
    files = checkpoint_files(directory, load_format)
    if files != [path]:
        raise ManifestError(f"vLLM's reload_weights loads a directory, and {directory} holds "
                            f"{len(files)} checkpoint files vLLM would load, not only {path}: "
                            "name the directory, or keep the file alone in its own")
    return directory, files


def checkpoint_manifest(path, load_format="auto"):
    """{"manifest_digest", "tensors", "bytes", "files", "weights_path"} of the checkpoint at
    `path` (a .safetensors file alone in its directory, or a directory) as vLLM would load it."""
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096:
        raise ManifestError("the checkpoint path must be an absolute path of at most 4096 bytes")
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise ManifestError(f"{path}: no such file or directory")
    weights_path, files = _weights_dir(path, load_format)
    tensors = []
    for f in files:
        tensors += read_safetensors_manifest(f)
        if len(tensors) > TENSORS_MAX:
            raise ManifestError("too many tensors")
    try:
        _check_manifest(tensors)
    except UnicodeEncodeError:
        raise ManifestError("a tensor name is not UTF-8") from None
    return {"manifest_digest": manifest_digest(tensors), "tensors": len(tensors),
            "bytes": sum(t[3] for t in tensors), "files": len(files),
            "weights_path": weights_path}
