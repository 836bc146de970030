"""Reading another library's CUDA Array Interface, checked: every field that gpupool uses is
validated before it is used, so a malformed export is a clear ``TypeError``/``ValueError``
naming the field, never a crash. Follows the CUDA Array Interface v3 specification
(https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html)."""

from dataclasses import dataclass

import numpy as np

__all__ = ["ArrayInterface", "read_cai"]


@dataclass(frozen=True)
class ArrayInterface:
    """The fields of a ``__cuda_array_interface__`` that gpupool uses.

    ptr: device pointer (int, >= 0; 0 for an array of no elements, whatever the exporter
    gave); readonly: bool; shape: tuple of extents (>= 0); itemsize: bytes per element;
    strides: tuple of byte strides, or None (C-contiguous); stream: the producer's stream
    handle (1: the legacy default stream, 2: the per-thread one), or None (no ordering
    needed).
    """

    ptr: int
    readonly: bool
    shape: tuple
    itemsize: int
    strides: tuple | None
    stream: int | None

    @property
    def nbytes(self):
        """Bytes the elements span (itemsize x number of elements)."""
        n = self.itemsize
        for extent in self.shape:
            n *= extent
        return n

    @property
    def c_contiguous(self):
        """Whether the elements are laid out C-contiguously (no strides, or matching ones)."""
        if self.strides is None:
            return True
        expected = self.itemsize
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent > 1 and stride != expected:
                return False
            expected *= extent
        return True


def _ints(value, field, minimum=None):
    if not isinstance(value, tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"__cuda_array_interface__[{field!r}] must be a tuple of ints, "
                        f"got {value!r}")
    if minimum is not None and any(v < minimum for v in value):
        raise ValueError(f"__cuda_array_interface__[{field!r}] has a value below {minimum}: "
                         f"{value!r}")
    return value


def read_cai(obj):
    """The checked CUDA Array Interface of ``obj``, or None when it exports none.

    Raises
    ------
    TypeError, ValueError
        The export is not a dict, or a field (``data``, ``shape``, ``typestr``, ``strides``,
        ``stream``) is missing or malformed (a ``stream`` of 0 included, which v3 forbids);
        the message names the field.

    Notes
    -----
    The data pointer of an array of no elements is not read (v3 asks for 0 there, and some
    exporters give anything): ``ptr`` is 0.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if not isinstance(cai, dict):
        raise TypeError(f"__cuda_array_interface__ must be a dict, got {type(cai).__name__}")
    for field in ("data", "shape", "typestr"):
        if field not in cai:
            raise ValueError(f"__cuda_array_interface__ has no {field!r} field")
    data = cai["data"]
    if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], int)
            and not isinstance(data[0], bool) and isinstance(data[1], bool)):
        raise TypeError(f"__cuda_array_interface__['data'] must be (pointer: int, readonly: "
                        f"bool), got {data!r}")
    if cai.get("mask") is not None:
        raise ValueError("__cuda_array_interface__ has a 'mask': masked arrays are not "
                         "supported")
    shape = _ints(cai["shape"], "shape", minimum=0)
    if any(extent >= 1 << 63 for extent in shape):
        raise ValueError(f"__cuda_array_interface__['shape'] has an absurd extent: {shape!r}")
    try:
        itemsize = np.dtype(cai["typestr"]).itemsize
    except TypeError as exc:
        raise TypeError(f"__cuda_array_interface__['typestr'] {cai['typestr']!r} is not a "
                        f"type string") from exc
    strides = cai.get("strides")
    if strides is not None:
        strides = _ints(strides, "strides")
        if len(strides) != len(shape):
            raise ValueError(f"__cuda_array_interface__['strides'] {strides!r} does not match "
                             f"shape {shape!r}")
    stream = cai.get("stream")
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)
                               or stream < 0):
        raise TypeError(f"__cuda_array_interface__['stream'] must be None or a stream handle "
                        f"(int >= 0), got {stream!r}")
    if stream == 0:
        raise ValueError("__cuda_array_interface__['stream'] is 0, which the CUDA Array "
                         "Interface v3 forbids (ambiguous): 1 names the legacy default stream, "
                         "2 the per-thread one, None no synchronization")
    ptr = 0
    if 0 not in shape:
        ptr = data[0]
        if not 0 <= ptr < 1 << 64:
            raise ValueError(f"__cuda_array_interface__['data'] has a pointer outside "
                             f"0..2**64-1: {data!r}")
        if ptr == 0:
            raise ValueError("__cuda_array_interface__['data'] is a null pointer for a "
                             "non-empty array")
    array = ArrayInterface(ptr, data[1], shape, itemsize, strides, stream)
    if array.nbytes >= 1 << 63:
        raise ValueError(f"__cuda_array_interface__['shape'] {shape!r} spans more bytes than "
                         f"any device holds")
    return array
