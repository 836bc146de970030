"""Tags, sleep and wake (Note [Sleep and wake] in docs/design.md) on the simulated device with
virtual memory: a tag's blocks live in pages of their own, which Pool.sleep unmaps (after a
synchronize, offloading their bytes on request) and Pool.wake maps again at the same
addresses; and on a real device (marked gpu): the device's free memory, a CUDA graph captured
before sleep replayed after wake, the plain driver upstream refused."""

import gc
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from capi_table import ASLEEP, allocate, call
from conftest import check_invariants
from vmm_sim import MIB, PAGE, names
from vmm_sim import gpu_pool, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import Failures, SimulatedDevice


def pattern(n, seed=0):
    return (np.arange(n, dtype=np.uint32) * 2654435761 + seed).astype(np.uint8)


def test_tagged_blocks_get_pages_of_their_own(vpool):
    plain = vpool.allocate(PAGE // 2)
    with gpupool.tag("weights"):
        w = vpool.allocate(PAGE // 2)
        w2 = vpool.allocate(3 * PAGE)
    other = vpool.allocate(PAGE // 2)
    # Not in the untagged segment's pages: another range.
    assert abs(w.ptr - plain.ptr) >= 64 * MIB
    assert w2.ptr == w.ptr + PAGE // 2          # the tag's blocks share its segment
    assert abs(other.ptr - plain.ptr) < PAGE         # untagged: the untagged segment's
    check_invariants(vpool)


def test_the_tag_is_per_thread_and_nests(vpool):
    seen = {}

    def other_thread():
        seen["ptr"] = vpool.allocate(512).ptr     # untagged: the other thread's tag is not
    with gpupool.tag("a"):
        a = vpool.allocate(512)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with gpupool.tag("b"):
            b = vpool.allocate(512)
        a2 = vpool.allocate(512)
    assert abs(b.ptr - a.ptr) >= 64 * MIB
    assert a2.ptr == a.ptr + 512
    assert abs(seen["ptr"] - a.ptr) >= 64 * MIB and abs(seen["ptr"] - b.ptr) >= 64 * MIB
    check_invariants(vpool)


def test_sleep_unmaps_the_tags_pages_and_leaves_untagged_blocks(vpool, vsim):
    plain = vpool.allocate(2 * PAGE)
    plain.copy_from_host(pattern(2 * PAGE, 1))
    with gpupool.tag("weights"):
        bufs = [vpool.allocate(n) for n in (PAGE, 5000, 3 * PAGE)]
    freed = None
    with gpupool.tag("weights"):
        freed = vpool.allocate(PAGE)
    freed.close()                                   # cached free space of the tag
    before = check_invariants(vpool)
    used = vsim.device_bytes
    tagged_reserved = before.reserved_bytes - 2 * PAGE
    vpool.sleep("weights")
    after = check_invariants(vpool)
    assert used - vsim.device_bytes >= 0.99 * tagged_reserved
    assert after.reserved_bytes == 2 * PAGE
    assert after.asleep_bytes == PAGE + 5120 + 3 * PAGE       # whole blocks (512 B rounding)
    assert after.in_use_bytes == 2 * PAGE
    assert not any(vsim.mapped(b.ptr) for b in bufs)
    np.testing.assert_array_equal(plain.copy_to_host(), pattern(2 * PAGE, 1))
    assert vsim.errors == []


def test_wake_maps_the_same_addresses_and_offload_keeps_the_bytes(vpool, vsim):
    with gpupool.tag("weights"):
        bufs = [vpool.allocate(n) for n in (PAGE, 5000, 3 * PAGE)]
    ptrs = [b.ptr for b in bufs]
    for i, b in enumerate(bufs):
        b.copy_from_host(pattern(b.nbytes, i))
    vpool.sleep(["weights"], offload=True)
    stats = check_invariants(vpool)
    assert stats.offloaded_bytes >= sum(b.nbytes for b in bufs)
    vpool.wake("weights")
    stats = check_invariants(vpool)
    assert (stats.asleep_bytes, stats.offloaded_bytes) == (0, 0)
    assert [b.ptr for b in bufs] == ptrs
    for i, b in enumerate(bufs):
        np.testing.assert_array_equal(b.copy_to_host(), pattern(b.nbytes, i))
    assert all(vsim.mapped(b.ptr, b.nbytes) for b in bufs)
    assert vsim.errors == []


def test_without_offload_the_bytes_are_discarded(vpool, vsim):
    with gpupool.tag("kv"):
        b = vpool.allocate(2 * PAGE)
    b.copy_from_host(pattern(2 * PAGE, 3))
    vpool.sleep("kv")
    assert vpool.stats().offloaded_bytes == 0
    vpool.wake("kv")
    check_invariants(vpool)
    # New pages: the simulated device's are zeroed, the old bytes are gone.
    assert not (b.copy_to_host() == pattern(2 * PAGE, 3)).all()
    b.memset(5)
    assert (b.copy_to_host() == 5).all()


def test_use_while_asleep_is_refused(vpool, vsim):
    with gpupool.tag("weights"):
        b = vpool.allocate(PAGE)
    ptr = b.ptr
    vpool.sleep("weights")
    for use in (lambda: b.copy_to_host(), lambda: b.copy_from_host(bytes(PAGE)),
                lambda: b.memset(0), lambda: b.__cuda_array_interface__,
                lambda: b.__dlpack__(), lambda: b.copy()):
        with pytest.raises(gpupool.SleepingMemoryError, match="sleeps"):
            use()
    assert b.ptr == ptr                             # the pointer stays readable
    assert vsim.errors == []
    vpool.wake("weights")
    b.memset(1)
    assert (b.copy_to_host() == 1).all()


def test_allocating_with_a_sleeping_tag_is_refused(vpool):
    with gpupool.tag("weights"):
        vpool.allocate(PAGE)
    vpool.sleep("weights")
    with gpupool.tag("weights"):
        with pytest.raises(gpupool.SleepingMemoryError, match="'weights'.*wake"):
            vpool.allocate(512)
    with gpupool.tag("other"):
        vpool.allocate(512)                         # another tag, and no tag, go on
    vpool.allocate(512)
    check_invariants(vpool)


def test_freeing_while_asleep_then_wake(vpool):
    with gpupool.tag("weights"):
        a = vpool.allocate(PAGE)
        b = vpool.allocate(PAGE)
    vpool.sleep("weights", offload=True)
    a.close()
    stats = check_invariants(vpool)
    assert stats.asleep_bytes == PAGE
    vpool.wake("weights")
    stats = check_invariants(vpool)
    assert stats.in_use_bytes == PAGE and stats.asleep_bytes == 0
    with gpupool.tag("weights"):
        c = vpool.allocate(PAGE)                    # the freed block serves again
    assert c.ptr == b.ptr - PAGE
    del b, c
    check_invariants(vpool)


def test_sleep_waits_for_pending_work_on_every_stream(vpool, vsim):
    s1, s2 = vsim.create_stream(), vsim.create_stream()
    with gpupool.tag("weights"):
        a = vpool.allocate(PAGE, stream=s1)
        b = vpool.allocate(PAGE, stream=s2)
    vsim.launch(s1)
    vsim.launch(s2)
    vsim.calls.clear()
    vpool.sleep("weights", offload=True)
    assert names(vsim, "synchronize", "unmap")[0] == "synchronize"
    assert "unmap" in names(vsim, "unmap")
    assert vsim.errors == []
    vpool.wake("weights")
    del a, b
    check_invariants(vpool)


def test_sleep_needs_an_expandable_upstream_and_says_how_on_the_simulated_device():
    """The fix named is the simulated device's own (upstream='vmm' needs a GPU)."""
    pool = gpupool.Pool(upstream=SimulatedDevice())
    with gpupool.tag("weights"):
        b = pool.allocate(512)                      # a plain upstream: untagged
    for call in (pool.sleep, pool.wake):
        with pytest.raises(gpupool.GpupoolError, match=r"SimulatedDevice\(virtual_memory=True\)"
                           ) as info:
            call("weights")
        assert "upstream='vmm'" not in str(info.value)
    del b
    check_invariants(pool)


def test_a_failed_map_at_wake_leaves_the_tag_asleep(vpool, vsim):
    with gpupool.tag("weights"):
        b = vpool.allocate(2 * PAGE)
    b.copy_from_host(pattern(2 * PAGE, 9))
    vpool.sleep("weights", offload=True)
    vsim.inject(Failures("map", nth=1))
    with pytest.raises(gpupool.OutOfMemoryError):
        vpool.wake("weights")
    stats = check_invariants(vpool)
    assert stats.asleep_bytes == 2 * PAGE and stats.offloaded_bytes >= 2 * PAGE
    with pytest.raises(gpupool.SleepingMemoryError):
        b.copy_to_host()
    vsim.inject(None)
    vpool.wake("weights")
    np.testing.assert_array_equal(b.copy_to_host(), pattern(2 * PAGE, 9))
    check_invariants(vpool)


def test_sleep_twice_and_unknown_tags_are_no_ops(vpool, vsim):
    with gpupool.tag("weights"):
        b = vpool.allocate(PAGE)
    vpool.sleep("never-used")
    vpool.sleep("weights")
    vpool.sleep("weights")
    vpool.wake("weights")
    vpool.wake("weights")
    check_invariants(vpool)
    with pytest.raises(TypeError, match="non-empty str"):
        gpupool.tag(3)
    with pytest.raises(TypeError, match="non-empty str"):
        gpupool.tag("")
    with pytest.raises(TypeError, match="iterable of str"):
        vpool.sleep(3)
    with pytest.raises(TypeError, match="non-empty str"):
        vpool.wake(["weights", None])
    del b


def test_a_never_used_tag_sleeps_and_wakes_with_nothing_done(vpool, vsim):
    """No error, no driver call (not even the synchronize), nothing counted; the tag, used
    afterwards, is awake."""
    with gpupool.tag("weights"):
        w = vpool.allocate(PAGE)
    before = vpool.stats()
    vsim.calls.clear()
    vpool.sleep(["never-used", "wieghts"], offload=True)
    vpool.wake("never-used")
    assert vsim.calls == [] and vpool.stats() == before
    with gpupool.tag("never-used"):
        b = vpool.allocate(PAGE)
    b.copy_from_host(pattern(PAGE))
    np.testing.assert_array_equal(b.copy_to_host(), pattern(PAGE))
    assert vpool.stats().asleep_bytes == 0
    check_invariants(vpool)
    del w, b


def test_a_pool_closed_with_a_sleeping_tag_gives_its_ranges_back(vsim):
    pool = gpupool.Pool(upstream=vsim)
    with gpupool.tag("weights"):
        b = pool.allocate(PAGE)
    pool.sleep("weights")
    del b
    check_invariants(pool)
    del pool
    assert vsim.errors == [] and vsim.device_bytes == 0


def test_a_freed_tagged_block_serves_only_its_tag(vpool):
    with gpupool.tag("weights"):
        w = vpool.allocate(512)
    base = w.ptr
    w.close()                                       # no magazine, no free list: the tag's
    plain = vpool.allocate(512)
    assert abs(plain.ptr - base) >= 64 * MIB
    with gpupool.tag("weights"):
        assert vpool.allocate(512).ptr == base
    check_invariants(vpool)


def test_the_c_api_honours_the_tag(vpool, default_pools):
    gpupool.set_pool(vpool)
    plain = vpool.allocate(512)
    with gpupool.tag("capi"):
        p = allocate(4096)
    assert abs(p - plain.ptr) >= 64 * MIB
    vpool.sleep("capi")
    assert vpool.stats().asleep_bytes == 4096
    with gpupool.tag("capi"), pytest.raises(AssertionError, match=f"returned {ASLEEP}"):
        allocate(512)                                   # refused: the tag sleeps
    with gpupool.tag("other"):
        assert call("free_ptr", 0, allocate(512)) == 0  # another tag goes on
    assert call("free_ptr", 0, p) == 0                  # a sleeping block may be freed
    stats = check_invariants(vpool)
    assert stats.asleep_bytes == 0
    vpool.wake("capi")
    check_invariants(vpool)


def test_the_c_api_s_asleep_status_is_the_header_s_and_says_what_to_do():
    header = (Path(gpupool.get_include()) / "gpupool_status.h").read_text()
    assert re.search(rf"GPUPOOL_ERROR_ASLEEP = {ASLEEP}\b", header)
    assert re.search(r"GP_ASLEEP = GPUPOOL_ERROR_ASLEEP\b", header)
    text = call("error_string", ASLEEP).decode()
    assert "tag (gpupool.tag) sleeps" in text and "Pool.wake" in text
    assert call("error_string", ASLEEP) != call("error_string", 100004)


def test_a_snapshot_leaves_sleeping_memory_out(vpool):
    with gpupool.tag("weights"):
        b = vpool.allocate(PAGE)
    vpool.sleep("weights")
    snap = gpupool.memory_snapshot(vpool)
    addresses = [blk["address"] for seg in snap["segments"] for blk in seg["blocks"]]
    assert b.ptr not in addresses
    vpool.wake("weights")
    snap = gpupool.memory_snapshot(vpool)
    addresses = [blk["address"] for seg in snap["segments"] for blk in seg["blocks"]]
    assert b.ptr in addresses
    gc.collect()


@pytest.mark.parametrize("seed", range(4))
def test_random_sleeps_and_wakes_with_failures_stay_consistent(seed):
    """Seeded random allocations (tagged and not), frees, sleeps and wakes with maps, unmaps,
    synchronizes and copies failing at 15%: after every step the pool's bookkeeping holds,
    the device saw no misuse, and what raised is the injected failure (or out of memory)."""
    rng = np.random.default_rng(seed)
    sim = SimulatedDevice(capacity=4 * MIB, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    failures = sim.inject(Failures(("map", "unmap", "synchronize", "copy", "host_alloc",
                                    "host_free"), rate=0.15, seed=seed))
    live, tags = [], ("a", "b", None)
    for _ in range(300):
        op = rng.integers(5)
        name = tags[rng.integers(3)]
        try:
            if op <= 1:
                nbytes = int(rng.integers(1, 3 * PAGE))
                if name is None:
                    live.append(pool.allocate(nbytes))
                else:
                    with gpupool.tag(name):
                        live.append(pool.allocate(nbytes))
            elif op == 2 and live:
                live.pop(int(rng.integers(len(live)))).close()
            elif op == 3 and name is not None:
                pool.sleep(name, offload=bool(rng.integers(2)))
            elif op == 4 and name is not None:
                pool.wake(name)
        except (gpupool.CudaError, gpupool.OutOfMemoryError, gpupool.SleepingMemoryError):
            pass
        stats = check_invariants(pool)
        assert stats.reserved_bytes == sim.device_bytes
        assert sim.errors == []
        # Page-locked memory is what the pool counts (a failed host_free leaves its chunk
        # with the upstream).
        kept = any(call == "host_free" for call, _, _ in failures.injected)
        assert kept or sim.pinned_bytes == stats.pinned_bytes
    sim.inject(None)
    pool.wake(["a", "b"])
    for buf in live:
        buf.memset(1)
    del live
    check_invariants(pool)


def test_offload_copies_runs_into_one_page_locked_chunk_kept_at_wake(vpool, vsim):
    with gpupool.tag("weights"):
        bufs = [vpool.allocate(n) for n in (PAGE, 5000, 3 * PAGE, PAGE)]
    bufs.pop(2).close()                 # two runs of adjacent live blocks
    for i, b in enumerate(bufs):
        b.copy_from_host(pattern(b.nbytes, i))
    vsim.calls.clear()
    vpool.sleep("weights", offload=True)
    total = PAGE + 5120 + PAGE
    assert vsim.calls_named("host_alloc") == [(total,)]
    assert vsim.pinned_bytes == total == vpool.stats().offloaded_bytes
    # One copy a run, without a wait each (kind 4), then one synchronize before the unmap.
    assert [(args[0], args[3]) for args in vsim.calls_named("copy")] == [
        (4, PAGE + 5120), (4, PAGE)]
    assert names(vsim, "copy", "synchronize", "unmap")[-2:] == ["synchronize", "unmap"]
    vpool.wake("weights")
    assert [(args[0], args[3]) for args in vsim.calls_named("copy")][-2:] == [
        (1, PAGE + 5120), (1, PAGE)]
    # The chunk stays for the next sleep.
    assert vsim.pinned_bytes == total == vpool.stats().pinned_bytes
    assert vpool.stats().offloaded_bytes == 0
    for i, b in enumerate(bufs):
        np.testing.assert_array_equal(b.copy_to_host(), pattern(b.nbytes, i))
    check_invariants(vpool)


def test_without_page_locked_memory_offload_uses_host_buffers(vpool, vsim):
    with gpupool.tag("weights"):
        b = vpool.allocate(2 * PAGE)
    b.copy_from_host(pattern(2 * PAGE, 4))
    vsim.inject(Failures("host_alloc", nth=1))     # the upstream refuses: the pool's own
    vpool.sleep("weights", offload=True)
    assert vsim.pinned_bytes == 0 and vpool.stats().offloaded_bytes == 2 * PAGE
    vpool.wake("weights")
    np.testing.assert_array_equal(b.copy_to_host(), pattern(2 * PAGE, 4))
    check_invariants(vpool)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_buffer_closed_asleep_leaves_the_offloaded_bytes_and_then_its_host_copy(
        vpool, vsim, pinned):
    # offloaded_bytes kept a closed sleeping buffer's bytes, and the pool their host copy,
    # until wake (trial 29). Now its bytes leave at the close; the host copy (one chunk,
    # page-locked or, where the upstream refuses, the pool's own) goes back with the last
    # offloaded buffer, and wake restores what is left.
    with gpupool.tag("w"):
        a, b = vpool.allocate(MIB), vpool.allocate(PAGE)
    a.copy_from_host(pattern(MIB, 1))
    b.copy_from_host(pattern(PAGE, 2))
    held = MIB + PAGE if pinned else 0              # page-locked bytes the pool holds
    vsim.inject(None if pinned else Failures("host_alloc", nth=1))
    vpool.sleep("w", offload=True)
    a.close()
    stats = check_invariants(vpool)
    assert (stats.asleep_bytes, stats.offloaded_bytes, stats.pinned_bytes) == (PAGE, PAGE, held)
    vpool.wake("w")                                 # b's bytes come back, a's place is free
    np.testing.assert_array_equal(b.copy_to_host(), pattern(PAGE, 2))
    stats = check_invariants(vpool)
    assert (stats.offloaded_bytes, stats.pinned_bytes) == (0, held)     # kept for the next
    vpool.sleep("w", offload=True)
    b.close()
    stats = check_invariants(vpool)
    assert (stats.asleep_bytes, stats.offloaded_bytes, stats.pinned_bytes) == (0, 0, 0)
    assert vsim.pinned_bytes == 0
    vpool.wake("w")                                 # nothing to restore
    with gpupool.tag("w"):
        c = vpool.allocate(MIB)
    c.copy_from_host(pattern(MIB, 3))
    np.testing.assert_array_equal(c.copy_to_host(), pattern(MIB, 3))
    del c
    assert check_invariants(vpool).in_use_bytes == 0 and vsim.errors == []


def test_a_pool_ending_asleep_gives_its_page_locked_chunk_back(vsim):
    pool = gpupool.Pool(upstream=vsim)
    with gpupool.tag("weights"):
        b = pool.allocate(PAGE)
    pool.sleep("weights", offload=True)
    assert vsim.pinned_bytes == PAGE
    del b, pool
    gc.collect()
    assert vsim.pinned_bytes == 0 and vsim.errors == []


# On a real device (marked gpu) --------------------------------------------------------------

def _ok(result):
    """A cuda.bindings.driver call's results after its CUresult, which must be success."""
    from cuda.bindings import driver

    assert result[0] == driver.CUresult.CUDA_SUCCESS, result[0]
    return result[1] if len(result) == 2 else result[1:]


@pytest.mark.gpu
def test_on_a_gpu_sleep_frees_the_pages_and_a_graph_replays_after_wake(gpu_pool):
    from cuda.bindings import driver

    _ok(driver.cuInit(0))
    dev = _ok(driver.cuDeviceGet(0))
    _ok(driver.cuCtxSetCurrent(_ok(driver.cuDevicePrimaryCtxRetain(dev))))
    n = 64 * MIB + 12345
    before = gpu_pool.stats().reserved_bytes
    with gpupool.tag("gpu-weights"):
        w = gpu_pool.allocate(n)
    tagged = gpu_pool.stats().reserved_bytes - before
    ptr, data = w.ptr, pattern(n, 5)
    w.copy_from_host(data)
    # A graph that sets the block to 9, captured before sleep.
    stream = _ok(driver.cuStreamCreate(0))
    _ok(driver.cuStreamBeginCapture(
        stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    _ok(driver.cuMemsetD8Async(driver.CUdeviceptr(ptr), 9, n, stream))
    graph = _ok(driver.cuStreamEndCapture(stream))
    graph_exec = _ok(driver.cuGraphInstantiate(graph, 0))
    free_awake = gpu_pool.mem_info()[0]
    mapped_awake = gpu_pool.upstream.mapped_bytes
    gpu_pool.sleep("gpu-weights", offload=True)
    assert mapped_awake - gpu_pool.upstream.mapped_bytes == tagged
    assert gpu_pool.mem_info()[0] - free_awake >= 0.99 * tagged
    with pytest.raises(gpupool.SleepingMemoryError):
        w.copy_to_host()
    gpu_pool.wake("gpu-weights")
    assert w.ptr == ptr
    np.testing.assert_array_equal(w.copy_to_host(), data)
    _ok(driver.cuGraphLaunch(graph_exec, stream))
    _ok(driver.cuStreamSynchronize(stream))
    assert (w.copy_to_host() == 9).all()
    _ok(driver.cuGraphExecDestroy(graph_exec))
    _ok(driver.cuGraphDestroy(graph))
    _ok(driver.cuStreamDestroy(stream))
    del w
    check_invariants(gpu_pool)


@pytest.mark.gpu
def test_on_a_gpu_the_driver_upstream_refuses_sleep():
    pool = gpupool.Pool(device=0, upstream="driver")
    with pytest.raises(gpupool.GpupoolError, match=r"upstream='vmm'"):
        pool.sleep("weights")
