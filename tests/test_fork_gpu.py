"""fork() on a GPU (marked gpu): a child of a process that used the device refuses every
gpupool call with the fork error, before any driver call, and exits cleanly; fork-pool workers
get the error, spawn workers use the device. tests/test_fork.py checks the same on CPU."""

import subprocess
import sys

import pytest
from conftest import fresh_python
from test_fork import REFUSED

pytestmark = pytest.mark.gpu

SCRIPT = REFUSED + """

def work(nbytes):
    buf = gpupool.allocate(nbytes, device=0)
    buf.memset(7)
    return int(buf.copy_to_host().sum())


if __name__ == "__main__":
    pool = gpupool.get_pool(0)
    buf = pool.allocate(1 << 20)
    buf.memset(1)
    assert work(10) == 70
    pid = os.fork()
    if pid == 0:
        checks = {
            "inherited pool": refused(lambda: pool.allocate(100)),
            "new pool": refused(lambda: gpupool.Pool(device=0)),
            "driver upstream, before cuInit": refused(lambda: gpupool.DriverUpstream(0)),
            "default pool": refused(gpupool.get_pool),
            "allocate": refused(lambda: gpupool.allocate(100)),
            "region": refused(lambda: gpupool.Region(pool=pool).__enter__()),
        }
        del buf, pool
        gc.collect()
        print("child", checks, flush=True)
        sys.exit(0 if all(checks.values()) else 3)   # a normal exit: finalizers and atexit
    _, status = os.waitpid(pid, 0)
    child = os.waitstatus_to_exitcode(status)
    with multiprocessing.get_context("fork").Pool(1) as workers:
        fork_worker = refused(lambda: workers.apply(work, (100,)))
    with multiprocessing.get_context("spawn").Pool(1) as workers:
        spawn_worker = workers.apply(work, (100,)) == 700
    parent = bool((buf.copy_to_host() == 1).all()) and work(10) == 70
    print("parent", child, fork_worker, spawn_worker, parent)
"""


def test_a_child_of_a_process_that_used_cuda_but_not_gpupool_gets_the_fork_error():
    # The parent initialized CUDA through cuda.bindings alone: gpupool in the child sees cuInit
    # fail (CUDA_ERROR_NOT_INITIALIZED) and says why.
    result = fresh_python(REFUSED + """
from cuda.bindings import driver
assert driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS
pid = os.fork()
if pid == 0:
    os._exit(0 if refused(lambda: gpupool.Pool(device=0)) else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
""", "-W", "ignore::DeprecationWarning")
    assert result.stdout == "child 0\n", result.stdout + result.stderr


def test_a_child_of_a_gpu_process_is_refused_and_exits_cleanly(tmp_path):
    script = tmp_path / "fork_after_gpu_use.py"      # a file: spawn workers import it
    script.write_text(SCRIPT)
    # CUDA's threads make fork() warn (Python 3.12+) that the child may deadlock: it does not
    # here, the child calls nothing of CUDA's.
    result = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "False" not in result.stdout and "parent 0 True True True" in result.stdout, out
    assert result.stderr == "", out
