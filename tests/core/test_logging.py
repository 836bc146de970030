"""The "gpupool" logger: the out-of-memory ladder's steps, trims and soft-limit trims at DEBUG,
written with the GIL outside the pool's lock (a pending call, or the Python-level call that
reports), on the simulated device."""

import logging
import threading

import pytest

import gpupool
from gpupool.adapters import torch_entry
from gpupool.testing import SimulatedDevice

MIB = 1 << 20

pytestmark = pytest.mark.usefixtures("default_pools")


@pytest.fixture
def debug(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="gpupool")
    # The ladder's messages count on_oom callbacks: only this test's (gpupool.ipc registers
    # one for the process at its first export).
    monkeypatch.setattr(gpupool.core.oom, "_oom_callbacks", [])
    return caplog


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "gpupool"]


def limited(limit, **kwargs):
    return gpupool.Pool(upstream=SimulatedDevice(capacity=64 * MIB), hard_limit=limit, **kwargs)


def idle():
    """Some Python bytecode: the interpreter runs pending calls at such points."""
    for _ in range(3):
        pass



def test_ladder_step_1_gives_the_pool_s_cache_back(debug):
    pool = limited(8 * MIB)
    a, b = pool.allocate(4 * MIB), pool.allocate(4 * MIB)
    del a, b                                    # two 4 MiB segments cached, the peak in use
    big = pool.allocate(7 * MIB)                # (16 MiB not past twice the peak: no shed)
    idle()                                      # no call to flush: the pending call writes
    assert messages(debug) == [
        f"gpupool: out of memory growing the pool of device 0 for {7 * MIB} B: step 1, gave "
        f"the pool's cache back ({8 * MIB} B released); the retry succeeded"]
    assert all(r.levelno == logging.DEBUG for r in debug.records)
    del big


def test_ladder_step_2_gives_every_region_s_cache_back(debug):
    pool = limited(8 * MIB)
    region = gpupool.Region(pool=pool)
    with region:
        a, b = pool.allocate(3 * MIB), pool.allocate(3 * MIB)
        del a, b                                # cached by the region
    big = pool.allocate(7 * MIB)
    idle()
    assert messages(debug) == [
        f"gpupool: out of memory growing the pool of device 0 for {7 * MIB} B: step 1, gave "
        f"the pool's cache back (0 B released); the retry failed",
        f"gpupool: out of memory growing the pool of device 0 for {7 * MIB} B: step 2, gave "
        f"every region's cache back ({8 * MIB} B released); the retry succeeded"]
    assert region.stats().cached_bytes == 0
    del big


def test_ladder_step_3_runs_the_callbacks_and_the_error_is_logged(debug, oom_callback):
    pool = limited(4 * MIB)
    keep = pool.allocate(3 * MIB)
    ran = []
    oom_callback(ran.append)
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(2 * MIB)
    step = f"gpupool: out of memory growing the pool of device 0 for {2 * MIB} B: step"
    assert messages(debug) == [
        f"{step} 1, gave the pool's cache back (0 B released); the retry failed",
        f"{step} 2, gave every region's cache back (0 B released); the retry failed",
        f"gpupool: out of memory on device 0 for {2 * MIB} B: step 3, running 1 on_oom "
        f"callbacks, then retrying",
        f"{step} 1, gave the pool's cache back (0 B released); the retry failed",
        f"{step} 2, gave every region's cache back (0 B released); the retry failed",
        f"gpupool: out of memory on device 0 for {2 * MIB} B: the retry after the on_oom "
        f"callbacks failed",
        f"gpupool: out of memory on device 0 for {2 * MIB} B after the ladder: raising "
        f"OutOfMemoryError"]
    assert ran == [2 * MIB]
    del keep


def test_a_callback_that_frees_makes_the_retry_succeed(debug, oom_callback):
    pool = limited(4 * MIB)
    held = [pool.allocate(3 * MIB)]
    oom_callback(lambda nbytes: held.clear())
    buf = pool.allocate(2 * MIB)
    idle()
    assert messages(debug)[-1] == (
        f"gpupool: out of memory on device 0 for {2 * MIB} B: the retry after the on_oom "
        f"callbacks succeeded")
    assert not any("raising" in m for m in messages(debug))
    del buf


def test_nothing_cached_is_said(debug):
    pool = limited(2 * MIB)
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(3 * MIB)
    assert messages(debug) == [
        f"gpupool: out of memory growing the pool of device 0 for {3 * MIB} B with nothing "
        f"cached to give back: the ladder goes on to the on_oom callbacks",
        f"gpupool: out of memory on device 0 for {3 * MIB} B after the ladder: raising "
        f"OutOfMemoryError"]


def test_trims_say_what_they_released(debug):
    pool = gpupool.Pool(upstream=SimulatedDevice(device=1))
    keep, gone = pool.allocate(1000), pool.allocate(12 * MIB)
    del gone
    assert pool.trim() == 12 * MIB
    assert messages(debug) == [
        f"gpupool: trim released {12 * MIB} B on device 1 ({2 * MIB} B reserved now)"]
    del keep


def test_soft_limit_trims_say_what_they_released(debug):
    pool = gpupool.Pool(upstream=SimulatedDevice(), soft_limit=4 * MIB)
    a = pool.allocate(3 * MIB)
    del a                                       # a 4 MiB segment cached
    b = pool.allocate(5 * MIB)                  # grows 6 MiB: 10 MiB reserved
    idle()
    assert messages(debug) == [
        f"gpupool: the pool of device 0 went above its soft limit of {4 * MIB} B: trim "
        f"released {4 * MIB} B"]
    assert pool.stats().reserved_bytes == 6 * MIB
    del b


def test_c_api_calls_without_the_gil_are_logged_later(debug):
    pool = limited(4 * MIB, device=0)
    gpupool.set_pool(pool)
    keep = torch_entry._torch_malloc(3 * MIB)
    found = []
    worker = threading.Thread(target=lambda: found.append(torch_entry._torch_malloc(2 * MIB,
                                                                              gil=False)))
    worker.start()
    worker.join()
    idle()
    assert found == [0]
    assert messages(debug)[-1] == (
        f"gpupool: out of memory on device 0 for {2 * MIB} B after the ladder: the C API "
        f"returns GPUPOOL_ERROR_OUT_OF_MEMORY")
    assert len(messages(debug)) == 3             # steps 1 and 2, then the failure
    torch_entry._torch_free(keep)


def test_nothing_is_written_above_debug(caplog):
    caplog.set_level(logging.INFO, logger="gpupool")
    pool = limited(8 * MIB)
    a, b = pool.allocate(3 * MIB), pool.allocate(3 * MIB)
    del a, b
    big = pool.allocate(7 * MIB)
    pool.trim()
    idle()
    assert messages(caplog) == []
    caplog.set_level(logging.DEBUG, logger="gpupool")
    gpupool.memory_snapshot(pool)               # writes what is queued: nothing was left
    assert messages(caplog) == []
    del big
