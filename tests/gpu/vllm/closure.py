#!/usr/bin/env python3
# Measures and downloads the part of vLLM's Requires-Dist closure that the GPU host lacks (cp312,
# manylinux x86_64, --no-deps per package, one version each). Names given as arguments are left
# out (sized separately). Host package list: /work/.library/device/KINDS.md.
#   closure.py VLLM_WHEEL_DIR OUT_DIR [skip names...]   (run 1-3 used the list in README.md)
import subprocess, zipfile, glob, os, re, json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
host = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
host = {cn(h) for h in host}
SKIP = set(cn(x) for x in sys.argv[3:])   # big optional kernels: sized, not downloaded
env = {"python_version":"3.12","python_full_version":"3.12.3","platform_machine":"x86_64","platform_system":"Linux","sys_platform":"linux","os_name":"posix","implementation_name":"cpython","platform_python_implementation":"CPython"}
plat = []
for p in ["manylinux_2_28_x86_64","manylinux_2_27_x86_64","manylinux_2_17_x86_64","manylinux2014_x86_64","manylinux1_x86_64","manylinux_2_34_x86_64","manylinux_2_35_x86_64","manylinux_2_31_x86_64","manylinux_2_24_x86_64"]:
    plat += ["--platform", p]
D = sys.argv[2]; os.makedirs(D, exist_ok=True)
done = {}; queue = []
def meta(name):
    for f in glob.glob(D+"/*.whl"):
        if cn(os.path.basename(f).split("-")[0]) == name:
            z = zipfile.ZipFile(f)
            m = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]
            return f, z.read(m).decode()
    return None, None
def add(reqstr, extras_ctx=("",)):
    r = Requirement(reqstr)
    ok = r.marker is None or any(r.marker.evaluate(dict(env, extra=e)) for e in extras_ctx)
    if not ok: return
    n = cn(r.name)
    if n in host: done.setdefault(n, ("HOST", str(r.specifier))); return
    queue.append((n, str(r.specifier), tuple(r.extras)))
f0 = glob.glob(sys.argv[1] + "/vllm-*.whl")[0]
z = zipfile.ZipFile(f0); md = z.read([n for n in z.namelist() if n.endswith("METADATA")][0]).decode()
for l in md.splitlines():
    if l.startswith("Requires-Dist:"): add(l.split(":",1)[1].strip())
seen_extras = {}
while queue:
    n, spec, ex = queue.pop(0)
    if n in SKIP: done.setdefault(n, ("SKIP", spec)); continue
    prev = seen_extras.get(n)
    if prev is not None and set(ex) <= prev: continue
    seen_extras[n] = (prev or set()) | set(ex)
    f, m = meta(n)
    if f is None:
        rc = subprocess.run([sys.executable,"-m","pip","download","-q","--no-deps","--only-binary=:all:","--python-version","3.12","--implementation","cp",*plat,"-d",D, n+spec], capture_output=True, text=True)
        if rc.returncode: print("FAIL", n, spec, rc.stderr[-300:]); done[n]=("FAIL",spec); continue
        f, m = meta(n)
    done[n] = (os.path.basename(f), spec)
    for l in m.splitlines():
        if l.startswith("Requires-Dist:"): add(l.split(":",1)[1].strip(), ("",)+tuple(seen_extras[n]))
json.dump(done, open(os.path.join(D, "closure.json"),"w"), indent=1)
tot=0
for n,(f,s) in sorted(done.items()):
    if f in ("HOST","SKIP","FAIL"): print(f, n, s); continue
    sz=os.path.getsize(os.path.join(D,f)); tot+=sz; print(round(sz/2**20,2), f)
print("TOTAL downloaded MiB", tot/2**20)
