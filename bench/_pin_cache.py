"""The pin-until-step-end cache of bench/region_memory.py: a reference caching allocator for
CuPy that reuses a freed block only after the step ends (the failure mode a region avoids:
reserved memory becomes the sum of the step's allocations instead of its working set)."""


class _PinnedBlock:
    """Owner of one block lent to CuPy; when CuPy drops it, the block goes to pending."""

    __slots__ = ("cache", "size", "mem")

    def __init__(self, cache, size, mem):
        self.cache, self.size, self.mem = cache, size, mem

    def __del__(self):
        self.cache._returned(self.size, self.mem)


class PinUntilStepEnd:
    """A caching allocator for CuPy that reuses a freed block only after the step ends.

    Blocks come from ``cupy.cuda.memory.Memory`` (``cudaMalloc``) and are never given back
    while the cache is open. A block CuPy frees during a step is pending; ``end_step()`` makes
    the pending blocks reusable. So within a step no block is used twice, and the memory
    reserved is the sum of the step's allocations, not its working set.

    Parameters
    ----------
    cupy : module
        CuPy (or a stand-in with ``cuda.MemoryPointer``, ``cuda.UnownedMemory`` and
        ``cuda.memory.Memory``).
    device : int
        The device the memory is on (given to ``UnownedMemory``).
    granularity : int
        Requests are rounded up to a multiple of it (bytes), as CuPy's pool does (512).

    Notes
    -----
    ``malloc`` is the allocator (for ``cupy.cuda.using_allocator``). Counters, bytes:
    ``reserved_bytes`` (raw allocations held), ``in_use_bytes`` (lent and not yet freed by
    CuPy), ``pending_bytes``, ``peak_in_use_bytes`` (since ``reset_peak()``). One stream only:
    a block is reused on the stream it was used on, after the step synchronized.
    """

    def __init__(self, cupy, device=0, granularity=512):
        self._pointer = cupy.cuda.MemoryPointer
        self._unowned = cupy.cuda.UnownedMemory
        self._raw = cupy.cuda.memory.Memory
        self.device = device
        self.granularity = granularity
        self._free = {}              # size -> [Memory]
        self._pending = []           # [(size, Memory)] freed during the current step
        self._closed = False
        self.reserved_bytes = 0
        self.lent_bytes = 0          # cumulative; written by malloc only
        self.returned_bytes = 0      # cumulative; written by _returned only (a __del__)
        self.peak_in_use_bytes = 0
        self.hits = self.misses = 0

    @property
    def in_use_bytes(self):
        return self.lent_bytes - self.returned_bytes

    @property
    def pending_bytes(self):
        return sum(size for size, _ in self._pending)

    def malloc(self, nbytes):
        """A ``cupy.cuda.MemoryPointer`` to ``nbytes`` of device memory."""
        if nbytes == 0:
            return self._pointer(self._raw(0), 0)
        size = -(-nbytes // self.granularity) * self.granularity
        blocks = self._free.get(size)
        if blocks:
            mem = blocks.pop()
            self.hits += 1
        else:
            mem = self._raw(size)
            self.reserved_bytes += size
            self.misses += 1
        self.lent_bytes += size
        if self.in_use_bytes > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self.in_use_bytes
        owner = _PinnedBlock(self, size, mem)
        return self._pointer(self._unowned(mem.ptr, nbytes, owner, self.device), 0)

    def _returned(self, size, mem):
        self.returned_bytes += size
        if self._closed:
            self.reserved_bytes -= size        # mem is dropped: cudaFree
        else:
            self._pending.append((size, mem))

    def end_step(self):
        """The step is over (its stream synchronized): pending blocks become reusable."""
        pending, self._pending = self._pending, []
        for size, mem in pending:
            self._free.setdefault(size, []).append(mem)

    def reset_peak(self):
        self.peak_in_use_bytes = self.in_use_bytes

    def close(self):
        """Give every block not lent back to the driver; lent ones go when CuPy frees them."""
        self._closed = True
        self.end_step()
        for blocks in self._free.values():
            self.reserved_bytes -= sum(mem.size for mem in blocks)
        self._free.clear()
