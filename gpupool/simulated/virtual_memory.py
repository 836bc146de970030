"""Simulated virtual memory (``SimulatedDevice(virtual_memory=True)``): ranges of host address
space reserved as the driver reserves device address space, and chunks mapped into them, as
``gpupool.VmmUpstream`` maps device memory: a page each (``_map``) or one physical allocation
of many pages (``_map_chunk``, a tagged segment's), which an unmap takes only whole (the
driver's ``cuMemUnmap`` cannot unmap part of a mapping)."""

import mmap

from gpupool.simulated.base import SimulatedBase
from gpupool.simulated.host import MADV_DONTNEED, MAP_FAILED, MAP_NORESERVE, libc


class SimulatedVirtualMemory(SimulatedBase):
    """The address ranges of a ``SimulatedDevice`` and the chunks mapped in them: the
    upstream's ``_reserve``, ``_unreserve``, ``_map``, ``_map_chunk`` and ``_unmap``. With
    ``shareable`` the pages are memory files (``_share_pages``, ``_unshare_pages`` of the
    sharing part)."""

    def _init_virtual_memory(self):
        self._ranges = {}               # reserved start -> (bytes, set of mapped page starts)
        self._mapped_chunks = {}        # mapped chunk's start -> bytes (one allocation each)
        self.chunks_made = 0            # physical allocations (cuMemCreate) so far
        self.chunks_released = 0        # and given back (cuMemRelease)

    def _reserve(self):
        size = self.va_bytes
        self._called("reserve", (size,))
        va = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                       mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if va in (None, MAP_FAILED):
            raise MemoryError("simulated device: no host address space for a reservation")
        self._ranges[va] = (size, set())
        return va

    def _unreserve(self, va):
        self._called("unreserve", (va,))
        if va not in self._ranges:
            self._misuse(f"unreserve of unknown range {va:#x}")
        size, mapped = self._ranges[va]
        if mapped:
            self._misuse(f"unreserve of range {va:#x} with {len(mapped)} pages still mapped")
        libc.munmap(va, size)
        del self._ranges[va]

    def _pages(self, va, nbytes, what):
        """The range holding [va, va + nbytes) and the page starts in it."""
        for start, (size, mapped) in self._ranges.items():
            if start <= va and va + nbytes <= start + size:
                if (va - start) % self.page or nbytes % self.page or nbytes == 0:
                    self._misuse(f"{what} of {nbytes} B at {va:#x}: not whole pages")
                return mapped, range(va, va + nbytes, self.page)
        self._misuse(f"{what} of {nbytes} B at {va:#x}: outside every range")

    def _map(self, va, nbytes):
        self._map_as("map", va, nbytes, self.page)

    def _map_chunk(self, va, nbytes):
        self._map_as("map_chunk", va, nbytes, nbytes)

    def _map_as(self, name, va, nbytes, chunk):
        """Map [va, va + nbytes) as chunks of ``chunk`` bytes (each its own allocation). A
        map_chunk fails where a map would (``Failures("map")`` and its steps)."""
        self.calls.append((name, (va, nbytes)))
        for step in ("create", "map", "set_access"):   # cuMemCreate, cuMemMap, cuMemSetAccess
            self._fail(step, (va, nbytes))
        mapped, pages = self._pages(va, nbytes, name)
        if any(p in mapped for p in pages):
            self._misuse(f"map of {nbytes} B at {va:#x}: a page is mapped already")
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"simulated device out of memory: {nbytes} B to map")
        if self.shareable:
            self._share_pages(pages)
        mapped.update(pages)
        for start in range(va, va + nbytes, chunk):
            self._mapped_chunks[start] = chunk
        self.chunks_made += nbytes // chunk
        self._count(nbytes, nbytes)

    def _unmap(self, va, nbytes):
        self._called("unmap", (va, nbytes))
        mapped, pages = self._pages(va, nbytes, "unmap")
        if not all(p in mapped for p in pages):
            self._misuse(f"unmap of {nbytes} B at {va:#x}: a page is not mapped")
        starts, p = [], va
        while p < va + nbytes and p in self._mapped_chunks:
            starts.append(p)
            p += self._mapped_chunks[p]
        if p != va + nbytes:
            self._misuse(f"unmap of {nbytes} B at {va:#x}: part of a chunk (cuMemUnmap "
                         f"unmaps only whole mappings)")
        busy = self._busy_streams()
        if busy:
            self._misuse(f"unmap of {nbytes} B at {va:#x} while streams {busy} have work "
                         f"pending that may use it")
        mapped.difference_update(pages)
        for start in starts:
            del self._mapped_chunks[start]
        self.chunks_released += len(starts)
        if self.shareable:
            self._unshare_pages(va, nbytes, pages)
        else:
            libc.madvise(va, nbytes, MADV_DONTNEED)        # the host memory goes back too
        self._count(-nbytes, -nbytes)

    def _chunks(self, va, nbytes):
        """The chunks mapped in [va, va + nbytes) or across its ends: ``(start, bytes)`` by
        address (the upstream's ``_chunks``, for the pool's consistency check)."""
        return sorted((start, n) for start, n in self._mapped_chunks.items()
                      if start < va + nbytes and start + n > va)

    def mapped(self, va, nbytes=1):
        """Whether [va, va + nbytes) lies in mapped pages (virtual_memory=True)."""
        for start, (size, pages) in self._ranges.items():
            if start <= va < start + size:
                first = start + (va - start) // self.page * self.page   # pages from start
                return all(p in pages for p in range(first, va + nbytes, self.page))
        return False

    def _check_mapped(self, ptr, nbytes, what):
        if self._ranges and any(start <= ptr < start + size
                                for start, (size, _) in self._ranges.items()) \
                and not self.mapped(ptr, nbytes):
            self._misuse(f"{what} of {nbytes} B at {ptr:#x}: memory not mapped")
