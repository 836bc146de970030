"""Planned places cut out of free blocks (core/planned.pxd's pl_take: parked blocks put back
by range, sg_cut_front, a front cut off a block with record_stream events sent online) and a
private pool's allocate_at (the other caller of sg_cut_front), under random steps: several
streams, record_stream uses, parked blocks, every entry checked (Pool._verify, byte counts,
no overlap, and stream order: a buffer's bytes go to another stream only after the work of
every stream that used them, or behind a wait for it)."""

import gc

import pytest
from capi_table import call, private_allocate, private_live, private_new
from conftest import check_invariants
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import gpupool
from gpupool.testing import SimulatedDevice

KIB, MIB = 1024, 1 << 20


class Ordered:
    """Live buffers and the bytes of freed ones with the (stream, work) that last used them:
    every allocation is checked for overlap and for stream order."""

    def __init__(self, pool, sim):
        self.pool, self.sim = pool, sim
        self.live = {}          # key -> (buf, {stream})
        self.ghosts = []        # (lo, hi, stream, work)

    def _check(self, lo, hi, s):
        keep = []
        for g in self.ghosts:
            glo, ghi, t, w = g
            if ghi <= lo or hi <= glo:
                keep.append(g)
                continue
            assert t == s or self.sim.ordered(s, t, w), \
                f"[{lo:#x},{hi:#x}) on {s} while {t}'s work {w} on [{glo:#x},{ghi:#x}) unordered"
            if glo < lo:
                keep.append((glo, lo, t, w))
            if hi < ghi:
                keep.append((hi, ghi, t, w))
        self.ghosts = keep
        spans = sorted((b.ptr, b.ptr + b.nbytes) for b, _ in self.live.values() if b.nbytes)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, "two live blocks share bytes"

    def allocate(self, key, nbytes, stream):
        buf = self.pool.allocate(nbytes, stream)
        self.live[key] = (buf, {stream})
        self._check(buf.ptr, buf.ptr + buf.nbytes, stream)
        self.sim.launch(stream)
        return buf

    def use(self, key, stream):
        buf, streams = self.live[key]
        buf.record_stream(stream)
        streams.add(stream)
        self.sim.launch(stream)

    def drop_all(self):
        """Every live buffer dropped: the pool holds none in use, and the device saw no
        error."""
        self.live.clear()
        gc.collect()
        assert check_invariants(self.pool).in_use_bytes == 0
        assert self.sim.errors == []

    def free(self, key):
        buf, streams = self.live.pop(key)
        lo, hi = buf.ptr, buf.ptr + buf.nbytes
        for t in streams:
            self.ghosts.append((lo, hi, t, self.sim.queued(t)))
        del buf


def entry(data, region, mem, streams, e, sizes, on, frees, tails):
    """Entry ``e`` of a random step under ``region`` through ``mem`` (an Ordered): the tails
    of the entry before freed first, request k of ``sizes[k]`` bytes on stream ``on[k]``
    (a ``tails`` member held into the next entry), drawn record_stream uses, request
    ``frees[k]`` freed after it, drawn stream completions; the rest freed at the end."""
    for key in [k for k in mem.live if k[0] == "tail"]:
        mem.free(key)
    with region:
        for k, nb in enumerate(sizes):
            tag = ("tail", e, k) if k in tails else ("step", e, k)
            mem.allocate(tag, nb, on[k])
            if data.draw(st.integers(0, 3)) == 0:
                mem.use(tag, data.draw(st.sampled_from(streams)))
            j = frees[k]
            if j is not None and ("step", e, j) in mem.live:
                mem.free(("step", e, j))
            if data.draw(st.integers(0, 5)) == 0:
                mem.sim.complete(data.draw(st.sampled_from(streams)))
        for key in [k for k in mem.live if k[0] == "step"]:
            mem.free(key)


def drawn_step(data, virtual_memory, least, most_bytes, most_tails):
    """A planned region on a fresh simulated device with three streams, and a random step
    of ``least`` to 10 requests for :func:`entry`: ``(region, mem, streams, sizes, on,
    frees, tails)``, sizes up to ``most_bytes``, at most ``most_tails`` tails."""
    sim = SimulatedDevice(capacity=1 << 32, virtual_memory=virtual_memory)
    pool = gpupool.Pool(upstream=sim)
    streams = [0] + [sim.create_stream() for _ in range(2)]
    region = gpupool.Region(pool=pool, plan=True, collect=None)
    n = data.draw(st.integers(least, 10))
    sizes = data.draw(st.lists(st.integers(1, most_bytes), min_size=n, max_size=n))
    on = data.draw(st.lists(st.sampled_from(streams), min_size=n, max_size=n))
    frees = [data.draw(st.one_of(st.none(), st.integers(0, k))) for k in range(n)]
    tails = set(data.draw(st.lists(st.integers(0, n - 1), max_size=most_tails)))
    return region, Ordered(pool, sim), streams, sizes, on, frees, tails


def planned_run(data):
    region, mem, streams, sizes, on, frees, tails = drawn_step(
        data, data.draw(st.booleans()), 2, 3 * MIB, 3)
    pool = mem.pool
    for e in range(data.draw(st.integers(4, 9))):
        vary = data.draw(st.sampled_from([0, 0, 4096, -4096, 512]))
        entry(data, region, mem, streams, e,
              [max(1, nb + (vary if k % 2 else 0)) for k, nb in enumerate(sizes)], on, frees,
              tails)
        # Outside the region: small frees park blocks (held aside, unjoined).
        for i in range(data.draw(st.integers(0, 3))):
            mem.allocate(("out", e, i), data.draw(st.integers(512, MIB)),
                         data.draw(st.sampled_from(streams)))
        for key in [k for k in mem.live if k[0] == "out"]:
            if data.draw(st.booleans()):
                mem.free(key)
        gc.collect()
        check_invariants(pool)
    mem.drop_all()
    return region.stats()


# Seed 4's examples include a place cut from the front of a block that another stream still
# uses (record_stream): with pl_take's check for it taken out, one of them reuses bytes
# unordered (found by this test at 300 examples, then by seed 4 at 40); with it, none does.
@seed(4)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.data())
def test_random_planned_steps_on_streams_with_record_stream(data):
    planned_run(data)


def verify_private(pool):
    """Pool._verify while a private pool lives (its cache is not registered with the pool:
    the verifier knows its blocks by their cache's held flag) and the byte counts."""
    assert pool._verify() == []
    stats = pool.stats()
    assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes


@pytest.mark.usefixtures("default_pools")
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_private_allocate_at(data):
    sim = SimulatedDevice(capacity=256 * MIB)
    pool = gpupool.Pool(upstream=sim, device=0)
    gpupool.set_pool(pool)
    handle = private_new()
    sizes = data.draw(st.lists(st.integers(1, 40).map(lambda x: x * 4096), min_size=2,
                               max_size=8))
    ptrs = []
    for nb in sizes:
        status, p = private_allocate(handle, nb)
        assert status == 0
        ptrs.append((p, nb))
    for p, _ in ptrs:
        assert call("free_ptr", 0, p) == 0
    verify_private(pool)
    live = {}
    for _ in range(data.draw(st.integers(1, 12))):
        if live and data.draw(st.booleans()):
            p = data.draw(st.sampled_from(sorted(live)))
            del live[p]
            assert call("free_ptr", 0, p) == 0
        else:
            base, nb = data.draw(st.sampled_from(ptrs))
            off = data.draw(st.integers(0, nb // 512 - 1)) * 512
            size = data.draw(st.integers(1, (nb - off) // 512)) * 512
            if data.draw(st.integers(0, 5)) == 0:
                off += 256                              # not 512s: refused, nothing lost
            ptr = base + off
            free_there = all(ptr + size <= q or q + n <= ptr for q, n in live.items())
            r = call("private_allocate_at", handle, ptr, size, 0)
            if off % 512 == 0 and free_there:
                assert r == 0, (hex(ptr), size)
                live[ptr] = size
            else:
                assert r != 0
        assert sorted(private_live(handle)) == sorted(live.items())
        verify_private(pool)
    for p in live:
        call("free_ptr", 0, p)
    call("private_destroy", handle)
    assert check_invariants(pool).in_use_bytes == 0 and sim.errors == []
