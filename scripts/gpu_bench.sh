#!/usr/bin/env bash
# The GPU benchmark run, in steps that each fit one call to the GPU machine (no network there;
# vLLM and friends staged with ../shared/gpu/stage.sh and installed by install-on-gpu.sh).
#   scripts/gpu_bench.sh start "<prefixq bench args>"   redis-server + the benchmark, detached
#   scripts/gpu_bench.sh wait SECONDS                     wait for it, copy report/plot/logs to $OUT
# Every call replaces the checkout on the GPU machine: the detached benchmark runs from a copy
# of src/ in /tmp/pq with /tmp/pq as its working directory, and is waited on through a PID file
# (pgrep would match the waiting command itself).
set -euo pipefail
export PYTHONPATH=/tmp/site:/tmp/pq/src LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu
export PATH=/tmp/redis/usr/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=/tmp/bench
running() { [ -s $B/pid ] && kill -0 "$(cat $B/pid)" 2>/dev/null; }
case "$1" in
  start)
    mkdir -p $B /tmp/pq && rm -rf /tmp/pq/src && cp -r src /tmp/pq/src
    redis-server --port 6390 --save "" --appendonly no --daemonize yes --logfile $B/redis.log
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $B/gpu.txt
    python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
      >> $B/gpu.txt 2>&1
    cd /tmp/pq
    # shellcheck disable=SC2086
    setsid nohup python3 -m prefixq bench $2 --redis-url redis://127.0.0.1:6390/0 \
      --json $B/bench.json --plot $B/bench.png > $B/bench.log 2>&1 < /dev/null &
    echo $! > $B/pid
    echo "started (pid $(cat $B/pid)): $(cat $B/gpu.txt)"
    ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ] && running; do  # the plot is written after the JSON
      sleep 5
    done
    tail -c 6000 $B/bench.log
    cp $B/bench.json $B/bench.png $B/gpu.txt "$OUT"/ 2>/dev/null || true
    tail -c 200000 $B/bench.log > "$OUT"/bench.log
    for f in /tmp/prefixq-bench-*/worker-*.log; do [ -e "$f" ] && tail -c 100000 "$f" > "$OUT/$(basename "$f")"; done
    if [ -s $B/bench.json ]; then echo "DONE"; elif running; then echo "RUNNING"; else echo "EXITED"; fi
    ;;
esac
