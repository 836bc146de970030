"""Per-thread magazines and sizes, on the simulated device: a thread cycling through small
and large sizes on one expandable segment keeps hitting its magazine; a small request grows
the pool rather than break a held block many times its size, unless the device is out of
memory (Note [Magazine keeps large blocks for small requests])."""


import pytest
from conftest import check_invariants

import gpupool
from gpupool.testing import SimulatedDevice

MiB = 1 << 20


CYCLE = [256, 4096, 64 << 10, MiB, 16 * MiB]      # bench/threads.py's sizes, in turn


def test_a_thread_cycling_through_small_and_large_sizes_on_one_expandable_segment_hits():
    # Note [Magazine keeps large blocks for small requests]: without it, on an expandable
    # segment (one range per stream) every small request broke the thread's held 16 MiB block,
    # and the next 16 MiB request flushed and joined the small ones again: all requests missed
    # the magazine and took the pool's lock.
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    for _ in range(3):
        for n in CYCLE:
            pool.allocate(n).close()
    before = pool._magazines_info()[0]
    for _ in range(50):
        for n in CYCLE:
            pool.allocate(n).close()
    after = pool._magazines_info()[0]
    assert after["blocks"] == len(CYCLE)
    assert (after["misses"], after["no_block"]) == (before["misses"], before["no_block"])
    stats = check_invariants(pool)
    assert stats.peak_in_use_bytes == 16 * MiB
    assert stats.peak_reserved_bytes <= 16 * MiB + 2 * MiB     # one page more, for the small


def test_a_small_request_grows_the_pool_rather_than_break_a_held_block_8_times_its_size():
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()                                         # held: the segment has no free byte
    small = pool.allocate(MiB)                          # 1/16 of it: a page more
    assert not ptr <= small.ptr < ptr + 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 1
    assert pool.stats().reserved_bytes == 18 * MiB
    small.close()
    check_invariants(pool)
    # A larger request (above 1 MiB) is not small: the held block goes back and is cut.
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True))
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()
    other = pool.allocate(2 * MiB)
    assert other.ptr == ptr and pool.stats().reserved_bytes == 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 0
    other.close()
    check_invariants(pool)


@pytest.mark.parametrize("virtual_memory", [True, False])
def test_out_of_memory_a_small_request_breaks_the_held_block_it_would_leave(virtual_memory):
    sim = SimulatedDevice(capacity=16 * MiB, virtual_memory=virtual_memory)
    pool = gpupool.Pool(upstream=sim)
    big = pool.allocate(16 * MiB)
    ptr = big.ptr
    big.close()
    small = pool.allocate(256)                          # no page left on the device
    assert small.ptr == ptr and pool.stats().reserved_bytes == 16 * MiB
    assert pool._magazines_info()[0]["blocks"] == 0
    small.close()
    check_invariants(pool)
