"""A seeded loop of pool operations on the simulated device while every kind of driver call the
pool makes fails at a rate (``gpupool.testing.Failures``), on each kind of upstream: plain,
stream-ordered, virtual memory, and shareable (IPC export). It counts the failures the device
actually injected (at least 1,000 in all, every kind of call among them) and after every
operation checks that the pool is consistent (``Pool._verify()``), that no byte is lost (in
use plus cached equals reserved, reserved equals the device's bytes), that the device saw no
misuse, and that what raised is the right exception: a ``CudaError`` injected during that
operation, or ``OutOfMemoryError`` from an allocation. See Note [Failure injection] in
docs/design.md.
"""

import collections
import gc
import random

import pytest

import gpupool
from gpupool.testing import Failures, SimulatedDevice

# A trim whose free, unmap or synchronize is refused warns (Pool.trim): here they are the point.
pytestmark = pytest.mark.filterwarnings("ignore:Pool.trim on device:RuntimeWarning")

MIB = 1 << 20
SIZES = [1, 512, 4097, 70_000, 300_000, MIB, 3 * MIB, 12 * MIB]
DEVICE_WORK = ("event_create", "event_destroy", "event_record", "event_query",
               "stream_wait_event", "synchronize", "stream_id", "trim", "mem_info", "copy",
               "memset")
PLAIN = ("alloc", "free") + DEVICE_WORK
VMM = ("reserve", "unreserve", "create", "map", "set_access", "unmap") + DEVICE_WORK
SHARED = PLAIN + ("ipc_export", "ipc_event_create", "ipc_event_record")
DEVICES = {                     # name: (SimulatedDevice arguments, calls that may fail)
    "plain": ({}, PLAIN),
    "stream_ordered": ({"stream_ordered": True}, PLAIN),
    "virtual_memory": ({"virtual_memory": True, "page": 64 << 10}, VMM),
    "shareable": ({"shareable": True}, SHARED),
}
STEPS = 4000
RATE = 0.15


class Loop:
    """One pool on one simulated device with failures injected, driven by a seeded random
    choice of operations."""

    def __init__(self, kind, seed):
        self.arguments, self.names = DEVICES[kind]
        self.failures = Failures(self.names, rate=RATE, seed=seed)
        self.new_device()
        self.live = []
        self.random = random.Random(seed)
        self.outcomes = collections.Counter()

    def new_device(self):
        """A new simulated device (failing as before) and a pool on it."""
        self.sim = SimulatedDevice(capacity=48 * MIB, failures=self.failures, **self.arguments)
        self.streams = [0, 2] + [self.sim.create_stream() for _ in range(2)]
        self.lost = 0           # bytes that ended pools failed to give back (still the device's)
        self.pool = gpupool.Pool(upstream=self.sim)
        self.region = gpupool.Region(pool=self.pool)

    def stream(self):
        return self.random.choice(self.streams)

    def allocate(self):
        self.live.append(self.pool.allocate(self.random.choice(SIZES), stream=self.stream()))

    def free(self):
        if self.live:
            self.live.pop(self.random.randrange(len(self.live))).close()

    def record_stream(self):
        if self.live:
            self.random.choice(self.live).record_stream(self.stream())

    def work(self):
        if self.random.random() < 0.5:
            self.sim.launch(self.stream())
        else:
            self.sim.complete(self.stream())

    def region_step(self):
        with self.region:
            bufs = [self.pool.allocate(self.random.choice(SIZES[:5]))
                    for _ in range(self.random.randrange(4))]
            if bufs and self.random.random() < 0.3:
                self.live.append(bufs.pop())

    def copies(self):
        if self.live:
            buf = self.random.choice(self.live)
            buf.memset(7, stream=self.stream())
            buf.copy_to_host()

    def share(self):
        if self.live and self.sim.shareable:
            self.random.choice(self.live).ipc_handle()

    def trim(self):
        self.pool.trim()

    def merge_streams(self):
        self.pool.merge_streams()

    def release_region(self):
        self.region.release()

    def mem_info(self):
        self.pool.mem_info()

    def renew(self):
        """The pool's end, its work done, and a new pool on the device (on a new device once
        8 MiB are lost). What the end fails to give back (a failed free or unmap) stays on
        the device, and only that."""
        self.sim.complete()
        while self.live:
            self.live.pop().close()
        reserved = self.pool.stats().reserved_bytes
        before = len(self.failures.injected)
        self.pool = self.region = None
        gc.collect()
        lost = self.sim.used - self.lost
        failed = {name for name, _, _ in self.failures.injected[before:]}
        assert lost <= reserved and (lost == 0 or failed & {"free", "unmap"}), (lost, failed)
        self.lost += lost
        if self.lost > 8 * MIB:
            self.new_device()
        else:
            self.pool = gpupool.Pool(upstream=self.sim)
            self.region = gpupool.Region(pool=self.pool)

    OPERATIONS = (allocate, allocate, allocate, free, free, record_stream, work, work,
                  region_step, copies, share, trim, merge_streams, release_region, mem_info)
    RARE = (renew,)             # one step in a hundred

    def step(self):
        if self.random.random() < 0.01:
            operation = self.random.choice(self.RARE)
        else:
            operation = self.random.choice(self.OPERATIONS)
        before = len(self.failures.injected)
        try:
            operation(self)
        except gpupool.OutOfMemoryError:
            assert operation in (Loop.allocate, Loop.region_step), operation.__name__
            self.outcomes["OutOfMemoryError"] += 1
        except gpupool.CudaError as exc:
            injected = [message for _, _, message in self.failures.injected[before:]]
            assert exc.message in injected, (
                f"{operation.__name__} raised {exc!r}, not one of the failures injected "
                f"during it: {injected}")
            self.outcomes["CudaError"] += 1
        else:
            self.outcomes["done"] += 1
        self.check(operation.__name__)

    def check(self, after):
        assert self.pool._verify() == [], after
        stats = self.pool.stats()
        assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes, after
        assert stats.reserved_bytes == self.sim.used - self.lost, after
        assert self.sim.errors == [], after

    def finish(self):
        """No failures any more: every buffer freed and the cache trimmed, nothing is left on
        the device."""
        self.sim.inject(None)
        self.sim.complete()
        for buf in self.live:
            buf.close()
        self.live.clear()
        self.region.release()
        gc.collect()
        self.pool.trim()
        self.check("the end")
        assert self.pool.stats().in_use_bytes == 0
        assert self.sim.used == self.lost


@pytest.mark.parametrize("kind", sorted(DEVICES))
def test_failures_injected_at_random_leave_the_pool_consistent(kind):
    loop = Loop(kind, seed=20261205)
    for _ in range(STEPS):
        loop.step()
    loop.finish()
    injected = collections.Counter(name for name, _, _ in loop.failures.injected)
    print(f"{kind}: {sum(injected.values())} failures injected: {dict(injected)}; "
          f"{dict(loop.outcomes)}")
    # A quarter of the 1,000 on each of the four devices, every kind of call among them.
    assert sum(injected.values()) >= 250
    assert set(loop.names) - set(injected) == set()
    assert loop.outcomes["done"] > loop.outcomes["CudaError"] > 0
