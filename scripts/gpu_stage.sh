#!/usr/bin/env bash
# Stage a named vLLM release, the torch it needs and everything else the GPU machine lacks for it,
# as chunks small enough to send one per call (the machine has no network).
#   scripts/gpu_stage.sh 0.28.0        (here, from the project root; writes .gpu/vllm-0.28.0/c0..cN)
# Then, on the GPU machine, one call per chunk, back to back (it is released after ~30 s idle):
#   run(carry=[".gpu/vllm-0.28.0/cK"]):  mkdir -p /tmp/stage && cp -r .gpu/vllm-0.28.0/cK/. /tmp/stage/
# and in the last chunk's call (or the next):  bash /tmp/stage/gpu_install.sh
# which installs into /tmp/vllm-V/site (the machine's own torch stays as it is), unpacks
# redis-server into /tmp/redis and prefixq's source (c0: git HEAD, plus the working-tree files
# named in PREFIXQ_OVERLAY) into /tmp/pqa; `source /tmp/vllm-V/env.sh`, then
# `cd /tmp/pqa && bash scripts/gpu_bench.sh start ...` runs the benchmark from there.
#
# What the machine has (KINDS.md, and read there on 2026-12-03): Python 3.12, torch 2.11.0+cu130
# with the CUDA 13 libraries torch 2.11 pins (cuda-toolkit 13.0.2: cuBLAS 13.1.0.3, cuDNN 9.19.0.56,
# cuSPARSELt 0.8.0, NCCL 2.28.9, NVSHMEM 3.4.5), triton 3.6.0, transformers 5.17, huggingface_hub
# 1.33, numpy, pillow, opencv, numba, ... A newer torch goes beside it with its own triton; its CUDA
# libraries are the machine's (docs/engine.md, "Staging a vLLM release for the GPU machine", says
# why that is sound for these releases, and what differs from a user's install).
set -euo pipefail
V=${1:?usage: scripts/gpu_stage.sh VLLM_VERSION   (a release with a recipe below)}
# 52: each call carries the checkout too (~6 MB on 2026-12-06), within 64 MiB in all; 58 no longer fit
LIMIT_MIB=${GPU_CHUNK_MIB:-52}
case "$V" in
  0.28.0)
    # vllm 0.28.0 pins torch==2.13.0 (triton 3.7.1, torchvision 0.28.0). torch 2.13 calls 8 NCCL
    # functions that the machine's NCCL 2.28.9 lacks, and Python loads extensions with RTLD_NOW, so
    # its NCCL (2.29.7) goes too; every other CUDA library it links is the machine's (cuBLAS, cuDNN,
    # cuSPARSELt: every symbol it imports is there, checked with nm). The rest: what its import
    # and an engine serving Llama-shaped dummy weights load and the machine lacks, at versions inside
    # vLLM 0.28.0's requirements (checked against its wheel's metadata).
    pins=(vllm==0.28.0 torch==2.13.0 triton==3.7.1 torchvision==0.28.0 nvidia-nccl-cu13==2.29.7
      flashinfer-python==0.6.16.post3 apache-tvm-ffi==0.1.11 xgrammar==0.2.3 llguidance==1.7.3
      outlines_core==0.2.14 lark==1.2.2 lm_format_enforcer==0.11.3 compressed_tensors==0.17.0
      loguru==0.7.3 depyf==0.20.0 nvtx==0.2.15 mistral_common==1.13.1 openai==2.54.0 openai_harmony==0.0.8
      fastapi==0.136.3 starlette==1.10.0 prometheus_fastapi_instrumentator==8.1.0
      pydantic==2.14.4 pydantic_core==2.50.5 pydantic_extra_types==2.11.1 typing_inspection==0.4.5
      annotated_types==0.8.0 pycountry==26.2.16 jsonschema==4.26.0 jsonschema_specifications==2025.9.1
      referencing==0.37.0 rpds_py==2026.9.1 msgspec==0.22.0 pyzmq==27.3.0 blake3==1.0.11
      cachetools==8.0.2 cbor2==6.3.0 astor==0.8.1 dill==0.4.1 distro==1.9.0 gguf==0.19.0
      ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 partial_json_parser==0.2.1.1.post7
      model_hosting_container_standards==0.1.16 pybase64==1.5.1 python_json_logger==4.2.0
      setproctitle==1.3.8 sniffio==1.3.1 watchfiles==1.3.0
      redis hiredis rq zstandard ${EXTRA_PINS:-})
    ;;
  0.33.0)
    # vllm 0.33.0 pins torch==2.14.0 (triton~=3.8.0, so 3.8.0; torchvision 0.29.0; torchaudio 2.11.0,
    # the machine's). torch 2.14 pins cuda-toolkit 13.0.3 (cuBLAS 13.1.1.3), cuDNN 9.24.0.43,
    # cuSPARSELt 0.8.1, NCCL 2.30.7, NVSHMEM 3.4.5. It calls 11 NCCL functions that the machine's
    # NCCL 2.28.9 lacks (the 8 torch 2.13 needed, plus ncclCommGetUniqueId, ncclCommGrow,
    # ncclWinGetUserPtr), so its NCCL (2.30.7) goes too; every other CUDA library it links is the
    # machine's (cuBLAS 13.1.0.3, cuDNN 9.19, cuSPARSELt 0.8.0: every symbol it imports is there,
    # checked with nm; NVSHMEM and the rest of cuda-toolkit are the versions it pins). The rest: the
    # 0.28.0 set at versions inside vLLM 0.33.0's requirements (checked against its wheel's
    # metadata): xgrammar 0.2.8 and flashinfer 0.7.2.post1 (both pinned), oss_harmony 0.0.11 (the
    # openai_harmony module, renamed; replaces openai_harmony 0.0.8), and orjson, new in its
    # requirements (only its HTTP server imports it).
    pins=(vllm==0.33.0 torch==2.14.0 triton==3.8.0 torchvision==0.29.0 nvidia-nccl-cu13==2.30.7
      flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.11 xgrammar==0.2.8 llguidance==1.7.3
      outlines_core==0.2.14 lark==1.2.2 lm_format_enforcer==0.11.3 compressed_tensors==0.17.0
      loguru==0.7.3 depyf==0.20.0 nvtx==0.2.15 mistral_common==1.13.1 openai==2.54.0 oss_harmony==0.0.11
      fastapi==0.136.3 starlette==1.10.0 prometheus_fastapi_instrumentator==8.1.0
      pydantic==2.14.4 pydantic_core==2.50.5 pydantic_extra_types==2.11.1 typing_inspection==0.4.5
      annotated_types==0.8.0 pycountry==26.2.16 jsonschema==4.26.0 jsonschema_specifications==2025.9.1
      referencing==0.37.0 rpds_py==2026.9.1 msgspec==0.22.0 pyzmq==27.3.0 blake3==1.0.11
      cachetools==8.0.2 cbor2==6.3.0 astor==0.8.1 dill==0.4.1 distro==1.9.0 gguf==0.19.0
      ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 partial_json_parser==0.2.1.1.post7
      model_hosting_container_standards==0.1.16 pybase64==1.5.1 python_json_logger==4.2.0
      setproctitle==1.3.8 sniffio==1.3.1 watchfiles==1.3.0 orjson==3.13.0
      redis hiredis rq zstandard ${EXTRA_PINS:-})
    ;;
  *)
    echo "gpu_stage: no recipe for vLLM $V (0.28.0 and 0.33.0 have one; 0.26.0: ../shared/gpu/stage.sh)" >&2
    exit 2
    ;;
esac
root=$(pwd)
out=.gpu/vllm-$V
mkdir -p .git/info "$out/dl"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
t0=$SECONDS
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
PIP_CONSTRAINT='' python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/dl" "${pins[@]}" 2>&1 \
  | grep -v '^WARNING: Location' || true
have=$(ls "$out/dl" | sed 's/-.*//' | tr 'A-Z.-' 'a-z__')
for p in "${pins[@]}"; do  # every pin must have its wheel (pip -q hides what it skipped)
  n=$(echo "${p%%[=<>]*}" | tr 'A-Z.-' 'a-z__')
  grep -qx "$n" <<< "$have" || { echo "gpu_stage: no wheel for $p" >&2; exit 1; }
done
( cd "$out/dl" && rm -f ./*.deb && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1 ) \
  || { apt-get update -qq >/dev/null && ( cd "$out/dl" && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 ); }
echo "downloaded $(ls "$out/dl" | wc -l) files, $(du -sm "$out/dl" | cut -f1) MiB in $((SECONDS - t0)) s"

# prefixq's own source: the committed tree (other work in progress in the checkout stays out),
# plus the working-tree files named in PREFIXQ_OVERLAY (space-separated paths)
rm -rf "$out"/c[0-9]* "$out/src" && mkdir -p "$out/c0" "$out/src"
git archive HEAD | tar -x -C "$out/src"
for f in ${PREFIXQ_OVERLAY:-}; do mkdir -p "$out/src/$(dirname "$f")" && cp "$f" "$out/src/$f"; done
tar -czf "$out/c0/prefixq-src.tar.gz" -C "$out/src" .
git rev-parse HEAD > "$out/c0/prefixq-src.commit"
echo "${PREFIXQ_OVERLAY:-}" > "$out/c0/prefixq-src.overlay"
cp scripts/gpu_install.sh "$out/c0/"
echo "$V" > "$out/c0/VLLM_VERSION"

# chunks of at most LIMIT_MIB: larger files are split (.part.NN, checked by SHA256SUMS on
# arrival), the rest packed first-fit, largest first
GPU_OUT=$out LIMIT_MIB=$LIMIT_MIB python3 - <<'PY'
import hashlib, os, shutil
out = os.environ["GPU_OUT"]
LIMIT = int(os.environ["LIMIT_MIB"]) << 20
dl = f"{out}/dl"
bins = [sum(os.path.getsize(f"{out}/c0/{f}") for f in os.listdir(f"{out}/c0"))]
def put(size):
    for i, used in enumerate(bins):
        if used + size <= LIMIT:
            bins[i] += size
            return i
    bins.append(size)
    return len(bins) - 1
sums = []
for f in sorted(os.listdir(dl), key=lambda f: -os.path.getsize(os.path.join(dl, f))):
    path = os.path.join(dl, f)
    size = os.path.getsize(path)
    if size <= LIMIT:
        i = put(size)
        os.makedirs(f"{out}/c{i}", exist_ok=True)
        shutil.copy(path, f"{out}/c{i}/{f}")
        continue
    sums.append(f"{hashlib.sha256(open(path, 'rb').read()).hexdigest()}  {f}\n")
    with open(path, "rb") as src:
        k = 0
        while chunk := src.read(LIMIT):
            i = put(len(chunk))
            os.makedirs(f"{out}/c{i}", exist_ok=True)
            open(f"{out}/c{i}/{f}.part.{k:02d}", "wb").write(chunk)
            k += 1
open(f"{out}/c0/SHA256SUMS", "w").writelines(sums)
PY
n=$(ls -d "$out"/c[0-9]* | wc -l)
echo "$n chunks, $(du -scm "$out"/c[0-9]* | tail -1 | cut -f1) MiB (vLLM $V), staged in $((SECONDS - t0)) s:"
du -sm "$out"/c[0-9]* | sort -V -k2 | sed 's#^#  #'
echo "send each of $out/c0 .. $out/c$((n - 1)) in its own call, back to back, carry=[\"$out/cK\"]:"
echo "  mkdir -p /tmp/stage && cp -r $out/cK/. /tmp/stage/"
echo "then:  bash /tmp/stage/gpu_install.sh && source /tmp/vllm-$V/env.sh"
