"""Expandable segments (the "vmm" upstream) on the simulated device, and on a real device
(marked gpu): gpupool.VmmUpstream over the driver's virtual memory API. Trim, stream order,
the out-of-memory ladder, the upstream's choice from the environment, random operations and
regressions; growth is test_growexpand.py's, the simulated device vmm_sim.py's.
"""

import gc
import mmap

import numpy as np
import pytest
from conftest import check_invariants
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant
from test_state_machine import PoolMachine
from vmm_sim import KIB, MIB, PAGE, device_used, names, vmm
from vmm_sim import gpu_pool, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.testing import SimulatedDevice


# (3) Trim ----------------------------------------------------------------------------------

def test_trim_synchronizes_then_unmaps_whole_free_pages_only(vpool, vsim):
    s = vsim.create_stream()
    live = vpool.allocate(PAGE // 2, stream=s)      # half of the first page
    big = vpool.allocate(4 * PAGE, stream=s)        # the rest of it and 4 more pages
    base = live.ptr
    assert vpool.stats().reserved_bytes == 5 * PAGE
    live.copy_from_host(np.arange(PAGE // 2, dtype=np.uint8) % 251)
    vsim.launch(s)                                  # work on big still pending at its free
    del big
    vsim.calls.clear()
    assert vpool.trim() == 4 * PAGE
    # The device synchronized first, then the whole pages went: the end of the segment.
    assert names(vsim, "synchronize", "unmap", "map", "trim") == ["synchronize", "unmap", "trim"]
    assert vsim.calls_named("unmap") == [(base + PAGE, 4 * PAGE)]
    assert vsim.errors == []
    stats = check_invariants(vpool)
    assert stats.reserved_bytes == vsim.device_bytes == PAGE
    # The partial page stays mapped and cached, the live block's page stays mapped.
    assert vpool.cached_blocks() == [(base + PAGE // 2, PAGE // 2, True)]
    assert vsim.mapped(base, PAGE) and not vsim.mapped(base + PAGE, PAGE)
    np.testing.assert_array_equal(live.copy_to_host(),
                                  np.arange(PAGE // 2, dtype=np.uint8) % 251)
    live.memset(7)
    assert (live.copy_to_host() == 7).all()


def test_a_trim_with_nothing_cached_neither_synchronizes_nor_unmaps(vpool, vsim):
    keep = vpool.allocate(PAGE)
    vpool.allocate(3 * PAGE).close()        # freed on the legacy stream: bound to it
    vsim.calls.clear()
    assert vpool.trim() == 3 * PAGE
    assert names(vsim, "synchronize", "unmap") == ["synchronize", "unmap"]
    vsim.calls.clear()
    assert vpool.trim() == 0                # nothing cached: no synchronize, no unmap
    assert names(vsim, "synchronize", "unmap") == []
    assert vsim.mapped(keep.ptr, PAGE)


# (6) Stream order ---------------------------------------------------------------------------

def test_a_block_freed_on_a_busy_stream_reaches_another_only_behind_its_event(vpool, vsim):
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    wall = vpool.allocate(PAGE, stream=a)           # x is not the free end of a's segment
    ptr = x.ptr
    vsim.launch(a)
    del x
    held = [vpool.allocate(4 * PAGE, stream=b)]     # no event on x yet: b's own segment
    assert not ptr <= held[0].ptr < ptr + 5 * PAGE
    assert vsim.calls_named("event_record") == [] and vsim.calls_named("stream_wait_event") == []
    held.append(vpool.allocate(8 * PAGE, stream=a))     # a allocates (at its end): x's event
    assert [args[1] for args in vsim.calls_named("event_record")] == [a]
    queued = vsim._queued[a]
    y = vpool.allocate(4 * PAGE, stream=b)          # a is still busy: b waits on the GPU
    assert y.ptr == ptr
    assert [args[0] for args in vsim.calls_named("stream_wait_event")] == [b]
    assert vsim.pending(a) and vsim.ordered(b, a, queued)
    assert names(vsim, "synchronize") == []
    del wall


def test_a_stream_that_cuts_its_own_marked_block_keeps_the_event_on_the_rest(vpool, vsim):
    # The GPU test's order: a's free block is its segment's free end, and a's next request
    # is cut from that very block (the one its event was recorded on).
    a, b = vsim.create_stream(), vsim.create_stream()
    small = vpool.allocate(256, stream=a)
    x = vpool.allocate(4 * PAGE, stream=a)
    ptr = x.ptr
    vsim.launch(a)
    del x
    first = vpool.allocate(4 * PAGE, stream=b)      # no event on x yet: b's own segment
    assert not ptr <= first.ptr < ptr + 4 * PAGE
    del small
    kept = vpool.allocate(256, stream=a)            # a allocates: an event marks its work
    assert [args[1] for args in vsim.calls_named("event_record")] == [a]
    y = vpool.allocate(4 * PAGE, stream=b)          # the rest of a's block, behind that event
    assert y.ptr == ptr
    assert [args[0] for args in vsim.calls_named("stream_wait_event")] == [b]
    assert vsim.ordered(b, a, vsim._queued[a])
    del kept, first, y


def test_a_pool_s_end_waits_for_queued_work_before_unmapping(vsim):
    # cuMemUnmap does not wait for the device's work as cuMemFree does: a kernel still
    # running on a freed block would fault on the unmapped pages.
    pool = gpupool.Pool(upstream=vsim)
    s = vsim.create_stream()
    x = pool.allocate(PAGE, stream=s)
    vsim.launch(s)                                  # still running when the pool ends
    del x
    vsim.calls.clear()
    del pool
    gc.collect()
    assert names(vsim, "synchronize", "unmap", "unreserve")[:2] == ["synchronize", "unmap"]
    assert vsim.errors == []


# (7) The out-of-memory ladder -------------------------------------------------------------

def test_out_of_memory_unmaps_free_pages_and_the_retry_maps_elsewhere():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    f1, l1 = pool.allocate(4 * PAGE), pool.allocate(2 * PAGE)
    f2, l2 = pool.allocate(4 * PAGE), pool.allocate(2 * PAGE)
    f3 = pool.allocate(4 * PAGE)
    base = f1.ptr
    assert sim.used == sim.capacity                 # the device is full
    del f1, f2, f3                                  # 12 pages free, no 6 of them in a row
    sim.calls.clear()
    x = pool.allocate(6 * PAGE)
    # Mapping 6 more pages failed; the ladder's trim synchronized, unmapped the free pages
    # (two holes and the segment's end), and the retry mapped 6 pages in a new range.
    assert pool.stats().oom_retries == 1
    calls = names(sim, "synchronize", "map", "unmap")
    assert calls.index("synchronize") < calls.index("unmap")
    assert sorted(sim.calls_named("unmap")) == [(base, 4 * PAGE), (base + 6 * PAGE, 4 * PAGE),
                                                 (base + 12 * PAGE, 4 * PAGE)]
    assert calls[-1] == "map" and sim.calls_named("map")[-1] == (x.ptr, 6 * PAGE)
    assert not base <= x.ptr < base + 16 * PAGE
    assert all(sim.mapped(b.ptr, b.nbytes) for b in (x, l1, l2))
    assert check_invariants(pool).reserved_bytes == sim.used == 10 * PAGE
    x.memset(3)
    assert (x.copy_to_host() == 3).all()
    assert sim.errors == []


def test_out_of_memory_after_the_ladder_when_the_live_bytes_leave_no_room():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    keep = [pool.allocate(4 * PAGE), pool.allocate(8 * PAGE)]
    pool.allocate(4 * PAGE).close()
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(5 * PAGE)                     # 12 pages live: 4 free at the most
    assert pool.stats().reserved_bytes == sim.used == 12 * PAGE     # the free end unmapped
    assert [sim.mapped(b.ptr, b.nbytes) for b in keep] == [True, True]
    assert sim.errors == []


# (8) Choosing the upstream from the environment ---------------------------------------------

def test_a_bad_gpupool_upstream_raises_naming_the_variable(monkeypatch):
    monkeypatch.setenv("GPUPOOL_UPSTREAM", "bogus")
    with pytest.raises(ValueError, match="GPUPOOL_UPSTREAM='bogus'") as info:
        gpupool.Pool(upstream=None)
    assert all(name in str(info.value) for name in ("driver", "async", "vmm"))
    with pytest.raises(ValueError, match="GPUPOOL_UPSTREAM"):
        gpupool.Pool()                              # upstream=None is the default
    sim = SimulatedDevice(capacity=MIB, virtual_memory=True, page=PAGE)
    assert gpupool.Pool(upstream=sim).allocate(10).nbytes == 10     # an explicit one wins


def test_an_empty_gpupool_upstream_is_unset(monkeypatch):
    monkeypatch.setenv("GPUPOOL_UPSTREAM", "")
    try:
        pool = gpupool.Pool()                   # the default upstream, as without the variable
    except gpupool.NoDeviceError:
        return                                  # no driver here: not the ValueError of a name
    assert isinstance(pool.upstream, (gpupool.VmmUpstream, gpupool.DriverUpstream))


# Random operations ---------------------------------------------------------------------------

class VmmPoolMachine(PoolMachine):
    """The state machine of test_state_machine.py over expandable segments, on the legacy
    stream only (its three "streams" are one); also every live buffer's pages stay mapped
    and the reserved bytes are the mapped ones."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.sim = SimulatedDevice(capacity=128 * MIB, virtual_memory=True, page=PAGE)
        self.pool = gpupool.Pool(upstream=self.sim)
        self.region = gpupool.Region(pool=self.pool)
        self.streams = self.machine_streams()
        self.live = []
        self.freed = []
        self.max_in_use = 0

    def machine_streams(self):
        return [0, 0, 0]

    @invariant()
    def live_buffers_are_mapped(self):
        for buf, _ in self.live:
            assert self.sim.mapped(buf.ptr, buf.nbytes), f"live buffer {buf!r} unmapped"
        assert self.pool.stats().reserved_bytes == self.sim.device_bytes


class VmmStreamsPoolMachine(VmmPoolMachine):
    """The same over three streams, and no misuse of the simulated device (no unmap while a
    stream has work pending)."""

    def machine_streams(self):
        return [0] + [self.sim.create_stream() for _ in range(2)]

    @invariant()
    def no_misuse(self):
        assert self.sim.errors == []


VmmPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                            deadline=None)
VmmStreamsPoolMachine.TestCase.settings = VmmPoolMachine.TestCase.settings
TestVmmPoolOnOneStream = VmmPoolMachine.TestCase
TestVmmPoolOnThreeStreams = VmmStreamsPoolMachine.TestCase


# Regressions: core bugs found by these tests, each a minimal reproduction -------------------

def test_trim_unmaps_a_free_page_of_a_reservation_aligned_to_the_host_page_only():
    big = 64 * KIB
    held, spacers = [], []
    for _ in range(64):
        sim = SimulatedDevice(capacity=4 * big, virtual_memory=True, page=big)
        pool = gpupool.Pool(upstream=sim)
        buf = pool.allocate(big)
        base = buf.ptr
        del buf
        if base % big:
            break
        held.append(pool)           # keeps its range, and a host page next to it shifts the
        spacers.append(mmap.mmap(-1, mmap.PAGESIZE))        # next reservation off alignment
    else:
        pytest.skip("every reservation happened to be aligned to 64 KiB")
    assert pool.trim() == big                       # 0: no whole page found in the block
    assert sim.calls_named("unmap") == [(base, big)] and sim.errors == []


def test_growth_behind_a_free_end_bound_to_another_stream_succeeds():
    vsim, vpool = vmm()
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    y = vpool.allocate(4 * PAGE, stream=a)
    y.stream = b
    del y                                   # free on b, at the end of a's segment
    z = vpool.allocate(6 * PAGE, stream=a)  # OutOfMemoryError, 64 MiB free
    assert z.nbytes == 6 * PAGE
    del x


def test_the_legacy_stream_allocates_after_another_stream_took_its_free_end():
    vsim, vpool = vmm()
    s = vsim.create_stream()
    vpool.allocate(1).close()           # a page; its free rest on the legacy stream
    x = vpool.allocate(1, stream=s)     # s takes it (the legacy stream's event is recorded at
    y = vpool.allocate(1)               # once); its rest is now on s: ValueError, map of 0 B
    assert y.nbytes == 1 and vsim.errors == []
    del x


def test_a_hole_next_to_a_block_free_on_another_stream_is_mapped_for_the_request():
    vsim, vpool = vmm()
    a, b = vsim.create_stream(), vsim.create_stream()
    x = vpool.allocate(4 * PAGE, stream=a)
    h = vpool.allocate(4 * PAGE, stream=a)
    w = vpool.allocate(PAGE, stream=a)
    del h
    assert vpool.trim() == 4 * PAGE         # a hole between x and w
    w.stream = b
    del w                                   # free on b, next to the hole
    z = vpool.allocate(4 * PAGE, stream=a)  # OutOfMemoryError
    assert z.ptr == x.ptr + 4 * PAGE
    del x


def test_a_trim_after_merge_streams_does_not_unmap_while_a_stream_is_busy():
    vsim, vpool = vmm()
    keep = vpool.allocate(PAGE)
    vpool.allocate(2 * PAGE).close()
    vpool.merge_streams()                   # the free pages: free for any stream, unbound
    vsim.launch(0)                          # work on keep
    assert vpool.trim() == 2 * PAGE         # 0: the unmap was refused as a misuse
    assert vsim.errors == []
    del keep


def test_requests_larger_than_the_device_leave_no_reservations_behind():
    sim = SimulatedDevice(capacity=16 * PAGE, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    for _ in range(3):
        with pytest.raises(gpupool.OutOfMemoryError):
            pool.allocate(17 * PAGE)
    pool.trim()
    assert len(sim.calls_named("reserve")) == len(sim.calls_named("unreserve"))


def test_a_regions_free_end_grows_with_its_bytes_counted():
    sim, pool = vmm()
    region = gpupool.Region(pool=pool)
    with region:
        a = pool.allocate(6 * PAGE)
        del a                               # the region's free end of the segment
        b = pool.allocate(10 * PAGE)        # maps 4 pages more, joined with it
        assert region.stats().cached_bytes == 0
        del b
    assert region.stats().cached_bytes == pool.stats().cached_bytes == 10 * PAGE
    region.release()
    assert region.stats().cached_bytes == 0
    check_invariants(pool)


def test_an_ignored_upstream_error_does_not_keep_the_callers_buffers_alive():
    vsim, vpool = vmm()
    a = vsim.create_stream()
    x = vpool.allocate(PAGE, stream=a)
    del x                                   # free on a, no event yet
    vpool.allocate(PAGE)                    # the legacy stream wants it: a is asked for one

    def failing_record(event, stream):
        raise RuntimeError("simulated cuEventRecord failure")

    vsim._event_record = failing_record

    def step():
        buf = vpool.allocate(PAGE, stream=a)    # a allocates: its event cannot be recorded
        return buf.nbytes

    assert step() == PAGE                   # the pool falls back (no event: no hand-off)
    del vsim._event_record
    gc.collect()
    # Kept, the exception's traceback would hold step's frame, and its buffer, alive.
    assert vpool.stats().in_use_bytes == 0


class FailingUnmap(SimulatedDevice):
    """A device whose unmaps fail (a driver error): a trim keeps the pages and goes on."""

    def _unmap(self, va, nbytes):
        raise RuntimeError("simulated driver failure")


def test_a_refused_unmap_in_a_trim_does_not_keep_the_callers_buffers_alive():
    sim = FailingUnmap(capacity=64 * MIB, virtual_memory=True, page=PAGE)
    pool = gpupool.Pool(upstream=sim)
    pool.allocate(4 * PAGE).close()

    def step():
        buf = pool.allocate(2 * PAGE)   # cut from the free pages: 2 of them stay free
        with pytest.warns(RuntimeWarning, match="unmap: RuntimeError: simulated driver"):
            assert pool.trim() == 0     # the unmap failed: nothing given back, no error
        return buf.nbytes

    assert step() == 2 * PAGE           # buf is dead once step returns
    gc.collect()
    # Kept, the failed unmap's traceback would hold step's frame, and its buffer, alive.
    assert pool.stats().in_use_bytes == 0
    check_invariants(pool)


def test_pages_of_a_range_not_aligned_to_the_page_size_are_found():
    page = 3 * 512 * KIB                    # not a divisor of the host's mmap alignment
    sim = SimulatedDevice(capacity=64 * MIB, virtual_memory=True, page=page)
    pool = gpupool.Pool(upstream=sim)
    buf = pool.allocate(2 * page)
    buf.copy_from_host(np.ones(2 * page, np.uint8))
    assert sim.mapped(buf.ptr, buf.nbytes) and (buf.copy_to_host() == 1).all()
    assert sim.errors == []


# On a real device (marked gpu): gpupool.VmmUpstream (upstream "vmm") over the driver's
# virtual memory API.

@pytest.mark.gpu
def test_the_upstream_maps_pages_of_its_granularity(gpu_pool):
    upstream = gpu_pool.upstream
    assert isinstance(upstream, gpupool.VmmUpstream) and upstream.expandable
    assert upstream.granularity >= 64 << 10 and upstream.granularity % 512 == 0
    assert upstream.va_bytes >= gpu_pool.mem_info()[1]
    buf = gpu_pool.allocate(3 * MIB + 17)
    pages = -(-(3 * MIB + 17) // upstream.granularity)
    assert upstream.mapped_bytes == gpu_pool.stats().reserved_bytes == pages * upstream.granularity
    del buf


@pytest.mark.gpu
def test_memory_of_every_size_holds_data_across_pages(gpu_pool):
    rng = np.random.default_rng(0)
    kept = []
    for nbytes in (1, 256, 4097, 300_000, 3 * MIB + 5, 64 * MIB, 256 * MIB + 4096):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        buf = gpu_pool.allocate(nbytes)
        assert buf.ptr % 256 == 0
        buf.copy_from_host(data)
        kept.append((buf, data))
    for buf, data in kept:
        assert np.array_equal(buf.copy_to_host(), data)
    big = gpu_pool.allocate(kept[-1][0].nbytes)
    big.copy_from_host(kept[-1][0])                 # device to device, across pages
    assert np.array_equal(big.copy_to_host(), kept[-1][1])


@pytest.mark.gpu
def test_trim_gives_whole_free_pages_back_to_the_device(gpu_pool):
    before = device_used(gpu_pool)
    keep = gpu_pool.allocate(8 * MIB)
    keep.memset(5)
    temp = gpu_pool.allocate(512 * MIB)
    temp.memset(9)
    assert device_used(gpu_pool) - before >= 520 * MIB
    del temp
    released = gpu_pool.trim()                      # synchronizes: the memset is done
    assert released >= 512 * MIB
    assert device_used(gpu_pool) - before < 64 * MIB
    assert (keep.copy_to_host() == 5).all()         # a live block's pages stay mapped
    again = gpu_pool.allocate(512 * MIB)            # maps pages again
    again.memset(1)
    assert (again.copy_to_host()[::MIB] == 1).all()


@pytest.mark.gpu
def test_a_block_freed_on_a_busy_stream_reaches_another_only_behind_its_work(gpu_pool):
    cupy = pytest.importorskip("cupy")
    slow = cupy.RawKernel(r"""
    extern "C" __global__ void slow_fill(unsigned char* p, long long n, long long spins) {
        long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        for (long long k = 0; k < spins; ++k) __nanosleep(100);
        for (; i < n; i += (long long)gridDim.x * blockDim.x) p[i] = 42;
    }""", "slow_fill")
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    n = 8 * MIB
    small = gpu_pool.allocate(256, stream=a.ptr)
    buf = gpu_pool.allocate(n, stream=a.ptr)
    ptr = buf.ptr
    with a:
        slow((64,), (256,), (cupy.uint64(ptr), cupy.int64(n), cupy.int64(20_000)))
    del buf                                         # the kernel still writes it on a
    first = gpu_pool.allocate(n, stream=b.ptr)      # a's block has no event yet: another
    assert first.ptr != ptr
    del small
    kept = gpu_pool.allocate(256, stream=a.ptr)     # a allocates: an event marks its work
    second = gpu_pool.allocate(n, stream=b.ptr)     # a's block, behind a GPU-side wait
    assert second.ptr == ptr
    second.memset(7, stream=b.ptr)                  # ordered after the kernel's 42s
    assert (second.copy_to_host(stream=b.ptr) == 7).all()
    a.synchronize()
    del kept


@pytest.mark.gpu
def test_cupy_and_torch_read_vmm_memory(gpu_pool):
    cupy = pytest.importorskip("cupy")
    buf = gpu_pool.allocate(4 * MIB)
    view = cupy.from_dlpack(buf.view("float32", (1 << 20,)))
    view[:] = cupy.arange(1 << 20, dtype=cupy.float32)
    assert float(view.sum()) == float(np.arange(1 << 20, dtype=np.float64).sum())
    torch = pytest.importorskip("torch")
    tensor = torch.from_dlpack(buf.view("float32", (1 << 20,)))
    assert tensor.device.type == "cuda" and int(tensor[12345]) == 12345
