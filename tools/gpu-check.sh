#!/usr/bin/env bash
# One call on the GPU machine: build there (no network), then the steps named in STEPS
# (default: all but traces and diag), logs to $OUT (at most 8 files come back: the build log
# only when the build fails, the plots as one tar), summary last.
#   tests     the whole test suite
#   memcheck  the GPU tests under compute-sanitizer memcheck (PyTorch's and JAX's left out:
#             MEMCHECK_K selects, MEMCHECK_TESTS names files)
#   example   the main job (examples/train_digits.py)
#   bench     bench/run_all.py (BENCH=a,b limits the scripts, BENCH_ARGS adds options)
#   traces    bench/record_trace.py: allocation traces of PyTorch training steps -> $OUT
#   diag      tools/diag_held_buffers.py under compute-sanitizer
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpupool-gpu-check}
STEPS=${STEPS:-tests,memcheck,example,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
summary() { echo "== $*" | tee -a "$OUT/summary.log"; }
step() { [[ ",$STEPS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/summary.log"
python3 -c "import sys, cuda.bindings, Cython; print(sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'Cython', Cython.__version__)" | tee -a "$OUT/summary.log"

if ! python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/gpupool-build.log 2>&1; then
    cp /tmp/gpupool-build.log "$OUT/build.log"; tail -40 "$OUT/build.log"; summary "build FAILED"
    exit 1
fi
summary "build ok"

if step tests; then
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs tests > "$OUT/tests.log" 2>&1
    summary "test suite (all tests, rc=$?): $(tail -1 "$OUT/tests.log")"
fi
if step memcheck; then
    GPUPOOL_UNDER_SANITIZER=1 GPUPOOL_STRESS_OPS=2000 timeout 400 compute-sanitizer --tool memcheck \
        --report-api-errors no --error-exitcode 99 python3 -m pytest -q -m gpu \
        -p no:cacheprovider -k "${MEMCHECK_K:-not torch and not jax and not mixed}" \
        ${MEMCHECK_TESTS:-tests} > "$OUT/memcheck.log" 2>&1
    summary "GPU tests under memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(grep -E 'passed|failed' "$OUT/memcheck.log" | tail -1)"
fi
if step diag; then
    timeout 120 compute-sanitizer --tool memcheck --report-api-errors no \
        python3 tools/diag_held_buffers.py > "$OUT/diag.log" 2>&1
    summary "diag (rc=$?): $(grep -E '^CuPy|^gpupool' "$OUT/diag.log" | tr '\n' ' ')"
fi
if step traces; then
    timeout 300 python3 bench/record_trace.py --out "$OUT" > "$OUT/traces.log" 2>&1
    summary "record_trace rc=$?: $(ls "$OUT"/*.npz 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
    mkdir -p bench/traces && cp "$OUT"/*.npz bench/traces/ 2>/dev/null     # for trace_replay
fi
if step example; then
    timeout 300 python3 examples/train_digits.py --quiet > "$OUT/example.log" 2>&1
    summary "examples/train_digits.py rc=$?"
fi
if step bench; then
    timeout 480 python3 bench/run_all.py --out /tmp/gpupool-bench ${BENCH:+--only "$BENCH"} \
        ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    summary "bench rc=$?"
    cat /tmp/gpupool-bench/*.txt > "$OUT/bench-tables.txt" 2>/dev/null
    (cd /tmp/gpupool-bench && tar cf "$OUT/plots.tar" *.png 2>/dev/null)    # one file back
fi

grep -hE "^(FAILED|ERROR)" "$OUT"/tests.log "$OUT"/memcheck.log 2>/dev/null | head -30
[ -f "$OUT/example.log" ] && tail -12 "$OUT/example.log"
[ -f "$OUT/bench-tables.txt" ] && grep -E "target|MISS|met" "$OUT/bench-tables.txt" | head -20
cat "$OUT/summary.log"
