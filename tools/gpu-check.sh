#!/usr/bin/env bash
# One call on the GPU machine: build there (no network), run the whole test suite, the GPU
# tests under compute-sanitizer memcheck, the main example and the benchmarks. Logs go to $OUT
# (at most 8 files come back); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpupool-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
summary() { echo "== $*" | tee -a "$OUT/summary.log"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/summary.log"
python3 -c "import sys, cuda.bindings, Cython; print(sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'Cython', Cython.__version__)" | tee -a "$OUT/summary.log"

if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; summary "build FAILED"; exit 1
fi
summary "build ok: $(grep -m1 'gpupool build:' "$OUT/build.log" || true)"

python3 -m pytest -q -rs tests > "$OUT/tests.log" 2>&1
summary "test suite (all tests, rc=$?): $(tail -1 "$OUT/tests.log")"

GPUPOOL_STRESS_OPS=2000 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 \
    python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests > "$OUT/memcheck.log" 2>&1
summary "GPU tests under memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(grep -E 'passed|failed' "$OUT/memcheck.log" | tail -1)"

timeout 300 python3 examples/train_digits.py --quiet > "$OUT/example.log" 2>&1
summary "examples/train_digits.py rc=$?"

# BENCH=alloc_latency,cross_stream runs only those scripts (default: all).
timeout 480 python3 bench/run_all.py --out /tmp/gpupool-bench ${BENCH:+--only "$BENCH"} \
    > "$OUT/bench.log" 2>&1
summary "bench rc=$?"
cat /tmp/gpupool-bench/*.txt > "$OUT/bench-tables.txt" 2>/dev/null
cp /tmp/gpupool-bench/region_memory.png "$OUT/" 2>/dev/null

grep -E "^(FAILED|ERROR)" "$OUT/tests.log" "$OUT/memcheck.log" | head -20
tail -25 "$OUT/example.log"
grep -E "target|MISS|met" "$OUT/bench-tables.txt" | head -20
cat "$OUT/summary.log"
