#!/usr/bin/env bash
# gpupool's allocator for PyTorch on the GPU machine, in one call (meant to fit 10 minutes):
# build gpupool, build the allocator against the installed PyTorch, fill in the feature table
# (tools/gpu/torch_feature_table.py: each feature under PyTorch's allocator, mempool(), use()
# and use()'s pluggable fallback, each in a fresh process), run the tests (the compile checks,
# the C API and private pools, tests/adapters/test_torch.py's GPU tests on the table's
# results, CuPy's graph capture on gpupool), and train ResNet-50 with cudnn.benchmark on
# gpupool. Logs in $OUT (default /tmp/gpupool-torchalloc); the table and the summary last.
#   STEPS=table,tests,models  (default) which steps run after the builds; `example` adds
#                            examples/train_digits_torch.py compiled (reduce-overhead) with
#                            cudnn.benchmark. The step timeouts keep the default within one
#                            10-minute call; a step that times out leaves its log.
#   SKIP_BUILD=1             gpupool is built already (tools/gpu/gpu-check.sh's torchalloc step)
#   TORCH_HEADERS=V=DIR      also compile against another PyTorch's headers (tests'
#                            GPUPOOL_TORCH_HEADERS, entries separated by ':')
#   MODELS_ARGS              replaces the ResNet-50 run's arguments; JOBS the table's children
#                            at once (default 8)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpupool-torchalloc}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 GPUPOOL_CACHE_DIR=${GPUPOOL_CACHE_DIR:-$OUT/cache}
: > "$OUT/summary.log"
summary() { echo "== $*" | tee -a "$OUT/summary.log"; }
STEPS=${STEPS:-table,tests,models}
step() { [[ ",$STEPS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.log"
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version(), 'CXX11 ABI', torch._C._GLIBCXX_USE_CXX11_ABI)" | tee -a "$OUT/summary.log"
if [ -z "${SKIP_BUILD:-}" ]; then
    if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"; summary "gpupool build FAILED"; exit 1
    fi
    summary "gpupool build ok"
fi

# The allocator, built as use() builds it (the time is the first use's cost).
python3 - > "$OUT/allocator-build.log" 2>&1 <<'PY'
import time, torch
from gpupool.adapters import torch_allocator as ta
start = time.perf_counter()
try:
    path = ta.build(torch)
except ta.Unavailable as exc:
    print("UNAVAILABLE:", exc)
    raise SystemExit(1)
print(f"built {path} in {time.perf_counter() - start:.1f} s")
print("compiler:", ta.compiler(), "| CUDA headers:", ta.cuda_include(torch.version.cuda))
PY
status=$?
summary "allocator build (rc=$status): $(tail -2 "$OUT/allocator-build.log" | tr '\n' ' ')"
[ $status -ne 0 ] && cat "$OUT/allocator-build.log" "$GPUPOOL_CACHE_DIR"/torch-allocator/*.log 2>/dev/null | tail -40

if step table; then
    timeout 220 python3 tools/gpu/torch_feature_table.py --json "$OUT/torch_features.json" \
        --jobs "${JOBS:-8}" > "$OUT/table.md" 2> "$OUT/table.err"
    summary "feature table rc=$? ($(tail -1 "$OUT/table.md"))"
fi
if step tests; then
    GPUPOOL_TORCH_CHILD_RESULTS="$OUT/torch_features.json" \
        GPUPOOL_TORCH_HEADERS="${TORCH_HEADERS:-}" timeout 200 python3 -m pytest -q -rs \
        -p no:cacheprovider tests/adapters/test_torch_allocator.py tests/region/test_privatepool.py \
        tests/c_api/test_capi.py tests/adapters/test_torch.py \
        "tests/adapters/test_cupy.py::test_step_captured_as_a_cuda_graph_inside_a_region_replays_like_eager_runs" \
        > "$OUT/tests.log" 2>&1
    summary "tests (rc=$?): $(tail -1 "$OUT/tests.log")"
fi
if step models; then
    timeout 130 python3 bench/real_models.py ${MODELS_ARGS:---models resnet50 --steps 8 \
        --cudnn-benchmark --columns torch,gp.vmm} --json "$OUT/real_models.json" \
        > "$OUT/models.log" 2>&1
    summary "real_models ResNet-50 cudnn.benchmark rc=$?"
fi
if step example; then
    timeout 400 python3 examples/train_digits_torch.py --quiet --epochs 10 \
        --compile reduce-overhead --cudnn-benchmark > "$OUT/example.log" 2>&1
    summary "train_digits_torch --compile reduce-overhead --cudnn-benchmark rc=$?"
    tail -8 "$OUT/example.log"
fi

grep -hE "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
[ -f "$OUT/models.log" ] && tail -25 "$OUT/models.log"
cat "$OUT/table.md"
cat "$OUT/summary.log"
