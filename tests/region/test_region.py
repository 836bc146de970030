"""Regions on the simulated device: cached steps, working-set peak, exit policies."""

import dataclasses
import gc
import re
import threading
import weakref

import pytest
from conftest import check_invariants

import gpupool
from gpupool.testing import SimulatedDevice

KIB, MIB = 1024, 1 << 20


class Node:
    """An autograd-like node: it refers to itself, so it dies only in a garbage collection."""

    def __init__(self, buf):
        self.buf = buf
        self.backward = lambda: self


@pytest.fixture
def region(pool):
    return gpupool.Region(pool=pool)


def step(pool, sizes):
    bufs = [pool.allocate(n) for n in sizes]
    return [b.ptr for b in bufs]


def test_later_entries_get_the_first_entrys_addresses_without_growing(pool, region, sim):
    sizes = [300 * KIB, 700 * KIB, 5 * KIB, 300 * KIB]
    with region:
        first = step(pool, sizes)
    # The first request grows the pool by a 2 MiB page; the others are cut from its rest.
    assert region.stats().cache_misses == 1 and region.stats().cache_hits == 3
    for _ in range(3):
        with region:
            assert step(pool, sizes) == first
    stats = region.stats()
    assert stats.entries == 4 and stats.cache_hits == 15 and stats.cache_misses == 1
    assert sim.calls_named("alloc") == [(2 << 20,)]


def test_same_addresses_whatever_order_the_step_freed_in(pool, region):
    # Blocks are handed out oldest first, so the first entry's order is kept too.
    with region:
        a, b, c = (pool.allocate(300 * KIB) for _ in range(3))
        first = [a.ptr, b.ptr, c.ptr]
        del c, a, b
    with region:
        bufs = [pool.allocate(300 * KIB) for _ in range(3)]
        assert [x.ptr for x in bufs] == first
        for index in (1, 0, 0):                     # free in yet another order
            del bufs[index]
    with region:
        assert step(pool, [300 * KIB] * 3) == first


def test_another_dtype_or_shape_of_about_the_same_size_gets_the_same_block(pool, region):
    with region:
        first = pool.allocate(1000).ptr
    with region:
        assert pool.allocate(1020).ptr == first       # both take 1 KiB (512-byte steps)
    assert region.stats().cache_hits == 1


def test_new_sizes_are_cut_from_the_regions_free_blocks(pool, region, sim):
    with region:
        step(pool, [300 * KIB])
    with region:
        step(pool, [300 * KIB, 900 * KIB])          # both fit in the first entry's page
    stats = region.stats()
    assert stats.cache_hits == 2 and stats.cache_misses == 1
    assert stats.cached_bytes == pool.stats().reserved_bytes == 2 << 20   # joined again
    assert len(sim.calls_named("alloc")) == 1
    with region:
        step(pool, [3 << 20])                       # larger than all it holds: growth
    assert region.stats().cache_misses == 2


def test_early_free_is_reused_in_the_same_step_and_peak_is_the_working_set(pool, region):
    size = gpupool.size_class(400 * KIB)
    with region:
        for _ in range(10):                  # ten allocations, never more than two alive
            a = pool.allocate(400 * KIB)
            b = pool.allocate(400 * KIB)
            del a, b
    stats = region.stats()
    assert stats.peak_in_use_bytes == 2 * size
    assert stats.cache_hits == 19 and stats.cache_misses == 1
    assert pool.stats().reserved_bytes == 2 << 20       # one page holds the working set


def test_cyclic_garbage_dies_at_exit_and_memory_stays_flat(pool, region):
    reserved = []
    for _ in range(5):
        with region:
            nodes = [Node(pool.allocate(200 * KIB)) for _ in range(4)]
            del nodes
        reserved.append(pool.stats().reserved_bytes)
        assert region.stats().live_at_exit_bytes == 0
    assert len(set(reserved)) == 1
    assert region.stats().collections == 5


def test_no_collection_when_nothing_is_alive(pool, region):
    with region:
        step(pool, [100])
    assert region.stats().collections == 0


def test_detach_survivors_return_to_the_pool(pool, region):
    with region:
        kept = pool.allocate(300 * KIB)
        ptr = kept.ptr
    assert region.stats().live_at_exit_bytes == gpupool.size_class(300 * KIB)
    assert kept.ptr == ptr                       # still valid
    with region:
        other = pool.allocate(300 * KIB)         # never aliased with the detached buffer
        assert other.ptr != ptr
    del kept
    region.release()
    check_invariants(pool)
    assert pool.stats().in_use_bytes == gpupool.size_class(300 * KIB)


def test_invalidate_survivors(pool):
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        escaped = pool.allocate(300 * KIB)
        ptr = escaped.ptr
    with pytest.raises(gpupool.InvalidBufferError, match="invalidated"):
        _ = escaped.ptr
    with pytest.raises(gpupool.InvalidBufferError):
        _ = escaped.__cuda_array_interface__
    with region:
        assert pool.allocate(300 * KIB).ptr == ptr     # the block was recycled
    del escaped
    check_invariants(pool)


def test_keep_exempts_a_buffer(pool):
    region = gpupool.Region(pool=pool, on_exit="invalidate")

    class ArrayView:                       # any exporter of the interface over region memory
        def __init__(self, buf):
            self.__cuda_array_interface__ = dict(
                buf.__cuda_array_interface__, data=(buf.ptr + 256, False))

    with region:
        a = region.keep(pool.allocate(1000))
        b = pool.allocate(2000)
        region.keep(ArrayView(b))
        c = pool.allocate(3000)
        with pytest.raises(TypeError):
            region.keep(object())
    assert not a.closed and not b.closed and c.closed
    assert region.stats().live_at_exit_bytes == gpupool.size_class(3000)


def test_keep_refuses_foreign_memory(pool, region):
    outside = pool.allocate(100)
    with region, pytest.raises(ValueError):
        region.keep(outside)


def test_exception_inside_the_block_runs_the_exit_and_leaves_it_usable(pool, region):
    def failing_step():
        temp = pool.allocate(300 * KIB)          # held by the traceback while it propagates
        raise RuntimeError(f"step failed with {temp.ptr:#x} alive")

    with pytest.raises(RuntimeError) as info:
        with region:
            failing_step()
    assert region.stats().live_at_exit_bytes == gpupool.size_class(300 * KIB)   # detached
    del info                                     # the traceback, and so the buffer, die
    assert pool.stats().in_use_bytes == 0
    with region:
        step(pool, [300 * KIB])
    assert region.stats().entries == 2
    check_invariants(pool)


def test_nested_regions_recycle_their_own_allocations(pool):
    outer, inner = gpupool.Region(pool=pool), gpupool.Region(pool=pool)
    with outer:
        a = pool.allocate(300 * KIB)
        a_ptr = a.ptr
        with inner:
            b = pool.allocate(300 * KIB)
            del a                                  # outer's block goes back to outer
            c = pool.allocate(300 * KIB)           # so inner does not get it
            assert c.ptr != a_ptr
            del b, c
        assert outer.stats().cached_bytes == gpupool.size_class(300 * KIB)
        # Inner's frees joined the rest of the page (the pool's) into one block of inner's.
        assert inner.stats().cached_bytes == pool.stats().reserved_bytes - 300 * KIB
        d = pool.allocate(300 * KIB)               # outer is current again: its block
        assert d.ptr == a_ptr
        assert outer.stats().cache_hits == 1
        del d


def test_entering_a_region_twice_is_refused(pool, region):
    with region:
        with pytest.raises(gpupool.GpupoolError, match="already entered"):
            region.__enter__()
        errors = []

        def other_thread():
            try:
                region.__enter__()
            except gpupool.GpupoolError as exc:
                errors.append(exc)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert len(errors) == 1
    with region:                                   # still usable afterwards
        pass


def test_exiting_a_region_that_was_not_entered_is_refused(pool, region):
    with pytest.raises(gpupool.GpupoolError, match="exited without being entered"):
        region.__exit__(None, None, None)
    with region:                                   # the stack of entered regions is intact
        buf = pool.allocate(1000)
    assert region.stats().cache_misses == 1 and region.stats().entries == 1
    with pytest.raises(gpupool.GpupoolError, match="exited without being entered"):
        region.__exit__(None, None, None)          # once more after a proper exit
    del buf
    errors = []
    with region:
        def other_thread():
            try:
                region.__exit__(None, None, None)
            except gpupool.GpupoolError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert len(errors) == 1 and "another thread" in errors[0]


def test_exiting_out_of_order_is_refused_and_leaves_both_entered(pool):
    outer, inner = gpupool.Region(pool=pool), gpupool.Region(pool=pool)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(gpupool.GpupoolError, match="entered inside it, is still entered"):
        outer.__exit__(None, None, None)
    buf = pool.allocate(1000)                      # the inner region is still the current one
    del buf
    assert inner.stats().cached_bytes == 1024 and outer.stats().cache_misses == 0
    inner.__exit__(None, None, None)               # in order, both exits work
    outer.__exit__(None, None, None)
    with outer:
        with gpupool.uncached():                   # uncached() is no region: no check
            pass
    assert outer.stats().entries == 2


def test_one_region_from_two_threads_in_turn(pool, region):
    ptrs = []

    def work():
        with region:
            ptrs.append(pool.allocate(300 * KIB).ptr)

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert ptrs[0] == ptrs[1]
    assert region.stats().cache_hits == 1


def test_threads_started_inside_do_not_inherit_the_region(pool, region):
    with region:
        t = threading.Thread(target=lambda: pool.allocate(300 * KIB))
        t.start()
        t.join()
    stats = region.stats()
    assert stats.cache_hits + stats.cache_misses == 0
    assert pool.stats().num_allocs == 1


def test_varying_batch_sizes(pool, region):
    for batch in (32, 64, 32, 17, 64):
        with region:
            step(pool, [batch * 4 * KIB, batch * 40 * KIB])
        check_invariants(pool)
    assert region.stats().cache_hits >= 4


def test_release_empties_the_cache_and_leaves_detached_buffers(pool, region):
    with region:
        kept = pool.allocate(3 * KIB)            # from a shared segment
        step(pool, [12 << 20])                   # above 10 MiB: a block of its own
    region.release()
    assert region.stats().cached_bytes == 0
    assert pool.trim() == 12 << 20
    assert kept.ptr
    check_invariants(pool)


def test_an_idle_regions_cache_serves_the_pool_before_it_grows(sim):
    pool = gpupool.Pool(upstream=type(sim)(capacity=4 << 20))
    region = gpupool.Region(pool=pool)
    with region:
        step(pool, [3 << 20])
    assert region.stats().cached_bytes == 4 << 20   # the page-rounded segment, joined
    buf = pool.allocate(2 << 20)                   # the region is idle: its blocks serve
    assert buf.nbytes == 2 << 20
    assert pool.stats().reserved_bytes == 4 << 20 and pool.stats().oom_retries == 0


def test_out_of_memory_ladder_drains_an_entered_regions_cache(sim):
    pool = gpupool.Pool(upstream=type(sim)(capacity=4 << 20))
    region = gpupool.Region(pool=pool)
    with region:
        step(pool, [3 << 20])
        assert region.stats().cached_bytes >= 3 << 20
        with gpupool.uncached():                   # the pool's, while the region is entered
            buf = pool.allocate(2 << 20)           # fits only once the region's cache goes
    assert buf.nbytes == 2 << 20
    assert region.stats().cached_bytes == 0
    assert pool.stats().oom_retries >= 1


def test_max_cached_bytes_sends_extra_blocks_to_the_pool(pool):
    region = gpupool.Region(pool=pool, max_cached_bytes=gpupool.size_class(300 * KIB))
    with region:
        step(pool, [300 * KIB, 300 * KIB])
    assert region.stats().cached_bytes == gpupool.size_class(300 * KIB)
    check_invariants(pool)


@pytest.fixture
def vmm_pool():
    sim = SimulatedDevice(capacity=1 << 30, virtual_memory=True)      # 2 MiB pages
    yield gpupool.Pool(upstream=sim)
    assert sim.errors == [], "the pool misused the simulated device"


def test_a_capped_regions_block_at_the_segments_end_grows_into_the_pools(vmm_pool):
    # helper-115's finding 2: the growth joined the new pages to the region's free last
    # block and the region kept the rest of it, past its cap (2,096,640 B cached for 1 MiB).
    region = gpupool.Region(pool=vmm_pool, max_cached_bytes=MIB)
    outside = vmm_pool.allocate(3 * MIB)
    for _ in range(4):
        with region:
            small = vmm_pool.allocate(100)
            vmm_pool.allocate(4096).close()
            large = vmm_pool.allocate(3 * MIB)
            del small, large
        assert region.stats().cached_bytes <= MIB
        check_invariants(vmm_pool)
    del outside


def test_a_capped_regions_request_beside_a_hole_grows_instead_of_failing(vmm_pool):
    # helper-115's finding 1: a hole was mapped for a request counting the region's free
    # neighbour, which its cap then kept apart: out of memory with the device nearly free.
    region = gpupool.Region(pool=vmm_pool, max_cached_bytes=MIB)
    vmm_pool.allocate(3 * MIB).close()
    live = vmm_pool.allocate(100)
    vmm_pool.trim()                             # the first page unmapped: a hole below
    with region:
        vmm_pool.allocate(4096).close()
        large = vmm_pool.allocate(3 * MIB)
        assert large.nbytes == 3 * MIB
        del large
    assert region.stats().cached_bytes <= MIB
    check_invariants(vmm_pool)
    del live


def test_uncached_allocations_bypass_the_region(pool):
    region = gpupool.Region(pool=pool, on_exit="invalidate")
    with region:
        with gpupool.uncached():
            logged = pool.allocate(100)
        temp = pool.allocate(100)
    assert not logged.closed and temp.closed
    stats = region.stats()
    assert stats.cache_hits + stats.cache_misses == 1      # temp alone was the region's


def test_bad_arguments(pool):
    with pytest.raises(ValueError):
        gpupool.Region(pool=pool, on_exit="forget")
    with pytest.raises(ValueError):
        gpupool.Region(pool=pool, collect="sometimes")
    with pytest.raises(TypeError):
        gpupool.Region(pool="pool")


def test_region_dropped_while_its_buffers_live(pool):
    region = gpupool.Region(pool=pool)
    with region:
        buf = pool.allocate(300 * KIB)
        step(pool, [700 * KIB])
    del region
    del buf                                        # returns to the pool, not a dead region
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0


def test_skip_first_leaves_the_first_entry_out_of_the_cache(pool):
    region = gpupool.Region(pool=pool, skip_first=True)
    with region:
        workspace = pool.allocate(900 * KIB)          # a one-off: served by the pool
        step(pool, [300 * KIB])
    assert region.stats().cached_bytes == 0 and region.stats().live_at_exit_bytes == 0
    for _ in range(2):
        with region:
            step(pool, [300 * KIB])
    stats = region.stats()
    # The workspace's page holds the step too: both entries are served from it.
    assert stats.entries == 3 and stats.cache_misses == 0 and stats.cache_hits == 2
    assert stats.peak_in_use_bytes == gpupool.size_class(300 * KIB)
    assert stats.cached_bytes == pool.stats().cached_bytes   # the page's free part
    del workspace


def test_keep_in_a_first_entry_that_skip_first_skips_keeps_the_pools_buffer(pool):
    # helper-115's finding: `model = region.keep(pool.allocate(...))` raised ValueError ("not
    # memory of a live buffer of this region") at step 0, whose buffers are the pool's.
    region = gpupool.Region(pool=pool, skip_first=True, on_exit="invalidate")
    models = []
    for _ in range(3):
        with region:
            models.append(region.keep(pool.allocate(4096)))
            step(pool, [300 * KIB])
    assert all(m.ptr and m.nbytes == 4096 for m in models)     # none invalidated
    with pytest.raises(ValueError, match="not memory of a live buffer of this region"):
        region.keep(pool.allocate(4096))                       # outside any entry, as before
    del models
    check_invariants(pool)


def test_debug_poisons_invalidated_blocks(pool, sim):
    np = pytest.importorskip("numpy")
    region = gpupool.Region(pool=pool, on_exit="invalidate", debug=True)
    with region:
        escaped = pool.allocate(4096)
        escaped.copy_from_host(np.zeros(4096, np.uint8))
        raw = escaped.ptr
    assert escaped.closed
    assert sim.calls_named("synchronize")
    assert sim.calls_named("memset")[-1] == (raw, 0xFF, 4096, 0)
    with region:
        again = pool.allocate(4096)
        assert again.ptr == raw
        assert (again.copy_to_host() == 0xFF).all()


def test_leak_warning_names_the_allocation_site(pool):
    region = gpupool.Region(pool=pool, trace=True, name="train-step")
    escaped = []
    with pytest.warns(ResourceWarning, match=r"train-step.*test_region\.py:\d+") as seen:
        for _ in range(5):
            with region:
                escaped.append(pool.allocate(300 * KIB))      # escapes every step
    assert seen[0].filename == __file__                          # the `with` line's file
    assert region.stats().live_at_exit_bytes == 5 * gpupool.size_class(300 * KIB)
    escaped.clear()
    assert region.stats().live_at_exit_bytes == 5 * gpupool.size_class(300 * KIB)  # last exit
    with region:
        pass
    assert region.stats().live_at_exit_bytes == 0


def test_an_unnamed_region_s_leak_warning_names_it_as_its_repr_did_at_that_exit(pool):
    # (The repr is made only for the warning, not at every exit: escapes.Escapes.exited.)
    region = gpupool.Region(pool=pool)
    escaped = []
    with pytest.warns(ResourceWarning) as seen:
        for _ in range(5):
            with region:
                escaped.append(pool.allocate(300 * KIB))
    assert len(seen) == 1
    assert str(seen[0].message).startswith(
        "gpupool region <gpupool.Region on_exit='detach' scope='thread' plan=False entries=4 "
        "cached=0>: bytes of buffers alive at exit grew for 3 consecutive entries")
    escaped.clear()


def test_leak_sites_in_a_folder_named_like_a_library_are_the_users(pool, tmp_path):
    # A user's project (or a checkout of gpupool) in a folder called gpupool or torch is the
    # user's code: only the libraries' install folders are skipped.
    user_file = tmp_path / "gpupool" / "torch" / "train.py"
    source = "def step(pool, kept):\n    kept.append(pool.allocate(300 * 1024))\n"
    namespace = {}
    exec(compile(source, str(user_file), "exec"), namespace)
    region = gpupool.Region(pool=pool, trace=True)
    kept = []
    with pytest.warns(ResourceWarning, match=re.escape(f"{user_file}:2")):
        for _ in range(5):
            with region:
                namespace["step"](pool, kept)
    kept.clear()


def test_no_leak_warning_for_a_steady_step(pool, recwarn):
    region = gpupool.Region(pool=pool)
    kept = None
    for _ in range(6):
        with region:
            kept = pool.allocate(300 * KIB)               # one survivor per step, not growing
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
    del kept


def test_process_scope_covers_every_thread(pool):
    region = gpupool.Region(pool=pool, scope="process")
    ptrs = []
    for _ in range(2):
        with region:
            t = threading.Thread(target=lambda: ptrs.append(pool.allocate(300 * KIB).ptr))
            t.start()
            t.join()
    assert ptrs[0] == ptrs[1]
    grown = pool.stats().upstream_allocs
    outside = pool.allocate(300 * KIB)          # not entered: the pool serves, not the region
    assert region.stats().cache_hits == 1 and region.stats().entries == 2
    assert outside.ptr == ptrs[0] and pool.stats().upstream_allocs == grown   # lent, no growth
    other = gpupool.Region(pool=pool, scope="process")
    with region, pytest.raises(gpupool.GpupoolError, match="scope='process'"):
        other.__enter__()


def test_keep_accepts_a_dlpack_exporter(pool):
    np = pytest.importorskip("numpy")
    region = gpupool.Region(pool=pool, on_exit="invalidate")

    class DLPackOver:
        """Exports, through a NumPy array's DLPack capsule, a pointer into a region block:
        keep() reads only the data pointer, as it would of a device array."""

        def __init__(self, buf):
            self.buf = buf

        def __dlpack__(self):
            view = np.ctypeslib.as_array((ctypes.c_uint8 * 64).from_address(self.buf.ptr + 512))
            return view.__dlpack__()

    import ctypes

    with region:
        buf = pool.allocate(4096)
        region.keep(DLPackOver(buf))
    assert not buf.closed


@pytest.mark.parametrize("value, error", [(-1, ValueError), ("lots", ValueError), (1.5, TypeError)])
def test_a_bad_max_cached_bytes_is_named_before_any_pool_is_looked_up(value, error):
    # No pool given: the argument is checked before the default pool (which needs a device).
    with pytest.raises(error, match=f"^max_cached_bytes={value!r}: "):
        gpupool.Region(max_cached_bytes=value)


@pytest.mark.parametrize("options", [{}, {"plan": True}, {"trace": True}])
def test_a_region_dropped_is_freed_with_its_pool(options):
    # A planned or traced region hands the core hooks of its own; they hold it weakly, so
    # dropping it frees it and its pool (and the pool's memory).
    sim = SimulatedDevice(capacity=1 << 30, virtual_memory=True)
    pool = gpupool.Pool(upstream=sim)
    region = gpupool.Region(pool=pool, collect=None, **options)
    for _ in range(3):
        with region:
            pool.allocate(1 << 20)
    refs = weakref.ref(region), weakref.ref(pool)
    del region, pool
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    assert sim.used == 0


def test_a_region_s_hits_count_free_memory_of_the_pool_s_too(pool):
    # RegionStats said "hits and misses of its cache", and a region caching nothing reported
    # hits (trial 29): its hits are its allocations served from free memory, its own cache's
    # or the pool's, as its docstring now says.
    pool.allocate(1024 * KIB).close()                 # the pool caches a block
    region = gpupool.Region(pool=pool, max_cached_bytes="1KiB")
    for _ in range(3):
        with region:
            pool.allocate(1024 * KIB).close()
    stats = region.stats()
    assert (stats.cache_hits, stats.cache_misses, stats.cached_bytes) == (3, 0, 0)
    doc = " ".join(gpupool.RegionStats.__doc__.split())
    assert "hits and misses of its cache" not in doc
    assert "a hit is served from free memory, its own cache's or the pool's" in doc


def test_every_field_of_region_stats_is_documented():
    # Fresh-user trial: help(RegionStats) named about 22 planned-region counters without
    # saying what they count (their meanings were source comments).
    attributes = gpupool.RegionStats.__doc__.partition("Attributes\n    ----------\n")[2]
    documented = set(re.findall(r"^    (\w+) : (?:int|float|bool)$", attributes, re.M))
    assert documented == {f.name for f in dataclasses.fields(gpupool.RegionStats)}


@pytest.mark.parametrize("returned", ["exit", "release", "drop"])
def test_two_regions_blocks_returned_to_the_pool_join_again(returned):
    # A region's cached block stays apart from another region's neighbour; once both went
    # back to the pool (an exit that did not use them, release(), the region dropped) they
    # are one free block, and a request of their joint size takes it without growing.
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=64 * KIB))
    a, b = gpupool.Region(pool=pool), gpupool.Region(pool=pool)
    below = pool.allocate(64 * KIB)
    with a:
        x = pool.allocate(1 << 20)
        with b:
            y, above = pool.allocate(1 << 20), pool.allocate(64 * KIB)
            y.close()                   # b's, next to a's x
        x.close()
    reserved = pool.stats().reserved_bytes
    with a:                             # uses nothing: x goes back to the pool
        pass
    if returned == "exit":
        with b:
            pass
    elif returned == "release":
        b.release()
    else:
        del b
        gc.collect()
    assert pool._verify() == []
    both = pool.allocate(2 << 20)
    assert pool.stats().reserved_bytes == reserved
    assert below.ptr < both.ptr < above.ptr
