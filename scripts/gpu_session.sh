#!/usr/bin/env bash
# The one script the GPU machine runs (issue [4]): build the extension there, run the GPU
# tests, compute-sanitizer (memcheck + racecheck) on a representative case, the kernel
# benchmarks. Logs under $OUT (default ./out); a short table is printed last.
#   bash scripts/gpu_session.sh            # everything
#   STEPS="build bench" bash scripts/gpu_session.sh   # steps: build test worker graphs
#   simulate bench capacity sanitize
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
STEPS="${STEPS:-build test worker graphs simulate bench capacity sanitize}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
t0=$(date +%s)
note() { echo "[gpu_session $(( $(date +%s) - t0 ))s] $*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

note "host: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1); $($PY -c 'import sys,torch;print("python",sys.version.split()[0],"torch",torch.__version__,"cuda",torch.version.cuda)' 2>&1); $(nvcc --version | tail -1)"

if has build; then
  BUILD="${BUILD_DIR:-/tmp/hisparse_build}"
  (
    set -e
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DHISPARSE_REQUIRE_CUDA=ON -DPython_EXECUTABLE="$(command -v $PY)" \
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
  HISPARSE_RESOLVE_THREADS=512 timeout 120 $PY -m pytest -m gpu tests/ops/test_cuda_ops.py \
    -k "resolve or error or graph" -q -p no:cacheprovider -rfE >> "$OUT/pytest.log" 2>&1
  rc=$?
  note "pytest (resolve, 512-thread CTAs) rc=$rc: $(tail -n 1 "$OUT/pytest.log")"
fi

if has worker; then
  timeout 180 $PY -m pytest -m gpu tests/worker -q -p no:cacheprovider -rfE > "$OUT/pytest_worker.log" 2>&1
  rc=$?
  note "pytest -m gpu tests/worker rc=$rc: $(tail -n 1 "$OUT/pytest_worker.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_worker.log" | head -n 20 | tee -a "$SUMMARY"
  # decode steps through the attention hook captured in CUDA graphs (imports no vLLM; the
  # tests/vllm conftest does, hence --noconftest)
  timeout 120 $PY -m pytest --noconftest -m gpu tests/vllm/test_cuda_graph_steps.py -q \
    -p no:cacheprovider -rfE > "$OUT/pytest_graphs.log" 2>&1
  rc=$?
  note "pytest -m gpu tests/vllm/test_cuda_graph_steps.py rc=$rc: $(tail -n 1 "$OUT/pytest_graphs.log")"
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
  BUNDLE="${VBUNDLE:-$ROOT/.device/vbundle/vbundle.tar.gz}"
  if [[ ! -f "$BUNDLE" ]]; then
    note "simulate skipped: no vLLM bundle at $BUNDLE"
  else
    rm -rf /tmp/vbundle && tar xzf "$BUNDLE" -C /tmp
    SIM=(env PYTHONPATH="/tmp/vbundle/site:$ROOT" VBUNDLE_QUIET=1 $PY /tmp/vbundle/run_sim.py simulate --quiet)
    timeout 240 "${SIM[@]}" --device cpu --json "$OUT/sim_cpu.json" > "$OUT/sim_cpu.log" 2>&1
    note "simulate --device cpu rc=$?"
    timeout 240 "${SIM[@]}" --device cuda --ops-backend cuda --json "$OUT/sim_cuda.json" \
      > "$OUT/sim_cuda.log" 2>&1
    note "simulate --device cuda rc=$?"
    $PY /tmp/vbundle/compare.py "$OUT/sim_cpu.json" "$OUT/sim_cuda.json" > "$OUT/sim_compare.log" 2>&1
    note "simulate cpu vs cuda: $(tail -n 1 "$OUT/sim_compare.log")"
    # GPU-sized: 61 sparse layers with an indexer each (DeepSeek-V3.2) and 78 layers in
    # IndexShare groups of 4 (GLM-5.2-like), K 2048, 32K-token prompts, a pool that cannot
    # hold every request in full.
    for geo in "dsv32 --layers 61 --layers-per-indexer 1" "glm52 --layers 78 --layers-per-indexer 4"; do
      set -- $geo; name=$1; shift
      timeout "${SIM_LARGE_TIMEOUT:-170}" "${SIM[@]}" --device cuda --ops-backend cuda "$@" \
        --top-k 2048 --prompt-len 32768 --output-len ${SIM_LARGE_OUTPUT:-32} \
        --requests ${SIM_LARGE_REQUESTS:-8} --device-blocks ${SIM_LARGE_BLOCKS:-16000} \
        --max-num-seqs 8 --max-num-batched-tokens 8192 \
        --json "$OUT/sim_$name.json" > "$OUT/sim_$name.log" 2>&1
      rc=$?
      note "simulate $name (cuda) rc=$rc: $(grep -E '^exact|^MISMATCH|peak running' "$OUT/sim_$name.log" | tr '\n' ' ' | cut -c1-240)"
    done
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
if has capacity; then
  echo "---------------- decode capacity (position-major host pool) ----------------"
  sed -n '/ layers x /,$p' "$OUT/capacity.log" | grep -q . \
    && sed -n '/ layers x /,$p' "$OUT/capacity.log" || tail -n 30 "$OUT/capacity.log"
  if [[ "${CAPACITY_LAYER:-1}" == 1 ]]; then
    echo "---------------- decode capacity (layer-major host pool) ----------------"
    sed -n '/ layers x /,$p' "$OUT/capacity_layer.log" | grep -v "^|---" | head -n 12
  fi
fi
