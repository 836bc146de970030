"""fork(): in a child of a process that used gpupool, every call raises GpupoolError naming
fork and the 'spawn' / 'forkserver' start methods, and nothing inherited touches the driver or
the upstream, up to the child's normal exit (CPU, simulated device). On a GPU (marked gpu): a
child of a process that used the device refuses every gpupool call with the fork error, before
any driver call, and exits cleanly; fork-pool workers get the error, spawn workers use the
device."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, fresh_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

# The child's checks: `refused(call)` is True when call raises gpupool's fork error (and not,
# say, NoDeviceError from a cuInit that should not have been called).
REFUSED = """
import gc, multiprocessing, os, sys
import gpupool
from gpupool.testing import SimulatedDevice


def waited(pid):
    # Print the child's exit code once it exits, or "child hangs" (killed) after 10 s.
    import time
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child", os.waitstatus_to_exitcode(status), flush=True)
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    print("child hangs", flush=True)


def refused(call):
    try:
        call()
    except gpupool.NoDeviceError:
        return False
    except gpupool.GpupoolError as exc:
        message = str(exc)
        return all(part in message for part in ("fork()", "'spawn'", "'forkserver'"))
    return False
"""


def run(code):
    """Run REFUSED + code in a fresh interpreter; its stdout, once it exited 0 silently."""
    result = fresh_python(REFUSED + code, "-W", "ignore::DeprecationWarning")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    return result.stdout


def test_a_child_refuses_every_call_and_leaves_what_it_inherited_alone():
    out = run("""
sim = SimulatedDevice()
pool = gpupool.Pool(upstream=sim)
gpupool.set_pool(pool)
buf = pool.allocate(100)
region = gpupool.Region(pool=pool, on_exit="invalidate", debug=True)
region.__enter__()
inside = pool.allocate(5000)          # invalidating it at exit would poison it on the device
calls_out, calls_in = os.pipe()
pid = os.fork()
if pid == 0:
    before = len(sim.calls)


    class Reported(list):
        # The child's upstream calls, each also written to the parent as it happens: the
        # calls of its exit (finalizers, atexit, the interpreter's teardown) are seen too.
        def append(self, call):
            os.write(calls_in, call[0].encode() + b"\\n")
            list.append(self, call)

    sim.calls = Reported(sim.calls)
    region.__exit__(None, None, None)  # the child leaves the block without touching its blocks
    checks = {
        "inherited pool": refused(lambda: pool.allocate(100)),
        "trim": refused(pool.trim),
        "new pool": refused(lambda: gpupool.Pool(upstream=SimulatedDevice())),
        "driver upstream, before cuInit": refused(lambda: gpupool.DriverUpstream(0)),
        "default pool": refused(gpupool.get_pool),
        "allocate": refused(lambda: gpupool.allocate(100)),
        "region": refused(lambda: gpupool.Region(pool=pool).__enter__()),
        "inherited buffer's pointer": refused(lambda: buf.ptr),
        "inherited buffer's size": refused(lambda: buf.nbytes),
        "inherited buffer's bytes": refused(buf.copy_to_host),
        "inherited buffer's export": refused(buf.__dlpack__),
        "inherited buffer's interface": refused(lambda: buf.__cuda_array_interface__),
        "pickling an inherited buffer": refused(lambda: __import__("pickle").dumps(buf)),
        "memory snapshot": refused(lambda: gpupool.memory_snapshot(pool)),
        "memory snapshot of every pool": refused(gpupool.memory_snapshot),
    }
    del buf, inside, region, pool
    gc.collect()
    checks["no upstream call"] = sim.calls[before:] == []
    print(checks)
    sys.exit(0 if all(checks.values()) else 1)   # a normal exit: finalizers and atexit run
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
os.close(calls_in)
with os.fdopen(calls_out, "rb") as reported:
    assert reported.read() == b"", "the child's exit called the upstream"
region.__exit__(None, None, None)
assert inside.closed and pool.allocate(100).nbytes == 100     # the parent goes on
print("parent ok")
""")
    assert "False" not in out and out.endswith("parent ok\n"), out


@pytest.mark.parametrize("plan", [False, True])
def test_a_child_drops_its_regions_while_a_thread_not_forked_holds_the_pool_s_lock(plan):
    # A thread of the parent is inside the pool's upstream call (the pool's lock held: a
    # planned region's lane's too) when the main thread forks. The lock stays held in the
    # child, whose regions die without waiting for it.
    out = run(f"""
from conftest import hold_lock

device = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
pool = gpupool.Pool(upstream=device)
region = gpupool.Region(pool=pool, collect=None, plan={plan})
for _ in range(4):
    with region:
        pool.allocate(1 << 20).close()
go, thread = hold_lock(pool, device, 256 << 20)
pid = os.fork()
if pid == 0:
    del region
    gc.collect()
    os._exit(0)
go.set()
thread.join()
waited(pid)
""")
    assert out == "child 0\n"


def test_a_child_s_calls_that_take_the_pool_s_lock_refuse_while_a_thread_not_forked_holds_it():
    # As above, the lock held at the fork by a thread the child does not have: every call
    # that would wait for it refuses with the fork error (they used to hang), and a block
    # entered with enter_in_thread() before the fork (in the region entered) is left without
    # it. The child exits normally (finalizers run).
    out = run("""
from conftest import hold_lock

device = SimulatedDevice(capacity=1 << 32, virtual_memory=True)
pool = gpupool.Pool(upstream=device)
region = gpupool.Region(pool=pool, collect=None, plan=True)
for _ in range(4):
    with region:
        pool.allocate(1 << 20).close()
buf = pool.allocate(1 << 20)
region.__enter__()
inside = region.enter_in_thread()
inside.__enter__()
go, thread = hold_lock(pool, device, 256 << 20)
pid = os.fork()
if pid == 0:
    calls = {
        "stats": pool.stats, "memory_stats": pool.memory_stats, "_verify": pool._verify,
        "cached_blocks": pool.cached_blocks, "reset_peak_stats": pool.reset_peak_stats,
        "release_pinned": pool.release_pinned,
        "pool_status": lambda: gpupool.pool_status(pool=pool),
        "memory_snapshot": lambda: gpupool.memory_snapshot(pool=pool),
        "Region()": lambda: gpupool.Region(pool=pool), "region.stats": region.stats,
        "region.release": region.release, "region.reset_peak_stats": region.reset_peak_stats,
        "region.keep": lambda: region.keep(buf),
        "enter_in_thread": lambda: region.enter_in_thread().__enter__(),
    }
    failed = [name for name, call in calls.items() if not refused(call)]
    inside.__exit__(None, None, None)
    print("not refused:", failed, flush=True)
    sys.exit(0)
go.set()
thread.join()
waited(pid)
inside.__exit__(None, None, None)
region.__exit__(None, None, None)
""")
    assert out == "not refused: []\nchild 0\n"


def test_fork_pool_workers_get_the_error_in_the_parent():
    out = run("""
def work(nbytes):
    return gpupool.allocate(nbytes).nbytes


gpupool.set_pool(gpupool.Pool(upstream=SimulatedDevice()))
assert work(10) == 10
with multiprocessing.get_context("fork").Pool(1) as workers:
    print("refused:", refused(lambda: workers.apply(work, (100,))))
""")
    assert out == "refused: True\n"


def test_a_child_of_a_process_that_only_imported_gpupool_uses_it():
    out = run("""
pid = os.fork()
if pid == 0:
    pool = gpupool.Pool(upstream=SimulatedDevice())
    buf = pool.allocate(100)
    buf.memset(7)
    ok = bool((buf.copy_to_host() == 7).all())
    del buf
    os._exit(0 if ok and pool.stats().in_use_bytes == 0 else 1)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
""")
    assert out == "child exit 0\n"


# On a GPU (marked gpu): the same checks after the parent used the device.

GPU_SCRIPT = REFUSED + """

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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_a_child_of_a_gpu_process_is_refused_and_exits_cleanly(tmp_path):
    script = tmp_path / "fork_after_gpu_use.py"      # a file: spawn workers import it
    script.write_text(GPU_SCRIPT)
    # CUDA's threads make fork() warn (Python 3.12+) that the child may deadlock: it does not
    # here, the child calls nothing of CUDA's.
    result = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "False" not in result.stdout and "parent 0 True True True" in result.stdout, out
    assert result.stderr == "", out


def test_readme_says_a_child_refuses_the_calls_that_only_read_too():
    # README said counters (stats()) "read what was inherited" in a child (trial 29); the
    # child refuses them as every other call (the tests above).
    readme = (REPO / "README.md").read_text()
    paragraph = " ".join(next(part for part in readme.split("\n\n")
                              if part.startswith("CUDA state does not cross `fork()`")).split())
    assert "read what was inherited" not in paragraph
    assert "those that only read: `stats()`, `buf.ptr`, `region.stats()`" in paragraph
    assert "raise `GpupoolError` saying so" in paragraph
