"""A Hypothesis state machine drives the pool on the simulated device.

Random allocations and frees on several streams, simulated work and its completion,
record_stream, regions entered and left, trims and stream merges. After every step: no two
live buffers overlap, in-use plus cached equals reserved, and no block was handed to another stream
unless the work queued on its earlier streams before its free had completed or the new stream
waits for it (an event it waits on covers that work). A second machine runs the same rules
over a stream-ordered upstream (as the "async" one), where memory also exists for a stream
only behind its allocation on the stream that allocated it.
"""

from conftest import Worker
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import gpupool
from gpupool.testing import SimulatedDevice

SIZES = st.sampled_from([1, 200, 512, 1000, 4097, 70_000, 262_144, 300_000, 1 << 20, 3 << 20,
                         12 << 20])


class PoolMachine(RuleBasedStateMachine):
    stream_ordered = False

    def __init__(self):
        super().__init__()
        self.sim = SimulatedDevice(capacity=128 << 20, stream_ordered=self.stream_ordered)
        self.pool = gpupool.Pool(upstream=self.sim)
        self.region = gpupool.Region(pool=self.pool)
        self.streams = [0] + [self.sim.create_stream() for _ in range(2)]
        self.live = []            # (buffer, streams it was used on)
        self.freed = []           # (ptr, size, [(stream, work queued on it at the free)])
        self.max_in_use = 0       # the most bytes in use seen after an allocation

    @rule(size=SIZES, which=st.integers(0, 2))
    def allocate(self, size, which):
        stream = self.streams[which]
        try:
            buf = self.pool.allocate(size, stream=stream)
        except gpupool.OutOfMemoryError:
            return
        self._check_handoff(buf, stream)
        self.live.append((buf, {stream}))
        self._allocated()

    def _allocated(self):
        # Bytes in use rise only at allocations: their most, seen after each, is the peak.
        self.max_in_use = max(self.max_in_use, self.pool.stats().in_use_bytes)

    def _check_handoff(self, buf, stream):
        size = gpupool.size_class(buf.nbytes)
        for base, (alloc_stream, work) in self.sim.allocated_on.items():
            if base <= buf.ptr < base + self.sim._arrays[base][1] and alloc_stream != stream:
                assert self.sim.ordered(stream, alloc_stream, work), (
                    f"memory at {buf.ptr:#x}, allocated in stream {alloc_stream:#x}'s order, "
                    f"went to stream {stream:#x} before that allocation")
        for ptr, old_size, pending in self.freed:
            if ptr < buf.ptr + size and buf.ptr < ptr + old_size:
                for old_stream, queued in pending:
                    if old_stream != stream:
                        assert self.sim.ordered(stream, old_stream, queued), (
                            f"block {ptr:#x} went to stream {stream:#x} before the work "
                            f"queued on stream {old_stream:#x} before its free")
        # The new buffer's span is now checked; the rest of a freed block it was cut from
        # still needs its old streams' work ordered before another stream's use.
        kept = []
        for ptr, old_size, pending in self.freed:
            end = ptr + old_size
            if not (ptr < buf.ptr + size and buf.ptr < end):
                kept.append((ptr, old_size, pending))
                continue
            if ptr < buf.ptr:
                kept.append((ptr, buf.ptr - ptr, pending))
            if buf.ptr + size < end:
                kept.append((buf.ptr + size, end - buf.ptr - size, pending))
        self.freed = kept

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        buf, streams = self.live.pop(index % len(self.live))
        pending = [(s, self.sim._queued[s]) for s in streams]
        self.freed.append((buf.ptr, gpupool.size_class(buf.nbytes), pending))
        buf.close()

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), which=st.integers(0, 2))
    def record_stream(self, index, which):
        buf, streams = self.live[index % len(self.live)]
        buf.record_stream(self.streams[which])
        streams.add(self.streams[which])

    @rule(which=st.integers(0, 2))
    def launch(self, which):
        self.sim.launch(self.streams[which])

    @rule(which=st.integers(0, 2))
    def complete(self, which):
        self.sim.complete(self.streams[which])

    @rule()
    def trim(self):
        self.pool.trim()

    @rule()
    def merge_streams(self):
        self.pool.merge_streams()

    @rule(sizes=st.lists(SIZES, max_size=4), keep=st.booleans())
    def region_step(self, sizes, keep):
        with self.region:
            self._step(sizes, keep)

    def _step(self, sizes, keep):
        bufs = []
        for size in sizes:
            try:
                buf = self.pool.allocate(size)
            except gpupool.OutOfMemoryError:
                break
            self._check_handoff(buf, 0)
            self._allocated()
            bufs.append(buf)
        if keep and bufs:
            self.live.append((bufs.pop(), {0}))
        for buf in bufs:                       # they die when this returns
            self.freed.append((buf.ptr, gpupool.size_class(buf.nbytes),
                               [(0, self.sim._queued[0])]))

    @rule()
    def release_region(self):
        self.region.release()

    @rule()
    def reset_peak(self):
        self.pool.reset_peak_stats()
        self.max_in_use = self.pool.stats().in_use_bytes

    @invariant()
    def peak_is_exact(self):
        assert self.pool.stats().peak_in_use_bytes == self.max_in_use

    @invariant()
    def no_overlap(self):
        spans = sorted((b.ptr, b.ptr + gpupool.size_class(b.nbytes)) for b, _ in self.live)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start

    @invariant()
    def bytes_add_up(self):
        assert self.pool._verify() == []         # segments, free lists, region tags, counters
        stats = self.pool.stats()
        assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes
        # A block is its request's size class (a piece cut to it), or a cached block of at
        # most 1.5x that the pool used whole rather than growing.
        classes = sum(gpupool.size_class(b.nbytes) for b, _ in self.live)
        assert classes <= stats.in_use_bytes <= 1.5 * classes
        assert stats.reserved_bytes == self.sim.used


class OrderedPoolMachine(PoolMachine):
    stream_ordered = True


class ThreadedPoolMachine(PoolMachine):
    """The same rules and invariants, with allocations, frees and region steps made on three
    worker threads as well (each with its magazine), and workers that exit and are replaced
    (their magazines left to the pool)."""

    def __init__(self):
        super().__init__()
        self.workers = [Worker() for _ in range(3)]

    def teardown(self):
        for worker in self.workers:
            worker.exit()

    @rule(size=SIZES, which=st.integers(0, 2), worker=st.integers(0, 2))
    def allocate_on(self, size, which, worker):
        stream = self.streams[which]
        try:
            buf = self.workers[worker](self.pool.allocate, size, stream)
        except gpupool.OutOfMemoryError:
            return
        self._check_handoff(buf, stream)
        self.live.append((buf, {stream}))
        self._allocated()

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), worker=st.integers(0, 2))
    def free_on(self, index, worker):
        buf, streams = self.live.pop(index % len(self.live))
        pending = [(s, self.sim._queued[s]) for s in streams]
        self.freed.append((buf.ptr, gpupool.size_class(buf.nbytes), pending))
        self.workers[worker](buf.close)

    @rule(sizes=st.lists(SIZES, max_size=4), keep=st.booleans(), worker=st.integers(0, 2))
    def region_step_on(self, sizes, keep, worker):
        self.workers[worker](self.region_step, sizes, keep)

    @rule(worker=st.integers(0, 2))
    def exit_worker(self, worker):
        self.workers[worker].exit()
        self.workers[worker] = Worker()


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
OrderedPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestPool = PoolMachine.TestCase
TestPoolOnStreamOrderedUpstream = OrderedPoolMachine.TestCase
ThreadedPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestPoolWithThreads = ThreadedPoolMachine.TestCase
