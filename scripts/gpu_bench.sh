#!/usr/bin/env bash
# The GPU benchmark run, in steps that each fit one call to the GPU machine (no network there;
# vLLM and friends staged with ../shared/gpu/stage.sh and installed by install-on-gpu.sh).
#   scripts/gpu_bench.sh start "<prefixq bench args>"   redis-server + the benchmark, detached
#   scripts/gpu_bench.sh start issue22 ["<more args>"]    issue 22's cases (below), more args win
#   scripts/gpu_bench.sh start issue22 "<more>" fleet "<more>"  several runs, one after another
#                                                         (bench.json, bench-2.json, ...)
#   scripts/gpu_bench.sh start "<args>" "" "@DIR <args>"  the second run's package from DIR (a
#                                                         src/ folder of the checkout: before/after)
#   scripts/gpu_bench.sh wait SECONDS                     wait for it, copy report/plot/logs to $OUT
#   scripts/gpu_bench.sh plan issue22 ["<more args>"]     (here, no GPU) the cases and their time
# $OUT gets bench.json, bench.png, gpu.txt, bench.log and the workers' logs (bench-K.* for run K).
# Every call replaces the checkout on the GPU machine: the detached benchmark runs from a copy
# of src/ in /tmp/pq with /tmp/pq as its working directory, and is waited on through a PID file
# (pgrep would match the waiting command itself).
set -euo pipefail
export PYTHONPATH=/tmp/site:/tmp/pq/src LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu
export PATH=/tmp/redis/usr/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=/tmp/bench
# Issue 22 on one H200 (and reuse, for issue 21's GC pauses): three engines (the standalone set-ups' engine, the offloading one, the
# worker's) of 16 GiB of KV cache each (131,072 tokens of Llama-3.1-8B), so that the overflow
# workloads (3x the capacity) stay short; gpu_memory_utilization=0.30 only for vLLM's start-up
# check that the GPU has that share free. Trim with more args: --workloads overflow,mixed,
# --setups sorted, --orders= and --admissions= (none), --burst-questions 1, --pairs 2 (`plan`).
ISSUE22="--gpus 0 --model dummy:llama-3.1-8b --engine-arg gpu_memory_utilization=0.30 \
  --engine-arg kv_cache_memory_bytes=17179869184 --engine-arg max_model_len=8192 --pairs 1 \
  --workloads overflow,multi-burst,system-prompt,mixed,reuse --bench-placements affinity --setups sorted,overflow:offload \
  --orders system-prompt:depth-first,mixed:decode-first \
  --admissions overflow:whole-groups,multi-burst:resident-first"
# Issue 31 on one H200: two workers' engines on GPU 0 (--gpus 0,0), the zipf workload (groups of
# widely different sizes), tail stealing off vs on, then a worker killed -9 at a quarter of the
# burst. max_num_seqs=128: each worker reads up to 256 entries ahead (2 x max_num_seqs), so most
# of a shard's queue is still in Redis, where a steal can reach it (the default, 1024 on an
# H200, would read the whole burst at once). orphan_after_s=15 (3 TTLs of 5 s) keeps the lost
# worker's case short; the default (45 s) only adds its difference to the detection.
FLEET="--gpus 0,0 --model dummy:llama-3.1-8b --engine-arg gpu_memory_utilization=0.30 \
  --engine-arg kv_cache_memory_bytes=17179869184 --engine-arg max_model_len=8192 \
  --engine-arg max_num_seqs=128 --workloads none --fleet steal,lose --pairs 2 --zipf-requests 1024 \
  --heartbeat-ttl-s 5 --orphan-after-s 15"
args() {
  case "$1" in
    issue22) echo "$ISSUE22 ${2:-}" ;;
    fleet) echo "$FLEET ${2:-}" ;;
    *) echo "$1" ;;
  esac
}
running() { [ -s $B/pid ] && kill -0 "$(cat $B/pid)" 2>/dev/null; }
case "$1" in
  start)
    mkdir -p $B /tmp/pq && rm -rf /tmp/pq/src && cp -r src /tmp/pq/src
    redis-server --port 6390 --save "" --appendonly no --daemonize yes --logfile $B/redis.log
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $B/gpu.txt
    python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
      >> $B/gpu.txt 2>&1
    cd /tmp/pq
    # the detached script records its own PID and runs the benchmarks one after another: `$!`
    # after `setsid` can be a setsid that forked and exited at once (../shared/gpu/README.md)
    rm -f $B/pid $B/bench*.json $B/bench*.png $B/bench*.json.partial
    printf '#!/usr/bin/env bash\necho $$ > %s/pid\n' "$B" > $B/run.sh
    shift
    k=1
    while [ $# -gt 0 ]; do
      name=bench; [ $k -gt 1 ] && name=bench-$k
      a=$(args "$1" "${2:-}") env=""
      if [ "${a#@}" != "$a" ]; then  # "@DIR <args>": this run's package from DIR (a before/after)
        dir=${a%% *} a=${a#* }
        rm -rf /tmp/pq/src-$k && cp -r "$OLDPWD/${dir#@}" /tmp/pq/src-$k
        env="PYTHONPATH=/tmp/site:/tmp/pq/src-$k "
      fi
      echo "${env}prefixq bench $a" >> $B/gpu.txt
      # each run within BENCH_LIMIT_S (default 25 min), so that one that hangs leaves the next its time
      printf '%stimeout -k 30 %d python3 -m prefixq bench %s --redis-url redis://127.0.0.1:6390/%d --json %s/%s.json --plot %s/%s.png\n' \
        "$env" "${BENCH_LIMIT_S:-1500}" "$a" "$k" "$B" "$name" "$B" "$name" >> $B/run.sh
      printf 'mkdir -p %s/logs-%d && cp /tmp/prefixq-bench-*/worker-*.log %s/logs-%d/ 2>/dev/null; rm -rf /tmp/prefixq-bench-*\n' \
        "$B" "$k" "$B" "$k" >> $B/run.sh
      k=$((k + 1)); shift; [ $# -gt 0 ] && shift
    done
    setsid nohup bash $B/run.sh > $B/bench.log 2>&1 < /dev/null &
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s $B/pid ] && break; sleep 0.5; done
    echo "started (pid $(cat $B/pid)): $(cat $B/gpu.txt)"
    ;;
  plan)  # on the development machine: what `start` would run, and an estimate of its duration
    # shellcheck disable=SC2046
    PYTHONPATH=src "${PYTHON:-python3}" -m prefixq bench $(args "$2" "${3:-}") --plan "${KV_TOKENS:-131072}"
    ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ] && running; do  # the plot is written after the JSON
      sleep 5
    done
    tail -c 6000 $B/bench.log
    # a run cut short (the machine taken back) keeps the cases it finished: bench*.json.partial
    cp $B/bench*.json $B/bench*.json.partial $B/bench*.png $B/gpu.txt "$OUT"/ 2>/dev/null || true
    tail -c 200000 $B/bench.log > "$OUT"/bench.log
    for f in $B/logs-*/worker-*.log /tmp/prefixq-bench-*/worker-*.log; do
      [ -e "$f" ] && tail -c 100000 "$f" > "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
    done
    runs=$(grep -c 'python3 -m prefixq' $B/run.sh)
    if [ "$(ls $B/bench*.json 2>/dev/null | wc -l)" -ge "$runs" ]; then echo "DONE"
    elif running; then echo "RUNNING ($(ls $B/bench*.json 2>/dev/null | wc -l) of $runs done)"
    else echo "EXITED"; fi
    ;;
esac
