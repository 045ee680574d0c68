#!/usr/bin/env bash
# On the GPU machine, once every chunk of scripts/gpu_stage.sh V is in /tmp/stage:
#   bash /tmp/stage/gpu_install.sh && source /tmp/vllm-V/env.sh
# Reassembles and checks the split wheels, installs every wheel into /tmp/vllm-V/site (vLLM, the
# torch it pins and that torch's triton, beside the machine's own torch, which is not touched),
# unpacks redis-server into /tmp/redis and prefixq's source into /tmp/pqa, writes
# /tmp/vllm-V/env.sh, and checks that the new torch sees the GPU and vLLM imports.
# /tmp/site is made a link to /tmp/vllm-V/site: scripts/gpu_bench.sh puts /tmp/site on PYTHONPATH.
set -euo pipefail
S=${GPU_STAGE:-/tmp/stage}
cd "$S"
V=$(cat VLLM_VERSION)
D=/tmp/vllm-$V
t0=$SECONDS
for first in *.part.00; do
  [[ -e $first ]] || continue
  whl=${first%.part.00}
  [[ -f $whl ]] || cat "$whl".part.* > "$whl"
done
[[ -s SHA256SUMS ]] && sha256sum -c --quiet SHA256SUMS
mkdir -p "$D"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$D/site" ./*.whl
ln -sfn "$D/site" /tmp/site
mkdir -p /tmp/redis && for f in ./*.deb; do dpkg -x "$f" /tmp/redis; done
rm -rf /tmp/pqa && mkdir -p /tmp/pqa && tar -xzf prefixq-src.tar.gz -C /tmp/pqa
# The machine's CUDA 13 libraries (torch 2.11's pins) serve the new torch: its RPATH points into
# its own site folder, where they are not, so torch preloads them from sys.path (the machine's
# site-packages). cuDNN 9.19 there is older than the 9.20 torch 2.13 was built with: torch refuses
# it unless told (minor versions of cuDNN 9 are backward compatible; an LLM's forward pass calls
# no cuDNN anyway).
cat > "$D/env.sh" <<EOF
export PYTHONPATH=$D/site:/tmp/pq/src
export LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu PATH=/tmp/redis/usr/bin:\$PATH
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF
echo "installed in $((SECONDS - t0)) s: $(du -sm "$D/site" | cut -f1) MiB in $D/site"
# shellcheck disable=SC1091
source "$D/env.sh"
redis-server --version
PYTHONPATH=$D/site:/tmp/pqa/src python3 - <<'PY'
import importlib.metadata as md, torch, triton
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); (x @ x).sum().item()
print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("triton", triton.__version__, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())
for n in ("nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13", "cuda-toolkit", "transformers", "huggingface-hub", "numba", "numpy"):
    try:
        print(f"  machine: {n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"  machine: {n} absent")
import vllm
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
import prefixq.engine.vllm_engine  # noqa: F401
print("vllm", vllm.__version__, vllm.__file__, "ready")
PY
