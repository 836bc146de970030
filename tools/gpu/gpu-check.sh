#!/usr/bin/env bash
# One call on the GPU machine: build there (no network), then the steps named in STEPS
# (default: tests,memcheck,example,bench), logs to $OUT (at most 8 files come back: the build log
# only when the build fails, the plots as one tar), summary last.
#   tests     the whole test suite (TESTS names files instead)
#   parts     the whole suite as ten lanes run side by side (separate processes, one log
#             each, failures named with -rfE, returned as parts.tar, written every 15 s so
#             that a call the device tool cuts returns the logs so far): a crash or a hang in
#             one lane leaves the others' summaries, and a lane cut at PARTS_TIMEOUT names
#             the test it was in; the device-memory checks run after (PARTS_LANES=a-f,ipc
#             runs only the lanes named)
#   memcheck  GPU tests under compute-sanitizer memcheck, about 7 s a test there (H100,
#             f162020: the whole GPU suite did not finish in 370 s), so by default the core,
#             upstream, C API, CuPy, Numba and IPC-handle files (PyTorch's and JAX's left out:
#             MEMCHECK_K selects; MEMCHECK_TESTS names files, "tests" for all), verbose, so a
#             run cut at MEMCHECK_TIMEOUT names the test it was in
#   example   the main job (examples/train_digits.py)
#   bench     bench/run_all.py (BENCH=a,b limits the scripts, BENCH_ARGS adds options)
#   traces    bench/record_trace.py: allocation traces of PyTorch training steps -> $OUT, and
#             of the workloads RECORD_MODELS (default gpt2-ckpt,llama-ckpt,gpt2-generate; empty:
#             none), RECORD_STEPS steps each (12), step starts marked, into
#             bench/data/traces-real there (for fragmentation.py), returned as traces-real.tar
#   models    bench/real_models.py (MODELS_ARGS adds options, e.g. "--models gpt2-ckpt,llama-ckpt
#             --columns torch,gp.vmm --steps 24"; MODELS_TRACES=1 also records the allocation
#             traces, returned as traces.tar)
#   headers   PyTorch's C++ allocator headers, returned as torch-headers.tar.gz (for
#             tests/adapters/test_torch_allocator.py's GPUPOOL_TORCH_HEADERS)
#   torchalloc  gpupool's allocator for PyTorch: tools/gpu/torch-alloc-check.sh (logs in
#             $OUT/torchalloc; TORCHALLOC_STEPS its steps, default table,tests,models)
#   profile   tools/profile/profile_threads.py: the C API loop on 1 and 8 threads (and 8 beside 7
#             idle ones), one run under perf where the machine has it (perf.txt; PERF_ARGS
#             its options, default 8 threads on per-thread streams beside 7 idle ones)
#   ab        the same real_models.py runs on this tree and on a base (A/B), in AB_ROUNDS
#             rounds (3), the ways alternating and each one first in turn: this tree's
#             AB_COLUMNS (torch.exp,gp.vmm.region,gp.vmm.plan), the base's AB_BASE_COLUMNS
#             (gp.vmm.plan), AB_ARGS the runs' options ("--models llama-ckpt --steps 40
#             --sampler native"), AB_TIMEOUT each run's limit (200 s). The base is
#             .ab-base/, made by tools/gpu/ab-base.sh REV here and carried (carry [".whl",
#             ".ab-base"]); it is built in place and put first on PYTHONPATH for its runs.
#             Each run's JSON names the build it imported (env.gpupool_from); all come back
#             as ab.tar with ab.log (one file each: the device tool returns at most 8 files)
#   threads   bench/threads.py alone, THREADS_ARGS its options (run_all.py takes no --columns)
#   pair      bench/alloc_latency.py's gpupool columns alone (PAIR_COLUMNS, default
#             gp,gp.region,gp.plan), PAIR_ROUNDS rounds (3) of fresh processes, the column
#             order reversed every other round (METHOD.md: ways interleaved, repeated) ->
#             pair.log; a few seconds a round, for a call too short for the bench step
#   sleep     bench/sleep_cycle.py alone (SLEEP_ARGS its options, e.g. "--nbytes 4GiB --reps 11"):
#             a tagged pool's sleep and wake of 10 GiB, with and without offload, beside a plain
#             pinned copy of the same size, targets judged -> sleep.log
#   numba     numba-cuda's own tests (the driver layer, arrays, __cuda_array_interface__, IPC,
#             streams) in three runs, one process each: Numba's default memory manager,
#             gpupool.numba on its default upstream (expandable segments) and gpupool.numba
#             with GPUPOOL_UPSTREAM=driver: tools/gpu/numba_suite.py (NUMBA_SUITE_ARGS its
#             options, default "--parallel --timeout 400": the three processes at once, so
#             that they and a fresh build fit one call; "--runs default,gpupool-driver"
#             leaves a run out; e.g. "--modules numba.cuda.tests.cudadrv --timeout 250" runs
#             one after the other; NUMBA_TIMEOUT the step's limit, default 450 s): numba.log,
#             numba.json (outcomes, tracebacks of failures) and numba-runs.tar (each run's
#             log and record); rc 0 when no test fails only under a gpupool run beyond the
#             known limits the suite lists apart (VMM_IPC_LEGACY_HANDLE on expandable
#             segments). numba-cuda's tests import filecheck (its wheel in .whl). On the H200
#             (81fae5e) the default modules took 39 s per run, two runs side by side
# Wheels carried in .whl (RMM: rmm-cu13, librmm-cu13, rapids-logger) are installed first;
# SKIP_BUILD=1 skips the build where gpupool imports (an earlier run on the same machine
# made it); a machine started fresh between calls builds anyway. The device tool kills the
# whole call at its limit and only $OUT comes back: keep each step's timeout (PARTS_TIMEOUT,
# NUMBA_TIMEOUT, ...) plus the build (about 70 s) inside the call's limit, or a step's logs,
# still under /tmp, are lost.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpupool-gpu-check}
STEPS=${STEPS:-tests,memcheck,example,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
summary() { echo "== $*" | tee -a "$OUT/summary.log"; }
step() { [[ ",$STEPS," == *",$1,"* ]]; }

if ! command -v nvidia-smi > /dev/null; then
    summary "no GPU here (no nvidia-smi on this machine): this script runs on the GPU machine"
    exit 2
fi
if ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        > "$OUT/summary.log" 2>&1; then
    summary "no GPU here (nvidia-smi: $(head -1 "$OUT/summary.log")): this script runs on the GPU machine"
    exit 2
fi
cat "$OUT/summary.log"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import sys, cuda.bindings, Cython; print(sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'Cython', Cython.__version__)" | tee -a "$OUT/summary.log"

if [ -n "${SKIP_BUILD:-}" ] && python3 -c "import gpupool.core.pool" 2> /dev/null; then
    :   # built by an earlier run of this script on this machine (a fresh machine builds)
elif ! python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/gpupool-build.log 2>&1; then
    cp /tmp/gpupool-build.log "$OUT/build.log"; tail -40 "$OUT/build.log"; summary "build FAILED"
    exit 1
fi
summary "build ok"

if step tests; then
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs ${TESTS:-tests} > "$OUT/tests.log" 2>&1
    summary "test suite (all tests, rc=$?): $(tail -1 "$OUT/tests.log")"
fi
if step parts; then
    # Six lanes side by side; the tests that read the device's free memory (cuMemGetInfo),
    # which the other lanes change, run alone after them. The host-only harness of
    # tests/adapters/test_torch_allocator.py gets a process of its own (it crashed one on the
    # H200). Lanes take files by basename: test_[a-m]* and the rest, wherever they sit.
    mkdir -p /tmp/gpupool-parts && rm -f /tmp/gpupool-parts/*
    lane() {    # lane NAME PYTEST-ARGS...: one pytest process, its log, its last line
        [ -n "${PARTS_LANES:-}" ] && [[ ",$PARTS_LANES," != *",$1,"* ]] && return 0
        # -v names each test as it starts, so a lane cut at its timeout shows where it was;
        # faulthandler dumps every thread's stack for a test that runs past 200 s
        timeout ${PARTS_TIMEOUT:-480} python3 -m pytest -v -rfEs -p no:randomly -p no:cacheprovider \
            -o faulthandler_timeout=200 --durations=10 "${@:2}" > "/tmp/gpupool-parts/$1.log" 2>&1
        echo "rc=$?" >> "/tmp/gpupool-parts/$1.log"
    }
    # Tests that read the device's used memory (cuMemGetInfo) with a tolerance that the other
    # lanes' allocations break.
    alone="1000_export_open_close or trim_gives_whole_free_pages_back_to_the_device or \
sleep_frees_the_pages_and_a_graph_replays_after_wake or sleep_wake_swaps_a_trainer_and_an_engine or \
tensors_over_slept_memory_keep_their_addresses"
    harness="come_from_gpupool or stats_are_gpupool or out_of_memory_is_pytorch or \
empty_cache_trims or base_allocation_and or capture_s_allocations or mempool_counts or \
stream_uses_waits or checkpointed or history_records"
    af=(); gm=(); nz=(); rg=()
    for f in tests/test_*.py tests/*/test_*.py; do
        case $f in
            tests/region/test_[n-z]*) rg+=("$f"); continue ;;
        esac
        case $(basename "$f") in
            test_torch.py|test_torch_allocator.py|test_ipc_*.py|test_examples.py) ;;
            test_[a-f]*) af+=("$f") ;;
            test_[g-m]*) gm+=("$f") ;;
            *) nz+=("$f") ;;
        esac
    done
    # Ten lanes: on the H100 (e61abe4) the a-m files, test_torch.py and test_examples.py
    # each ran past 330 s as one lane, so each is split in two; on the H100 at 8f332c3 the
    # n-z lane was cut at 540 s with 702 of its tests passed, so tests/region's n-z files
    # (the planned regions' random runs) are a lane of their own
    # The lanes' logs so far go to $OUT every 15 s: the device tool kills a call at its limit
    # and returns only $OUT, so a call cut there still names the tests each lane passed.
    (while sleep 15; do (cd /tmp/gpupool-parts && tar cf "$OUT/parts.tar.part" *.log \
        2> /dev/null && mv "$OUT/parts.tar.part" "$OUT/parts.tar"); done) &
    saver=$!
    disown $saver       # not one of the lanes that `wait` waits for
    lane a-f "${af[@]}" -k "not ($alone)" &
    lane g-m "${gm[@]}" -k "not ($alone)" &
    lane n-z "${nz[@]}" -k "not ($alone)" &
    lane region-n-z "${rg[@]}" -k "not ($alone)" &
    lane torch-use tests/adapters/test_torch.py -k "not mempool and not ($alone)" &
    lane torch-mempool tests/adapters/test_torch.py -k "mempool" &
    (lane torch_allocator tests/adapters/test_torch_allocator.py -k "not ($harness)";
     lane harness tests/adapters/test_torch_allocator.py -k "$harness") &
    lane ipc tests/ipc/test_ipc_*.py -k "not ($alone)" &
    lane examples-torch tests/test_examples.py -k "torch and not ($alone)" &
    lane examples-rest tests/test_examples.py -k "not torch and not ($alone)" &
    wait
    lane alone tests/ipc/test_ipc_processes.py tests/core/test_vmm.py tests/core/test_sleep.py \
        tests/test_examples.py tests/adapters/test_torch.py -k "$alone"
    for f in /tmp/gpupool-parts/*.log; do
        cut=""; [ "$(tail -1 "$f")" = "rc=124" ] && cut="cut in $(grep -oE '^tests/[^ ]+' "$f" | tail -1)"
        summary "$(basename "$f" .log): $(grep -E ' in [0-9.]+s' "$f" | tail -1) $(tail -1 "$f") $cut"
    done
    kill $saver 2> /dev/null
    (cd /tmp/gpupool-parts && tar cf "$OUT/parts.tar" *.log) && rm -f "$OUT/parts.tar.part"
    grep -hE "^(FAILED|ERROR)|Fatal Python|Timeout" /tmp/gpupool-parts/*.log | head -40
    grep -h -A25 "native frames" /tmp/gpupool-parts/*.log | head -30
fi
if step memcheck; then
    MEMCHECK_TESTS=${MEMCHECK_TESTS:-"tests/core tests/upstream tests/c_api \
        tests/adapters/test_cupy.py tests/adapters/test_numba.py tests/ipc/test_ipc_errors.py \
        tests/ipc/test_ipc_export.py tests/ipc/test_ipc_handle.py"}
    GPUPOOL_UNDER_SANITIZER=1 GPUPOOL_STRESS_OPS=2000 timeout ${MEMCHECK_TIMEOUT:-400} compute-sanitizer --tool memcheck \
        --report-api-errors no --error-exitcode 99 python3 -m pytest -v -rfE -m gpu \
        -p no:cacheprovider -k "${MEMCHECK_K:-not torch and not jax and not mixed}" \
        $MEMCHECK_TESTS > "$OUT/memcheck.log" 2>&1
    rc=$?; cut=""; [ $rc = 124 ] && cut="cut in $(grep -oE '^tests/[^ ]+' "$OUT/memcheck.log" | tail -1)"
    summary "GPU tests under memcheck (rc=$rc): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(grep -E ' in [0-9.]+s' "$OUT/memcheck.log" | tail -1) $(grep -cE ' PASSED' "$OUT/memcheck.log") PASSED so far $cut"
fi
if step traces; then
    timeout 300 python3 bench/record_trace.py --out "$OUT" > "$OUT/traces.log" 2>&1
    summary "record_trace rc=$?: $(ls "$OUT"/*.npz 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
    mkdir -p bench/data/traces && cp "$OUT"/*.npz bench/data/traces/ 2>/dev/null   # for trace_replay
    RECORD_MODELS=${RECORD_MODELS-gpt2-ckpt,llama-ckpt,gpt2-generate}
    if [ -n "$RECORD_MODELS" ]; then
        rm -rf /tmp/gpupool-traces-real
        timeout ${RECORD_TIMEOUT:-240} python3 bench/record_trace.py --out /tmp/gpupool-traces-real \
            --models "$RECORD_MODELS" --steps ${RECORD_STEPS:-12} >> "$OUT/traces.log" 2>&1
        summary "record_trace $RECORD_MODELS rc=$?: $(grep -E '^  [a-z0-9-]+: .* events' "$OUT/traces.log" | tail -3 | tr '\n' ' ')"
        (cd /tmp/gpupool-traces-real && tar cf "$OUT/traces-real.tar" *.npz)
        cp /tmp/gpupool-traces-real/*.npz bench/data/traces-real/ 2>/dev/null   # for fragmentation
    fi
fi
if step headers; then
    python3 - "$OUT" <<'PY' 2>&1 | tail -2
import os, sys, tarfile, torch
root = os.path.join(os.path.dirname(torch.__file__), "include")
with tarfile.open(os.path.join(sys.argv[1], "torch-headers.tar.gz"), "w:gz") as tar:
    for sub in ("c10", "torch/csrc/cuda", "ATen/cuda", "torch/headeronly",
                "torch/csrc/api/include/torch/version.h"):
        if os.path.exists(os.path.join(root, sub)):
            tar.add(os.path.join(root, sub), arcname=sub)
print("headers of torch", torch.__version__, "ABI", torch._C._GLIBCXX_USE_CXX11_ABI)
PY
    summary "headers: $(python3 -c 'import torch; print(torch.__version__, torch.__config__.show().splitlines()[1:3])')"
fi
if step torchalloc; then
    SKIP_BUILD=1 OUT="$OUT/torchalloc" STEPS=${TORCHALLOC_STEPS:-table,tests,models} \
        bash tools/gpu/torch-alloc-check.sh > "$OUT/torchalloc.log" 2>&1
    summary "torchalloc rc=$?: $(grep -E '^== (tests|feature)' "$OUT/torchalloc/summary.log" | tr '\n' ' ')"
fi
if step profile; then
    # The C API loop of bench/threads.py on 1 and 8 threads, created streams and
    # per-thread default streams, under perf where the machine has it (perf.txt: by shared
    # object and symbol).
    for args in "--threads 1 --runs 2" "--threads 1 --per-thread --runs 2" \
                "--threads 8 --runs 6 --seconds 1" \
                "--threads 8 --per-thread --runs 6 --seconds 1" \
                "--threads 8 --per-thread --idle 7 --runs 6 --seconds 1"; do
        timeout 60 python3 tools/profile/profile_threads.py $args >> "$OUT/profile.log" 2>&1
    done
    if command -v perf > /dev/null; then
        timeout 90 perf record -q -g -o /tmp/perf.data python3 tools/profile/profile_threads.py \
            ${PERF_ARGS:---threads 8 --per-thread --idle 7} >> "$OUT/profile.log" 2>&1
        timeout 90 perf report -i /tmp/perf.data --stdio --no-children --sort dso,symbol \
            2> /dev/null | grep -v "^$" | head -150 > "$OUT/perf.txt"
    else
        echo "no perf on this machine" >> "$OUT/profile.log"
    fi
    summary "profile: $(grep -h 'M pairs' "$OUT/profile.log" | tr '\n' ' ')"
fi
if step threads; then
    timeout ${THREADS_TIMEOUT:-120} python3 bench/threads.py ${THREADS_ARGS:-} > "$OUT/threads.log" 2>&1
    summary "threads.py rc=$?"
fi
if step numba; then
    rm -rf /tmp/gpupool-numba-suite
    timeout ${NUMBA_TIMEOUT:-450} python3 tools/gpu/numba_suite.py --json "$OUT/numba.json" \
        --log-dir /tmp/gpupool-numba-suite ${NUMBA_SUITE_ARGS:---parallel --timeout 400} \
        > "$OUT/numba.log" 2>&1
    summary "numba-cuda tests, default vs gpupool.numba (rc=$?): $(grep -E '^fail only under gpupool' "$OUT/numba.log" | paste -sd ';')"
    (cd /tmp/gpupool-numba-suite && tar cf "$OUT/numba-runs.tar" *.log *.jsonl 2>/dev/null)
fi
if step models; then
    timeout ${MODELS_TIMEOUT:-480} python3 bench/real_models.py --json "$OUT/real_models.json" \
        --plot "$OUT/real_models.png" ${MODELS_TRACES:+--trace-dir /tmp/gpupool-traces} \
        ${MODELS_ARGS:-} > "$OUT/models.log" 2>&1
    summary "real_models rc=$? ($(python3 -c 'import rmm; print("rmm", rmm.__version__)' 2>&1 | tail -1))"
    [ -n "${MODELS_TRACES:-}" ] && (cd /tmp/gpupool-traces && tar cf "$OUT/traces.tar" *.npz)
fi
if step ab; then
    if [ ! -f .ab-base/setup.py ]; then
        summary "ab: no .ab-base here (tools/gpu/ab-base.sh REV makes it; carry it)"
    elif ! (cd .ab-base && timeout 240 python3 setup.py -q build_ext --inplace -j 16 \
            > /tmp/gpupool-ab-build.log 2>&1); then
        cp /tmp/gpupool-ab-build.log "$OUT/ab-build.log"; summary "ab: the base's build FAILED"
    else
        rm -rf /tmp/gpupool-ab && mkdir -p /tmp/gpupool-ab
        args=${AB_ARGS:-"--models llama-ckpt --steps 40 --sampler native"}
        run_new() { timeout ${AB_TIMEOUT:-200} python3 bench/real_models.py $args --repeat 1 \
            --columns ${AB_COLUMNS:-torch.exp,gp.vmm.region,gp.vmm.plan} \
            --json /tmp/gpupool-ab/new-$1.json > /tmp/gpupool-ab/new-$1.log 2>&1; }
        run_base() { PYTHONPATH="$PWD/.ab-base${PYTHONPATH:+:$PYTHONPATH}" timeout \
            ${AB_TIMEOUT:-200} python3 bench/real_models.py $args --repeat 1 \
            --columns ${AB_BASE_COLUMNS:-gp.vmm.plan} \
            --json /tmp/gpupool-ab/base-$1.json > /tmp/gpupool-ab/base-$1.log 2>&1; }
        for r in $(seq 1 ${AB_ROUNDS:-3}); do
            if [ $((r % 2)) = 1 ]; then run_new $r; run_base $r; else run_base $r; run_new $r; fi
            (cd /tmp/gpupool-ab && tar cf "$OUT/ab.tar" *.json *.log 2> /dev/null)
        done
        grep -h "ms/step" /tmp/gpupool-ab/*.log | cut -c1-200 > "$OUT/ab.log"
        python3 -c "import json, glob; [print(f, json.load(open(f))['env'].get('gpupool_from')) \
            for f in sorted(glob.glob('/tmp/gpupool-ab/*.json'))]" >> "$OUT/ab.log" 2>&1
        summary "ab: $(ls /tmp/gpupool-ab/*.json 2> /dev/null | wc -l) runs' records in ab.tar"
    fi
fi
if step example; then
    timeout 300 python3 examples/train_digits.py --device gpu --quiet \
        --plot "$OUT/train_digits.png" > "$OUT/example.log" 2>&1
    summary "examples/train_digits.py rc=$?"
fi
if step sleep; then
    timeout ${SLEEP_TIMEOUT:-300} python3 bench/sleep_cycle.py ${SLEEP_ARGS:-} > "$OUT/sleep.log" 2>&1
    summary "bench/sleep_cycle.py rc=$?"
fi
if step pair; then
    cols=${PAIR_COLUMNS:-gp,gp.region,gp.plan}
    rev=$(echo "$cols" | tr ',' '\n' | tac | paste -sd, -)
    for round in $(seq 1 ${PAIR_ROUNDS:-3}); do
        order=$cols; [ $((round % 2)) = 0 ] && order=$rev
        echo "== round $round: --columns $order" >> "$OUT/pair.log"
        timeout 60 python3 bench/alloc_latency.py --columns "$order" >> "$OUT/pair.log" 2>&1
    done
    summary "pair: $(grep -c '^== round' "$OUT/pair.log") rounds; $(grep -A8 'ns per allocate' "$OUT/pair.log" | grep -E '^1 MiB' | tr -s ' ' | paste -sd';' -)"
fi
if step bench; then
    # real_models.py has a step of its own (models): about 8 minutes.
    BENCH=${BENCH:-alloc_latency,cross_stream,capi_latency,threads,trace_replay,fragmentation,region_memory,ipc}
    timeout ${BENCH_TIMEOUT:-480} python3 bench/run_all.py --out /tmp/gpupool-bench --only "$BENCH" \
        ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    summary "bench rc=$?"
    cat /tmp/gpupool-bench/*.txt > "$OUT/bench-tables.txt" 2>/dev/null
    (cd /tmp/gpupool-bench && tar cf "$OUT/plots.tar" *.png 2>/dev/null)    # one file back
fi

grep -hE "^(FAILED|ERROR)" "$OUT"/tests.log "$OUT"/memcheck.log 2>/dev/null | head -30
[ -f "$OUT/example.log" ] && tail -12 "$OUT/example.log"
[ -f "$OUT/models.log" ] && tail -80 "$OUT/models.log"
[ -f "$OUT/bench-tables.txt" ] && grep -E "target|MISS|met" "$OUT/bench-tables.txt" | head -20
[ -f "$OUT/sleep.log" ] && tail -20 "$OUT/sleep.log"
[ -f "$OUT/numba.log" ] && tail -40 "$OUT/numba.log"
[ -f "$OUT/threads.log" ] && sed -n "/^scaling/,/^columns:/p" "$OUT/threads.log"
cat "$OUT/summary.log"
