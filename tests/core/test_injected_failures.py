"""The pool's state machines of test_state_machine.py and test_vmm.py with driver failures
injected into the simulated device (``gpupool.testing.Failures``): every kind of call the pool
makes fails at a rate and seed Hypothesis draws. After every step, besides those machines'
checks (bookkeeping by ``Pool._verify()``, in use plus cached equals reserved, reserved equals
the device's bytes, no block handed to a stream before the work on it is ordered before that
stream's): the simulated device saw no misuse, and an operation that raised raised the
failure injected during it (a ``CudaError`` of one of its calls), or ``OutOfMemoryError``
for an allocation; never an injected ``MemoryError`` itself, a stale error, or another
exception. See Note [Failure injection] in docs/design.md.
"""

import gc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_state_machine import SIZES, OrderedPoolMachine, PoolMachine
from test_vmm import VmmStreamsPoolMachine

import gpupool
from gpupool.testing import Failures

# A trim whose free, unmap or synchronize is refused warns (Pool.trim): here they are the point.
pytestmark = pytest.mark.filterwarnings("ignore:Pool.trim on device:RuntimeWarning")

# The calls the pool makes on a plain upstream, and on an expandable one.
PLAIN_CALLS = ("alloc", "free", "event_create", "event_destroy", "event_record", "event_query",
               "stream_wait_event", "synchronize", "stream_capturing", "stream_id", "trim")
VMM_CALLS = PLAIN_CALLS + ("reserve", "unreserve", "create", "map", "set_access", "unmap")
RATES = st.sampled_from([0.02, 0.1, 0.3])


class Injected:
    """The failure-injecting rules and checks, over a pool machine's (a mixin: first in the
    bases)."""

    calls = PLAIN_CALLS
    failures = None

    @initialize(seed=st.integers(0, 2**32 - 1), rate=RATES)
    def inject(self, seed, rate):
        self.failures = self.sim.inject(Failures(self.calls, rate=rate, seed=seed))

    def guarded(self, operation, *args):
        """Run a pool operation; a CudaError it raises must be a failure injected during it."""
        before = len(self.failures.injected)
        try:
            operation(*args)
        except gpupool.CudaError as exc:
            messages = [message for _, _, message in self.failures.injected[before:]]
            assert exc.message in messages, (
                f"{exc!r} is not one of the failures injected during the step: {messages}")

    @rule(size=SIZES, which=st.integers(0, 2))
    def allocate(self, size, which):
        self.guarded(super().allocate, size, which)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), which=st.integers(0, 2))
    def record_stream(self, index, which):
        self.guarded(super().record_stream, index, which)

    @rule()
    def trim(self):
        self.guarded(super().trim)

    @rule()
    def merge_streams(self):
        self.guarded(super().merge_streams)

    @rule(sizes=st.lists(SIZES, max_size=4), keep=st.booleans())
    def region_step(self, sizes, keep):
        self.guarded(super().region_step, sizes, keep)

    @rule()
    def release_region(self):
        self.guarded(super().release_region)

    @rule()
    def heal(self):
        """A step without failures (the device recovers), then failures again."""
        failures, self.sim.failures = self.sim.failures, None
        self.pool.trim()
        self.sim.failures = failures

    @invariant()
    def no_misuse(self):
        assert self.sim.errors == []

    def teardown(self):
        self.sim.inject(None)
        self.live.clear()
        gc.collect()            # buffers in the frames of a caught exception's traceback
        self.pool.trim()
        stats = self.pool.stats()
        assert stats.in_use_bytes == 0
        assert stats.reserved_bytes == self.sim.used
        assert self.pool._verify() == []
        super().teardown()


class FailingPoolMachine(Injected, PoolMachine):
    pass


class FailingOrderedPoolMachine(Injected, OrderedPoolMachine):
    pass


class FailingVmmPoolMachine(Injected, VmmStreamsPoolMachine):
    calls = VMM_CALLS


FailingPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                                deadline=None)
FailingOrderedPoolMachine.TestCase.settings = FailingPoolMachine.TestCase.settings
FailingVmmPoolMachine.TestCase.settings = FailingPoolMachine.TestCase.settings
TestPoolWithFailures = FailingPoolMachine.TestCase
TestPoolOnStreamOrderedUpstreamWithFailures = FailingOrderedPoolMachine.TestCase
TestVmmPoolWithFailures = FailingVmmPoolMachine.TestCase
