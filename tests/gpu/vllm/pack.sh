#!/usr/bin/env bash
# Packs what the GPU host needs for tests/gpu/vllm/run_vllm.sh into 3 chunks under .vw/ (ignored),
# each small enough to travel with one device call (64 MiB with the repo).
#   pack.sh VLLM_WHEEL DEPS_DIR      (DEPS_DIR: closure.py's output; .vc/ = driver + libs)
# The vLLM wheel is re-zipped without files the H200/OPT/Qwen3 runs do not load: the FA2 kernels
# (Hopper uses FA3), the MoE kernels (import is optional in vllm/platforms/cuda.py), the Rust
# front-end binary vllm-rs and deep_gemm builds for other Pythons.
set -eu
W=$1; D=$2
python3 - "$W" "$D" <<'PY'
import sys, zipfile, os
src = zipfile.ZipFile(sys.argv[1])
drop = lambda n: n in ('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so', 'vllm/vllm-rs', 'vllm/_moe_C_stable_libtorch.abi3.so') or \
    (n.startswith('vllm/third_party/deep_gemm/_C.cpython-3') and 'cpython-312' not in n)
out = zipfile.ZipFile(os.path.join(sys.argv[2], os.path.basename(sys.argv[1])), 'w', zipfile.ZIP_STORED)
for i in src.infolist():
    if not drop(i.filename):
        out.writestr(i, src.read(i.filename), compress_type=i.compress_type)
PY
tar cJf "$D/vc.tar.xz" .vc
rm -rf .vw && mkdir .vw
tar cf - -C "$(dirname "$D")" "$(basename "$D")" | split -n 3 -d - .vw/w.tar. 2>/dev/null ||
  { tar cf /tmp/w.tar -C "$(dirname "$D")" "$(basename "$D")" && split -n 3 -d /tmp/w.tar .vw/w.tar.; }
ls -la .vw
