# Private pools: memory held for one user, a CUDA graph's private memory pool (PyTorch's
# beginAllocateToPool / releasePool, through the C API's private_* functions).
#
# A private pool is a region cache (core/regioncache.pxd) of the device's pool that is held
# entered from its making to its end and is not registered with the pool. Its allocations
# take the best fit of its own free blocks and the pool's, as a region's do; once freed they
# stay its own: never lent (it is always entered), never untagged by the out-of-memory ladder
# or Region.release() (they see registered regions only), never given back by a trim (which
# keeps tagged blocks). So the addresses a captured graph baked in are the graph's for as long
# as it lives, and a later capture into the same private pool reuses them. At the end, once
# the device's work on its memory is done, its free blocks go back to the pool and its live
# ones return there when freed. The pool's side of this (taking an address range, the end)
# is core/private.pxd's, reached through Pool.private_allocate_at and Pool.private_end.
from cpython.ref cimport PyObject
from gpupool.core.regioncache cimport RegionCache

cdef struct PrivatePool:
    PyObject* pool          # the Pool it draws from (a reference is held)
    RegionCache* rc         # its blocks: rc.pool is the Pool, rc.entered stays 1
