#!/usr/bin/env bash
# Does the torch.gp column (PyTorch on gpupool, in a spawned child process) vary between runs
# because of where the processes run? Three runs as run_all makes them, then three with the
# parent and its child pinned to one core (taskset; the child inherits the affinity).
cd "$(dirname "$0")/.."
cols=gp,torch,torch.gp
for pin in "" "taskset -c 3"; do
    for i in 1 2 3; do
        echo "== ${pin:-unpinned} run $i"
        $pin python3 bench/alloc_latency.py --columns $cols | sed -n 1,9p
    done
done
