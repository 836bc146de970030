"""Which upstream a new pool takes memory from: the ``upstream`` argument of ``Pool``, else
``GPUPOOL_UPSTREAM``, else expandable segments where the device has virtual memory management
(Note [Default upstream] in docs/design.md), else the driver's ``cuMemAlloc``."""
import os

from gpupool.errors import CudaError
from gpupool.upstream.base import Upstream
from gpupool.upstream.driver import DriverUpstream
from gpupool.upstream.mempool import AsyncUpstream
from gpupool.upstream.vmm import VmmUpstream

UPSTREAMS = {"driver": DriverUpstream, "async": AsyncUpstream, "vmm": VmmUpstream}


def default_upstream(device):
    """A ``VmmUpstream`` of ``device`` (int ordinal), or a ``DriverUpstream`` where the device
    has no virtual memory management (the VMM upstream's constructor raises ``CudaError``)."""
    try:
        return VmmUpstream(device)
    except CudaError:
        return DriverUpstream(device)


def make_upstream(device, upstream):
    """The ``Upstream`` object of a pool on ``device`` (int ordinal, checked) for the ``Pool``
    argument ``upstream``: None (``GPUPOOL_UPSTREAM``, else ``default_upstream``), one of the
    names in ``UPSTREAMS`` or an ``Upstream`` object (returned as it is).

    Raises
    ------
    ValueError, TypeError
        A name that is not in ``UPSTREAMS`` (``GPUPOOL_UPSTREAM`` included) or an object that
        is not an ``Upstream``.
    NoDeviceError, CudaError
        The upstream's constructor failed (no driver, no such device).
    """
    if upstream is None:
        upstream = os.environ.get("GPUPOOL_UPSTREAM") or None   # empty: unset
        if upstream is None:
            return default_upstream(device)
        if upstream not in UPSTREAMS:
            raise ValueError(f"GPUPOOL_UPSTREAM={upstream!r}: must be one of "
                             f"{', '.join(UPSTREAMS)}")
    if isinstance(upstream, Upstream):
        return upstream
    if isinstance(upstream, str) and upstream in UPSTREAMS:
        return UPSTREAMS[upstream](device)
    if isinstance(upstream, str):
        raise ValueError(f"upstream must be 'driver', 'async', 'vmm' or an Upstream "
                         f"object, got {upstream!r}")
    raise TypeError(f"upstream must be 'driver', 'async', 'vmm' or an Upstream "
                    f"object, got {type(upstream).__name__}")
