"""Typed views: a DeviceBuffer's bytes seen as an array of a dtype and shape.

``buf.view(dtype, shape, strides=None)`` returns a :class:`BufferView` that exports the CUDA
Array Interface (v3) and DLPack with that dtype and shape, and keeps the buffer alive, so
array libraries import it directly (``cupy.asarray(view)``, ``torch.from_dlpack(view)``).
"""

import copy
import operator

import numpy as np

from gpupool.buffer.dlpack import TYPE_CODES as _DLPACK_CODES

__all__ = ["BufferView", "no_implicit_array"]
KDL_CPU = 1                     # DLPack's device type of host memory


def _extents(values, what):
    """An int or a sequence of ints (anything with ``__index__``) as a tuple of ints."""
    if hasattr(type(values), "__index__"):
        return (operator.index(values),)
    try:
        if isinstance(values, (str, bytes)):     # iterable, but never extents
            raise TypeError
        return tuple(operator.index(n) for n in values)
    except TypeError:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {values!r}") \
            from None


def no_implicit_array(exporter, copy_advice):
    """Refuse NumPy's implicit conversion (``np.asarray``, ``np.array``) of a DeviceBuffer or
    a view, which would otherwise give a 0-d array of one Python object; as CuPy's arrays do.

    Parameters
    ----------
    exporter : DeviceBuffer or BufferView
    copy_advice : str
        How to copy its bytes to the host (``"buf.copy_to_host()"``).

    Raises
    ------
    TypeError
        Always, with the way to a NumPy array: a copy, or, where the memory is host memory
        (the simulated device), ``np.from_dlpack`` without one.
    """
    text = (f"Implicit conversion of a gpupool.{type(exporter).__name__} to a NumPy array is "
            f"not allowed: copy its bytes to the host with {copy_advice}")
    if exporter.__dlpack_device__()[0] == KDL_CPU:
        text += ", or read its host memory (the simulated device's) with np.from_dlpack(...)"
    raise TypeError(text)


class BufferView:
    """A typed, shaped view of a DeviceBuffer's memory (no copy).

    Parameters
    ----------
    buffer : DeviceBuffer
        The memory; kept alive by the view.
    dtype : numpy dtype or anything ``numpy.dtype`` accepts
        Element type: a boolean, integer, floating or complex type.
    shape : int or tuple of int
        Extents, in elements.
    strides : tuple of int, optional
        Strides in bytes, non-negative multiples of the item size; default C-contiguous.

    Raises
    ------
    TypeError
        A dtype DLPack cannot describe.
    ValueError
        A negative extent or stride, a stride not a multiple of the item size, or a view that
        reaches past the buffer's ``nbytes``.

    Notes
    -----
    Exports go through the buffer: a DLPack consumer's stream counts as a use of its memory
    (see ``DeviceBuffer``). A view of no elements exports data pointer 0, as the CUDA Array
    Interface asks. Pickling pickles the buffer (its bytes, through host memory) with the
    view's dtype, shape and strides; ``copy.copy`` and ``copy.deepcopy`` give a view of the
    same dtype, shape and strides over a device-side copy of the buffer
    (``DeviceBuffer.copy()``).
    """

    def __init__(self, buffer, dtype, shape, strides=None):
        dtype = np.dtype(dtype)
        if dtype.kind not in _DLPACK_CODES or dtype.byteorder == ">":
            raise TypeError(f"a view needs a native boolean or numeric dtype, got {dtype}")
        shape = _extents(shape, "shape")
        if any(n < 0 for n in shape):
            raise ValueError(f"negative extent in shape {shape}")
        if strides is None:
            strides, step = [], dtype.itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= max(n, 1)
            contiguous = True
        else:
            strides = _extents(strides, "strides")
            if len(strides) != len(shape):
                raise ValueError(f"{len(strides)} strides for {len(shape)} dimensions")
            if any(s < 0 or s % dtype.itemsize for s in strides):
                raise ValueError(f"strides {strides} must be non-negative multiples of "
                                 f"the item size {dtype.itemsize}")
            contiguous = False
        extent = 0 if 0 in shape else dtype.itemsize + sum(
            (n - 1) * s for n, s in zip(shape, strides, strict=True))
        if extent > buffer.nbytes:
            raise ValueError(f"a view of {extent} bytes does not fit in a buffer of "
                             f"{buffer.nbytes}")
        self.buffer = buffer
        self.dtype = dtype
        self.shape = shape
        self.strides = None if contiguous else tuple(strides)
        self._element_strides = None if contiguous else tuple(
            s // dtype.itemsize for s in strides)

    @property
    def nbytes(self):
        """Bytes of the elements (item size times the number of elements)."""
        return self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))

    @property
    def __cuda_array_interface__(self):
        """CUDA Array Interface v3 with the view's dtype, shape and strides (bytes); data
        pointer 0 when the view has no elements."""
        cai = dict(self.buffer.__cuda_array_interface__, shape=self.shape,
                   typestr=self.dtype.str, strides=self.strides)
        if 0 in self.shape:
            cai["data"] = (0, False)
        return cai

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack export with the view's dtype and shape; see ``DeviceBuffer.__dlpack__``."""
        return self.buffer._export(
            self, _DLPACK_CODES[self.dtype.kind], self.dtype.itemsize * 8, self.shape,
            self._element_strides, stream=stream, max_version=max_version,
            dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self.buffer.__dlpack_device__()

    def __array__(self, dtype=None, copy=None):
        """Refused (TypeError, see no_implicit_array)."""
        no_implicit_array(self, "view.buffer.copy_to_host()")

    def __reduce__(self):
        return BufferView, (self.buffer, self.dtype, self.shape, self.strides)

    def __copy__(self):
        return BufferView(self.buffer.copy(), self.dtype, self.shape, self.strides)

    def __deepcopy__(self, memo):
        return BufferView(copy.deepcopy(self.buffer, memo), self.dtype, self.shape,
                          self.strides)

    def __repr__(self):
        return f"<gpupool.BufferView dtype={self.dtype} shape={self.shape} of {self.buffer!r}>"
