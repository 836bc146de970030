"""The out-of-memory ladder and limits on the simulated device (core/ladder.pxd, core/oom.pyx):
hard and soft limits, the numbers an OutOfMemoryError carries, the on_oom callbacks."""

import contextlib
import logging
import pickle

import pytest
from conftest import check_invariants
from hypothesis import given, settings
from hypothesis import strategies as st

import gpupool
from gpupool.testing import SimulatedDevice

LARGE = 12 << 20      # above the segment limit (10 MiB): each block is its own upstream allocation


def test_hard_limit_trims_then_raises_with_the_numbers(sim):
    pool = gpupool.Pool(upstream=sim, hard_limit="3MiB")
    first = pool.allocate(2 << 20)
    del first
    second = pool.allocate(3 << 20)          # needs the cached 2 MiB block released first
    assert second.nbytes == 3 << 20
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(1 << 20)
    message = str(info.value)
    for part in ("1.000 MiB", "3.000 MiB in use", "3.000 MiB reserved", "hard limit 3.000 MiB"):
        assert part in message
    assert isinstance(info.value, MemoryError)
    assert pool.stats().oom_retries >= 1


@pytest.mark.parametrize("cap", [1_000_000, 3 * (1 << 20) + 12_345, 100 << 20])
def test_pool_capped_at_n_bytes_can_allocate_one_n_byte_block(sim, cap):
    pool = gpupool.Pool(upstream=sim, hard_limit=cap)
    small = [pool.allocate(1000) for _ in range(3)]              # leaves memory cached
    del small
    buf = pool.allocate(cap)                 # the cache is released, then an exact block:
    assert buf.nbytes == cap
    # for caps that are not whole 2 MiB pages, rounding the growth to the page (or the
    # request to 512 B) would cross the cap, so the pool asks the upstream for exactly cap
    assert sim.calls_named("alloc")[-1] == (cap,)
    assert pool.stats().reserved_bytes == cap
    del buf
    assert pool.allocate(cap).nbytes == cap  # and again, from the cache or anew
    with pytest.raises(gpupool.OutOfMemoryError):
        pool.allocate(cap + 1)
    check_invariants(pool)


# The simulated device's upstreams: cuMemAlloc's, cuMemAllocAsync's, and expandable segments
# with the driver's 2 MiB page and with a 4 KiB one.
UPSTREAMS = {"driver": {}, "async": {"stream_ordered": True}, "vmm": {"virtual_memory": True},
             "vmm, 4 KiB pages": {"virtual_memory": True, "page": 4096}}


def smallest_reservation(device):
    """Bytes of the least a pool reserves: a page on an expandable upstream, else a block."""
    return device.granularity if device.expandable else 512


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(sorted(UPSTREAMS)), data=st.data())
def test_no_hard_limit_corrupts_the_pool(kind, data):
    """Every limit is either refused at construction (it could hold no block, or no page) or
    keeps the pool consistent, under the limit, and able to allocate the largest block it
    holds (the limit itself; on an expandable upstream, its whole pages)."""
    device = SimulatedDevice(**UPSTREAMS[kind])
    smallest = smallest_reservation(device)
    limit = data.draw(st.integers(1, 3 * smallest + 700) | st.sampled_from(
        [smallest - 1, smallest, smallest + 1, 2 * smallest - 1]), label="limit")
    if limit < smallest:
        with pytest.raises(ValueError, match=rf"^hard_limit={limit}: .* at least {smallest} B"):
            gpupool.Pool(upstream=device, hard_limit=limit)
        return
    pool = gpupool.Pool(upstream=device, hard_limit=limit)
    sizes = data.draw(st.lists(st.integers(0, limit + 600), max_size=6), label="sizes")
    in_region = data.draw(st.booleans(), label="in_region")
    held = []
    with gpupool.Region(pool=pool) if in_region else contextlib.nullcontext():
        for nbytes in sizes:
            try:
                held.append(pool.allocate(nbytes))
            except gpupool.OutOfMemoryError:
                assert nbytes
            assert check_invariants(pool).reserved_bytes <= limit
    del held
    largest = limit // smallest * smallest if device.expandable else limit
    assert pool.allocate(largest).nbytes == largest
    check_invariants(pool)
    assert device.errors == []


@pytest.mark.parametrize("kind", sorted(UPSTREAMS))
def test_a_hard_limit_from_the_environment_below_the_smallest_block_names_the_variable(
        kind, monkeypatch):
    device = SimulatedDevice(**UPSTREAMS[kind])
    monkeypatch.setenv("GPUPOOL_HARD_LIMIT", "100")
    with pytest.raises(ValueError, match=r"^GPUPOOL_HARD_LIMIT='100': the pool reserves memory "
                       rf"in (blocks|pages) of at least .* make it at least "
                       rf"{smallest_reservation(device)} B"):
        gpupool.Pool(upstream=device)


def test_out_of_memory_from_the_device_carries_the_numbers_and_asks_the_upstream_nothing(sim):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    keep = pool.allocate(3 << 20)
    small.calls.clear()
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(2 << 20)
    error = info.value
    assert (error.requested_bytes, error.in_use_bytes, error.reserved_bytes, error.cached_bytes,
            error.limit_bytes) == (2 << 20, 3 << 20, 4 << 20, 1 << 20, None)
    assert error.device_free_bytes is None                          # not asked: no call
    assert error.device_total_bytes == small.total_bytes == 4 << 20     # declared
    assert "mem_info" not in [name for name, _ in small.calls]      # no call made to build it
    message = str(error)
    for part in ("allocating 2.000 MiB (2097152 B)", "3.000 MiB in use", "4.000 MiB reserved",
                 "1.000 MiB cached", "gpupool.on_oom"):
        assert part in message
    # The hint names what reports this pool: pool_status() alone reports a GPU's default pool.
    assert "gpupool.pool_status(pool=...) given this pool shows its upstream's free memory" in \
        message
    assert "gpupool.pool_status()" not in message
    assert "hard limit" not in message
    assert keep.nbytes == 3 << 20
    check_invariants(pool)


def test_out_of_memory_numbers_under_a_hard_limit_and_through_pickle(sim):
    pool = gpupool.Pool(upstream=sim, hard_limit="3MiB")
    with pytest.raises(gpupool.OutOfMemoryError) as info:
        pool.allocate(4 << 20)
    assert info.value.limit_bytes == 3 << 20 and info.value.requested_bytes == 4 << 20
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.limit_bytes == 3 << 20
    plain = gpupool.OutOfMemoryError("a message only")     # as gpupool.torch builds its own
    assert str(plain) == "a message only" and plain.requested_bytes is None
    assert isinstance(plain, MemoryError)


def test_on_oom_callback_runs_and_the_allocation_is_retried(sim):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    held = [pool.allocate(3 << 20)]
    seen = []

    def free_held(nbytes):
        seen.append(nbytes)
        held.clear()

    gpupool.on_oom(free_held)
    try:
        buf = pool.allocate(2 << 20)
    finally:
        gpupool.remove_oom_callback(free_held)
    assert seen == [2 << 20]
    assert buf.nbytes == 2 << 20


def test_a_raising_callback_is_logged_and_the_others_still_free_memory(sim, caplog):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    held = [pool.allocate(3 << 20)]

    def broken(nbytes):
        raise RuntimeError("a broken callback")

    def free_held(nbytes):
        held.clear()

    gpupool.on_oom(broken)
    gpupool.on_oom(free_held)
    try:
        with caplog.at_level(logging.ERROR, logger="gpupool"):
            buf = pool.allocate(2 << 20)            # the second callback frees the memory
    finally:
        gpupool.remove_oom_callback(broken)
        gpupool.remove_oom_callback(free_held)
    assert buf.nbytes == 2 << 20
    [record] = caplog.records
    assert record.name == "gpupool" and "on_oom callback" in record.getMessage()
    assert record.exc_info[0] is RuntimeError


def test_a_raising_callback_does_not_replace_the_out_of_memory_error(sim, caplog):
    small = type(sim)(capacity=4 << 20)
    pool = gpupool.Pool(upstream=small)
    keep = pool.allocate(3 << 20)

    def broken(nbytes):
        raise RuntimeError("a broken callback")

    gpupool.on_oom(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="gpupool"), \
                pytest.raises(gpupool.OutOfMemoryError, match="allocating 2.000 MiB"):
            pool.allocate(2 << 20)
    finally:
        gpupool.remove_oom_callback(broken)
    assert "a broken callback" in caplog.text
    del keep


def test_removing_an_unknown_callback_is_a_clear_error():
    with pytest.raises(ValueError, match="is not an on_oom callback.*gpupool.on_oom"):
        gpupool.remove_oom_callback(print)
    with pytest.raises(TypeError, match="callable"):
        gpupool.on_oom(42)


def test_soft_limit_releases_cached_blocks(sim):
    pool = gpupool.Pool(upstream=sim, soft_limit="2MiB")
    a = pool.allocate(LARGE)
    del a
    b = pool.allocate(2 * LARGE)         # reserved 3 MiB > 2 MiB: the cached 1 MiB goes back
    assert pool.stats().reserved_bytes == 2 * LARGE
    assert b.nbytes == 2 * LARGE


def test_limits_from_the_environment(sim, monkeypatch):
    monkeypatch.setenv("GPUPOOL_HARD_LIMIT", "50%")
    monkeypatch.setenv("GPUPOOL_SOFT_LIMIT", "256MB")
    pool = gpupool.Pool(upstream=sim)
    assert pool.hard_limit == sim.capacity // 2
    assert pool.soft_limit == 256 * 10**6
