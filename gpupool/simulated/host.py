"""Host memory mappings for the simulated device: libc's mmap, munmap and madvise through
ctypes, for address space reserved without memory behind it and for memory files mapped
shared."""

import ctypes
import mmap
import os

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
MAP_FIXED = 0x10
MADV_DONTNEED = 4
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FAILED = ctypes.c_void_p(-1).value

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def map_rw(address, length, flags, fd=-1):
    """libc mmap, readable and writable; raises OSError when it fails."""
    va = libc.mmap(address, length, PROT_RW, flags, fd, 0)
    if va in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"simulated device: mmap of {length} B: {os.strerror(err)}")
    return va
