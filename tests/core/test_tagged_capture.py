"""A tagged block freed after ``record_stream`` is ordered by a device synchronize (tagged
blocks keep no events, core/tagged.pxd). While its stream or a stream it was recorded on is
being captured into a CUDA graph, that synchronize would invalidate the capture: the block
waits, taken by no request, until the tag's next request outside a capture synchronizes; then
it is free for any stream again. On the simulated device, whose ``capturing`` streams count a
synchronize as a misuse (the ``vsim`` fixture fails the test on one)."""

import pytest
from conftest import check_invariants
from vmm_sim import MIB, gpu_pool, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import Failures


def freed_in_capture(pool, sim, captured):
    """A tagged block used on stream a and recorded on b, freed while ``captured`` ("a" or
    "b") is being captured; returns (its address, a, b)."""
    a, b = sim.create_stream(), sim.create_stream()
    with gpupool.tag("weights"):
        buf = pool.allocate(MIB, a)
    buf.record_stream(b)
    ptr = buf.ptr
    sim.capturing.add(a if captured == "a" else b)
    start = len(sim.calls)
    buf.close()
    assert "synchronize" not in [name for name, _ in sim.calls[start:]]
    return ptr, a, b


@pytest.mark.parametrize("captured", ["a", "b"])
def test_a_tagged_free_under_capture_does_not_synchronize(vpool, vsim, captured):
    ptr, a, b = freed_in_capture(vpool, vsim, captured)
    # Inside the capture the block is not reused: its other stream's work is not ordered.
    with gpupool.tag("weights"):
        inside = vpool.allocate(MIB, a)
    assert inside.ptr != ptr
    check_invariants(vpool)
    vsim.capturing.clear()
    inside.close()
    # Outside it, the tag's next request synchronizes once, and the block serves again.
    start = len(vsim.calls)
    with gpupool.tag("weights"):
        again = vpool.allocate(MIB, a)
    assert [name for name, _ in vsim.calls[start:]].count("synchronize") == 1
    assert again.ptr == ptr
    check_invariants(vpool)
    again.close()
    start = len(vsim.calls)
    with gpupool.tag("weights"):
        vpool.allocate(MIB, b).close()
    assert "synchronize" not in [name for name, _ in vsim.calls[start:]]


def test_a_request_under_capture_leaves_the_wait_to_a_later_one(vpool, vsim):
    ptr, a, b = freed_in_capture(vpool, vsim, "a")
    # A tagged request on the captured stream makes no synchronize either.
    start = len(vsim.calls)
    with gpupool.tag("weights"):
        inside = vpool.allocate(MIB, a)
    assert "synchronize" not in [name for name, _ in vsim.calls[start:]]
    vsim.capturing.clear()
    with gpupool.tag("weights"):
        assert vpool.allocate(MIB, b).ptr == ptr    # free for any stream after the wait
    inside.close()
    check_invariants(vpool)


def test_a_failed_synchronize_leaves_the_block_waiting(vpool, vsim):
    ptr, a, b = freed_in_capture(vpool, vsim, "a")
    vsim.capturing.clear()
    failed = vsim.inject(Failures("synchronize", nth=1))
    with gpupool.tag("weights"):
        first = vpool.allocate(MIB, a)
    assert first.ptr != ptr and len(failed.injected) == 1
    vsim.inject(None)
    with gpupool.tag("weights"):
        assert vpool.allocate(MIB, a).ptr == ptr
    first.close()
    check_invariants(vpool)


def test_after_the_wait_the_joined_blocks_serve_any_stream(vpool, vsim):
    # x freed on a (free on a alone), then y, its right neighbour, freed under a's capture after
    # record_stream(b): [x: a][y: unordered]. After the wait's synchronize both are free for
    # any stream, joined: two requests on a and on b take them (found in review: the join
    # gave the block the unordered neighbour's stream, and the bytes stayed waiting).
    a, b = vsim.create_stream(), vsim.create_stream()
    with gpupool.tag("weights"):
        x = vpool.allocate(MIB, a)
        y = vpool.allocate(MIB, a)
        z = vpool.allocate(MIB, a)          # keeps y off the segment's unused end
    xp = x.ptr
    y.record_stream(b)
    x.close()
    vsim.capturing.add(a)
    y.close()
    vsim.capturing.clear()
    with gpupool.tag("weights"):
        first = vpool.allocate(MIB, a)      # the wait's synchronize is made here
        second = vpool.allocate(MIB, b)
    assert sorted([first.ptr, second.ptr]) == [xp, xp + MIB]
    check_invariants(vpool)
    for buf in (first, second, z):
        buf.close()


@pytest.mark.gpu
def test_on_a_gpu_a_tagged_free_in_a_global_capture_keeps_it_valid(gpu_pool):
    from cuda.bindings import driver

    def ok(result):
        assert result[0] == driver.CUresult.CUDA_SUCCESS, result[0]
        return result[1] if len(result) == 2 else result[1:]

    ok(driver.cuInit(0))
    ok(driver.cuCtxSetCurrent(ok(driver.cuDevicePrimaryCtxRetain(ok(driver.cuDeviceGet(0))))))
    a, b = (ok(driver.cuStreamCreate(0)) for _ in range(2))
    with gpupool.tag("gpu-capture"):
        buf = gpu_pool.allocate(MIB, int(a))
    ptr = buf.ptr
    buf.record_stream(int(b))
    ok(driver.cuStreamBeginCapture(a, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(driver.cuMemsetD8Async(driver.CUdeviceptr(ptr), 1, MIB, a))
    buf.close()
    status = ok(driver.cuStreamIsCapturing(a))
    assert status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    graph = ok(driver.cuStreamEndCapture(a))
    with gpupool.tag("gpu-capture"):
        again = gpu_pool.allocate(MIB, int(a))
    assert again.ptr == ptr
    again.close()
    ok(driver.cuGraphDestroy(graph))
    for s in (a, b):
        ok(driver.cuStreamDestroy(s))
    check_invariants(gpu_pool)
