#!/usr/bin/env bash
# The one script the GPU machine runs (issue [4]): build the extension there, run the GPU
# tests, compute-sanitizer (memcheck + racecheck) on a representative case, the kernel
# benchmarks. Logs under $OUT (default ./out); a short table is printed last.
#   bash scripts/gpu_session.sh            # everything
#   STEPS="build bench" bash scripts/gpu_session.sh   # steps: build test standins worker graphs
#   simulate adaptive scored throughput overlap connector bench capacity sanitize tp2
#   (build skips compiling when a carried vllm_hisparse/_C*.so of this Python imports and
#   holds the probe kernels: cmake -DHISPARSE_PROBE_KERNELS=ON)
#   HUGEPAGES_GIB=30 STEPS="connector" ...  # reserve 2 MiB hugetlb pages first (root), logged
#   STEPS=throughput THROUGHPUT_ARGS="--geometries dsv32 glm51 --contexts 32768 --dbo-ceiling" ...
#     # THROUGHPUT_ARGS goes to bench throughput as is; --dbo-ceiling adds the two-micro-batch
#     # ceiling (issue [16]) to each connector run (docs/benchmarks.md, "Throughput")
#   STEPS=throughput THROUGHPUT_ARGS="--contexts 4096 --sim-layers 8 16 --no-realism" ...
#     # every case at 8 and 16 layers: the real step's GPU time fitted per step + per layer
#   STEPS=throughput THROUGHPUT_ARGS="--contexts 4096 --no-realism --inline-conversion" ...
#     # the connector's leaders convert on the compute stream (the overlap_conversion A/B)
#   STEPS=overlap ...  # that A/B on GLM-5.2 IndexShare at 32K, misses per timed step printed
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
STEPS="${STEPS:-build test standins worker graphs simulate throughput bench capacity sanitize tp2}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
t0=$(date +%s)
note() { echo "[gpu_session $(( $(date +%s) - t0 ))s] $*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

# The vLLM bundle (../shared/tools/gpu-vllm/README.md; carry .device/vbundle), unpacked once.
BUNDLE="${VBUNDLE:-$ROOT/.device/vbundle/vbundle.tar.gz}"
vbundle() {
  [[ -f "$BUNDLE" ]] || return 1
  [[ -f /tmp/vbundle/run_sim.py ]] || { rm -rf /tmp/vbundle && tar xzf "$BUNDLE" -C /tmp; }
}
SIM=(env PYTHONPATH="/tmp/vbundle/site:$ROOT" VBUNDLE_QUIET=1 $PY /tmp/vbundle/run_sim.py simulate --quiet)
# the benchmarks that need vLLM, through the bundle: "${BENCH[@]}" TARGET ARGS...
BENCH=(env PYTHONPATH="/tmp/vbundle/site:$ROOT" VBUNDLE_QUIET=1 $PY /tmp/vbundle/run_sim.py bench)
# sim_run NAME cpu|cuda ARGS...: one bundle simulate into $OUT/sim_NAME.{json,log}; prints
# the report's verdict lines and the given extra pattern's ($SIM_GREP) lines on one line.
sim_run() {
  local name=$1 device=$2; shift 2
  local ops=(); [[ $device == cuda ]] && ops=(--ops-backend cuda)
  timeout "${SIM_TIMEOUT:-200}" "${SIM[@]}" "$@" --device "$device" "${ops[@]}" \
    --json "$OUT/sim_$name.json" > "$OUT/sim_$name.log" 2>&1
  local rc=$?
  echo "rc=$rc: $(grep -E "^exact|^MISMATCH${SIM_GREP:+|$SIM_GREP}" "$OUT/sim_$name.log" | tr '\n' ' ' | cut -c1-260)"
}
# sim_agree A B: the bundle's compare.py on two sim_run reports (AGREE / DIFFER)
sim_agree() {
  $PY /tmp/vbundle/compare.py "$OUT/sim_$1.json" "$OUT/sim_$2.json" > "$OUT/sim_$1_vs_$2.log" 2>&1
  tail -n 1 "$OUT/sim_$1_vs_$2.log"
}

note "host: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1); $($PY -c 'import sys,torch;print("python",sys.version.split()[0],"torch",torch.__version__,"cuda",torch.version.cuda)' 2>&1); $(nvcc --version | tail -1)"

if [[ -n "${HUGEPAGES_GIB:-}" ]]; then
  # Reserve 2 MiB hugetlb pages for the host pools of the steps below (HostPool takes them
  # first when enough are free and logs what it got). Needs root; the page count is logged.
  echo $(( HUGEPAGES_GIB * 512 )) > /proc/sys/vm/nr_hugepages 2>/dev/null
  note "hugetlb: asked for $(( HUGEPAGES_GIB * 512 )) pages of 2 MiB: $(grep -E '^HugePages_(Total|Free)' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
fi

if has build && $PY -c 'import vllm_hisparse._C as c; assert c.has_probe_kernels' 2>/dev/null; then
  note "build skipped: a carried $(ls vllm_hisparse/_C*.so | head -n 1) imports (probe kernels in)"
elif has build; then
  BUILD="${BUILD_DIR:-/tmp/hisparse_build}"
  (
    set -e
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DHISPARSE_REQUIRE_CUDA=ON -DHISPARSE_PROBE_KERNELS=ON -DPython_EXECUTABLE="$(command -v $PY)" \
      -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)"
    ninja -C "$BUILD"
    cp "$BUILD"/_C*.so "$ROOT/vllm_hisparse/"
  ) > "$OUT/build.log" 2>&1
  rc=$?
  grep -E "registers|spill" "$OUT/build.log" | tail -n 40 > /dev/null
  note "build rc=$rc ($(grep -c 'warning' "$OUT/build.log") warnings)"
  if [[ $rc -ne 0 ]]; then tail -n 40 "$OUT/build.log"; exit 1; fi
  $PY -c 'from vllm_hisparse.ops import cuda; assert cuda.available(); print("kernels available")' 2>&1 | tee -a "$SUMMARY"
fi

if has test; then
  timeout 240 $PY -m pytest -m gpu tests/ops -q -p no:cacheprovider -rfE \
    --durations=8 > "$OUT/pytest.log" 2>&1
  rc=$?
  note "pytest -m gpu tests/ops rc=$rc: $(tail -n 1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20 | tee -a "$SUMMARY"
  # the resolve tests again with 512-thread CTAs (the non-default configuration)
  HISPARSE_RESOLVE_THREADS=512 timeout 120 $PY -m pytest -m gpu tests/ops/test_cuda_resolve.py \
    tests/ops/test_cuda_resolve_errors.py -q -p no:cacheprovider -rfE >> "$OUT/pytest.log" 2>&1
  rc=$?
  note "pytest (resolve, 512-thread CTAs) rc=$rc: $(tail -n 1 "$OUT/pytest.log")"
fi

if has standins; then
  # bench throughput's fused Triton stand-ins (sparse MLA decode, indexer logits) against
  # their torch twins at the geometries' sizes
  timeout 240 $PY -m pytest -m gpu tests/cli/test_standin_kernels.py -q -p no:cacheprovider -rfE \
    --durations=4 > "$OUT/pytest_standins.log" 2>&1
  rc=$?
  note "pytest -m gpu test_standin_kernels rc=$rc: $(tail -n 1 "$OUT/pytest_standins.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_standins.log" | head -n 20 | tee -a "$SUMMARY"
fi

if has worker; then
  timeout 180 $PY -m pytest -m gpu tests/worker -q -p no:cacheprovider -rfE > "$OUT/pytest_worker.log" 2>&1
  rc=$?
  note "pytest -m gpu tests/worker rc=$rc: $(tail -n 1 "$OUT/pytest_worker.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_worker.log" | head -n 20 | tee -a "$SUMMARY"
  # decode steps through the attention hook captured in CUDA graphs (imports no vLLM; the
  # tests/vllm conftest does, hence --noconftest)
  timeout 150 $PY -m pytest --noconftest -m gpu tests/vllm/test_cuda_graph_steps.py \
    tests/vllm/test_shared_conversion.py -q -p no:cacheprovider -rfE \
    > "$OUT/pytest_graphs.log" 2>&1
  rc=$?
  note "pytest -m gpu test_cuda_graph_steps + test_shared_conversion rc=$rc: $(tail -n 1 "$OUT/pytest_graphs.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_graphs.log" | head -n 20 | tee -a "$SUMMARY"
fi

if has graphs; then
  # a decode step through the attention hook, eager vs replayed as one CUDA graph
  timeout 240 $PY -m vllm_hisparse.cli.main bench graphs --json "$OUT/graphs.json" \
    ${GRAPHS_ARGS:-} > "$OUT/graphs.log" 2>&1
  note "bench graphs rc=$?: $(tail -n 2 "$OUT/graphs.log" | tr '\n' ' ')"
fi

if has capacity; then
  # the default (position-major) host pool, then (CAPACITY_LAYER=1, the default) the
  # layer-major one for comparison
  timeout 480 $PY -m vllm_hisparse.cli.main bench capacity --json "$OUT/capacity.json" \
    ${CAPACITY_ARGS:-} > "$OUT/capacity.log" 2>&1
  note "bench_decode_capacity rc=$?"
  if [[ "${CAPACITY_LAYER:-1}" == 1 ]]; then
    timeout 240 $PY -m vllm_hisparse.cli.main bench capacity --layout layer ${CAPACITY_ARGS:-} \
      > "$OUT/capacity_layer.log" 2>&1
    note "bench_decode_capacity --layout layer rc=$?"
  fi
fi

if has bench; then
  timeout 330 $PY -m vllm_hisparse.cli.main bench kernels --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  note "bench rc=$?"
fi

if has simulate; then
  # End to end: vLLM 0.33's real Scheduler + both connector roles + our kernels, through the
  # vLLM bundle (../shared/tools/gpu-vllm/README.md; carry .device/vbundle). The default
  # simulate on the reference ops (CPU) and on the kernels (CUDA) must give identical counters;
  # then GPU-sized workloads (DeepSeek-V3.2 and GLM-5.2 geometry) too slow for the CPU.
  if ! vbundle; then
    note "simulate skipped: no vLLM bundle at $BUNDLE"
  else
    note "simulate --device cpu $(SIM_TIMEOUT=240 sim_run cpu cpu)"
    note "simulate --device cuda $(SIM_TIMEOUT=240 sim_run cuda cuda)"
    note "simulate cpu vs cuda: $(sim_agree cpu cuda)"
    # GPU-sized: 61 sparse layers with an indexer each (DeepSeek-V3.2) and 78 layers in
    # IndexShare groups of 4 (GLM-5.2-like), K 2048, 32K-token prompts, a pool that cannot
    # hold every request in full.
    for geo in "dsv32 --layers 61 --layers-per-indexer 1" "glm52 --layers 78 --layers-per-indexer 4"; do
      set -- $geo; name=$1; shift
      note "simulate $name (cuda) $(SIM_TIMEOUT=${SIM_LARGE_TIMEOUT:-170} SIM_GREP='peak running' \
        sim_run $name cuda "$@" --top-k 2048 --prompt-len 32768 \
        --output-len ${SIM_LARGE_OUTPUT:-32} --requests ${SIM_LARGE_REQUESTS:-8} \
        --device-blocks ${SIM_LARGE_BLOCKS:-16000} --max-num-seqs 8 --max-num-batched-tokens 8192)"
    done
  fi
fi

if has adaptive; then
  # Per-request hot regions (adaptive_hot_region) end to end: the same simulate with requests
  # whose selections drift differently, on the reference ops (CPU) and the kernels (CUDA):
  # identical counters, every row exact (docs/core.md, "Per-request hot size").
  if ! vbundle; then
    note "adaptive skipped: no vLLM bundle at $BUNDLE"
  else
    ADA=(--runs with --topk-drift mixed --adaptive-hot-region ${ADAPTIVE_ARGS:-})
    note "simulate --adaptive-hot-region, cpu $(sim_run adaptive_cpu cpu "${ADA[@]}")"
    note "simulate --adaptive-hot-region, cuda $(SIM_GREP='hot blocks' sim_run adaptive_cuda cuda "${ADA[@]}")"
    note "adaptive simulate cpu vs cuda: $(sim_agree adaptive_cpu adaptive_cuda)"
  fi
fi

if has scored; then
  # Score-aware eviction (hot_region_eviction: score) end to end: selections from a synthetic
  # indexer through vLLM's SparseIndexerTopk, its logits recorded by the indexer_scores
  # patch, slot classes computed in the leader's conversion (docs/core.md, "Beyond LRU").
  # score: CPU vs CUDA identical counters, every row exact; lru on CUDA for the miss rates.
  if ! vbundle; then
    note "scored skipped: no vLLM bundle at $BUNDLE"
  else
    SC=(--runs with --topk-drift scored ${SCORED_ARGS:-})
    note "simulate scored, score eviction, cpu $(sim_run score_cpu cpu "${SC[@]}" --hot-region-eviction score)"
    for ev in score lru; do
      note "simulate scored, $ev eviction, cuda $(SIM_GREP='miss rate \(all|bytes H2D' sim_run ${ev}_cuda cuda "${SC[@]}" --hot-region-eviction $ev)"
    done
    note "scored simulate (score eviction) cpu vs cuda: $(sim_agree score_cpu score_cuda)"
  fi
fi

if has throughput; then
  # The headline figure: decode tokens/s against concurrency, full vs hybrid vs the no-IO
  # oracle, model-shaped layers replayed from CUDA graphs through vLLM's scheduler and both
  # connector roles (docs/benchmarks.md, "Throughput"). THROUGHPUT_ARGS narrows it (or adds
  # --dbo-ceiling: the two-micro-batch ceiling as a fourth column).
  if ! vbundle; then
    note "throughput skipped: no vLLM bundle at $BUNDLE"
  else
    timeout "${THROUGHPUT_TIMEOUT:-540}" "${BENCH[@]}" throughput --json "$OUT/throughput.json" \
      --plot "$OUT/throughput.png" ${THROUGHPUT_ARGS:-} > "$OUT/throughput.log" 2>&1
    note "bench throughput rc=$?"
    # each start's host link (bench throughput measures it first): hybrid figures carry it
    grep -m 1 "^host link" "$OUT/throughput.log" | tee -a "$SUMMARY"
  fi
fi

if has overlap; then
  # The leader's conversion on its index group's side stream against the inline one, on
  # GLM-5.2 IndexShare at 32K, where start G's hybrid steps counted 2/3 of start F's misses
  # (docs/benchmarks.md, "Today's code"): each run's misses per timed step and index group
  # at every point.
  if ! vbundle; then
    note "overlap skipped: no vLLM bundle at $BUNDLE"
  else
    for mode in overlap inline; do
      extra=(); [[ $mode == inline ]] && extra=(--inline-conversion)
      timeout "${OVERLAP_TIMEOUT:-240}" "${BENCH[@]}" throughput --geometries glm52 \
        --contexts 32768 --no-realism "${extra[@]}" --json "$OUT/throughput_$mode.json" \
        > "$OUT/throughput_$mode.log" 2>&1
      note "throughput glm52 32K, $mode conversion, rc=$?: $($PY - "$OUT/throughput_$mode.json" <<'PYEOF' 2>&1
import json, sys
case = json.load(open(sys.argv[1]))["cases"][0]
for n, point in sorted(case["runs"]["hybrid"]["points"].items(), key=lambda kv: -int(kv[0])):
    print(f"{n}: " + ", ".join(
        f"{kind} {point[kind].get('misses_per_unit_per_step', point[kind].get('misses_per_step'))}"
        for kind in ("hybrid", "oracle") if kind in point), end="; ")
PYEOF
)"
    done
  fi
fi

if has connector; then
  # Decode tokens/s through vLLM's scheduler, both connector roles and the attention hook,
  # with and without the connector at one HBM budget, next to the no-IO oracle of the same
  # run, per index geometry (docs/benchmarks.md, "Decode capacity through the connector").
  if ! vbundle; then
    note "connector skipped: no vLLM bundle at $BUNDLE"
  else
    timeout "${CONNECTOR_TIMEOUT:-420}" "${BENCH[@]}" connector --json "$OUT/connector.json" \
      ${CONNECTOR_ARGS:-} > "$OUT/connector.log" 2>&1
    note "bench connector rc=$?: $(grep -E 'host pool:' "$OUT/connector.log" | head -n 1 | cut -c1-200)"
  fi
fi

if has tp2; then
  # Two tensor-parallel ranks, one per GPU, on one shared host pool (docs/worker.md, "Tensor
  # parallelism"): the two-GPU tests (decode loop and writer/reader exact against the
  # reference), each rank's gather bandwidth alone and both at once (PCIe links are per GPU:
  # ~2x aggregate expected), and simulate with two workers (vLLM's scheduler votes both
  # ranks' acks, every row of both ranks checked), with the shared pool and with private
  # pools: host memory held once vs twice per host block.
  NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [[ "$NGPU" -lt 2 ]]; then
    note "tp2 skipped: $NGPU CUDA device(s) visible, the two-rank run needs 2 (kind nvidia-h200-x2)"
  else
    note "tp2: $NGPU GPUs; /dev/shm (size, free): $(df -h --output=size,avail /dev/shm 2>/dev/null | tail -n 1)"
    timeout 300 $PY -m pytest -m gpu tests/worker/test_decode_loop_tp.py \
      tests/worker/test_host_pool_shared.py -k "two_gpus" -q -p no:cacheprovider -rfE \
      > "$OUT/tp2_pytest.log" 2>&1
    note "tp2 pytest (two GPUs) rc=$?: $(tail -n 1 "$OUT/tp2_pytest.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tp2_pytest.log" | head -n 20 | tee -a "$SUMMARY"
    timeout 300 $PY -m vllm_hisparse.cli.main bench tp-gather --json "$OUT/tp2_gather.json" \
      ${TP2_GATHER_ARGS:-} > "$OUT/tp2_gather.log" 2>&1
    note "tp2 bench tp-gather rc=$?"
    grep -E "^tp-gather|^pages|^\||^GB/s|^host memory|^exact|^NOT EXACT" "$OUT/tp2_gather.log" \
      | tee -a "$SUMMARY"
    if ! vbundle; then
      note "tp2 simulate skipped: no vLLM bundle at $BUNDLE"
    else
      for pool in shared private; do
        shared=1; [[ $pool == private ]] && shared=0
        VLLM_HISPARSE_SHARED_HOST_POOL=$shared timeout 300 "${SIM[@]}" --device cuda \
          --ops-backend cuda --tensor-parallel-size 2 --runs with ${TP2_SIM_ARGS:-} \
          --json "$OUT/sim_tp2_$pool.json" > "$OUT/sim_tp2_$pool.log" 2>&1
        note "simulate --tensor-parallel-size 2 ($pool pools) rc=$?: $(grep -E '^exact|MISMATCH|FAILED' "$OUT/sim_tp2_$pool.log" | cut -c1-160)"
        grep -E "^host memory" "$OUT/sim_tp2_$pool.log" | tee -a "$SUMMARY"
      done
      $PY - "$OUT/sim_tp2_shared.json" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
try:
    run = json.load(open(sys.argv[1]))["runs"]["with connector"]
    w, r = run["ranks"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"tp2 simulate ranks: no two-rank report in {sys.argv[1]} ({exc!r})")
same = all(w[k] == r[k] for k in ("resident", "hot_hits", "misses", "rows_checked"))
print(f"tp2 simulate ranks: same decisions and rows checked {same}; rank 1 wrote "
      f"{r['bytes_d2h']} B and gathered {r['gather_bytes']} B from rows rank 0 wrote "
      f"({w['bytes_d2h']} B); pages {w['host_pool']['page_mode']}")
PYEOF
    fi
  fi
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool "$tool" --target-processes all --print-limit 30 \
      $PY tests/ops/sanitize_case.py > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_case' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
  # The resolve fast path's representative cells are written with relaxed stores that race
  # on purpose (docs/kernels.md, "Counting resident positions"); racecheck reports those
  # too. Any other reported race is a finding.
  races=$(grep -c "Race reported" "$OUT/sanitize_racecheck.log")
  intended=$(grep -c "Race reported between Write access at .*store_relaxed" "$OUT/sanitize_racecheck.log")
  note "racecheck: $races race reports, $intended of them the representative cells' intended stores"
fi

echo "================ summary ================"
cat "$SUMMARY"
if has bench; then
  echo "---------------- bench ----------------"
  cat "$OUT/bench.log"
fi
if has throughput; then
  echo "---------------- decode throughput (bench throughput) ----------------"
  grep -vE "Initializing KVConnectorBase|Warning|^W[0-9]{4}" "$OUT/throughput.log" | tail -n 80
fi
if has connector; then
  echo "---------------- decode through the connector ----------------"
  sed -n '/ sparse layers x /,$p' "$OUT/connector.log" | grep -q . \
    && sed -n '/ sparse layers x /,$p' "$OUT/connector.log" || tail -n 30 "$OUT/connector.log"
fi
if has capacity; then
  echo "---------------- decode capacity (position-major host pool) ----------------"
  sed -n '/ layers x /,$p' "$OUT/capacity.log" | grep -q . \
    && sed -n '/ layers x /,$p' "$OUT/capacity.log" || tail -n 30 "$OUT/capacity.log"
  if [[ "${CAPACITY_LAYER:-1}" == 1 ]]; then
    echo "---------------- decode capacity (layer-major host pool) ----------------"
    sed -n '/ layers x /,$p' "$OUT/capacity_layer.log" | grep -v "^|---" | head -n 12
  fi
fi
