# Size classes: how free blocks are binned (docs/design.md, "Sizes and fit"); requests are
# rounded to 512 B (_segments.round_request), not to a class.
#
# Multiples of 512 B up to 4 KiB (8 classes), then eight classes per power of two. A free block
# is binned in the largest class it holds (floor_class), so every block of a higher class is
# larger than every block of a lower one: best fit searches class by class.

cdef extern from *:
    """
    #define GP_MAX_NBYTES ((size_t)1 << 50)
    #define GP_SMALL_REQUEST ((size_t)1 << 20)
    """
    int __builtin_clzll(unsigned long long) nogil
    size_t MAX_NBYTES "GP_MAX_NBYTES"      # requests above 1 PiB are refused as absurd
    # A request (and a block) of at most this size is small (PyTorch's small-pool bound): on
    # an expandable segment it is placed against other small blocks (so_take_small).
    size_t SMALL_REQUEST "GP_SMALL_REQUEST"

cdef enum:
    SMALL_STEP = 512            # class granularity up to SMALL_MAX
    SMALL_MAX = 4096
    SMALL_CLASSES = 8           # SMALL_MAX / SMALL_STEP


cdef inline int bit_length(size_t n) noexcept nogil:
    return 64 - __builtin_clzll(n) if n else 0


cdef inline int class_index(size_t nbytes) noexcept nogil:
    """Size-class index of a request of nbytes > 0."""
    cdef int b
    cdef size_t half, step
    if nbytes <= SMALL_MAX:
        return <int>((nbytes + SMALL_STEP - 1) // SMALL_STEP) - 1
    b = bit_length(nbytes - 1)              # 2**(b-1) < nbytes <= 2**b
    half = (<size_t>1) << (b - 1)
    step = half >> 3
    return SMALL_CLASSES + (b - 13) * 8 + <int>((nbytes - half + step - 1) // step) - 1


cdef inline size_t class_size(int cls) noexcept nogil:
    """Bytes of size class cls."""
    cdef int octave, k
    if cls < SMALL_CLASSES:
        return (cls + 1) * SMALL_STEP
    octave = (cls - SMALL_CLASSES) // 8
    k = (cls - SMALL_CLASSES) % 8 + 1
    return ((<size_t>1) << (12 + octave)) + k * ((<size_t>1) << (9 + octave))


cdef inline int floor_class(size_t size) noexcept nogil:
    """The largest size class no larger than size (>= SMALL_STEP)."""
    cdef int cls = class_index(size)
    if class_size(cls) > size:
        cls -= 1
    return cls


cdef inline size_t check_nbytes(object nbytes) except? 0xFFFFFFFFFFFFFFFF:
    """A request's size in bytes as a size_t; TypeError for a non-integer (bool included),
    ValueError for a negative or absurd (> 1 PiB) size."""
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(type(nbytes), "__index__"):
            raise TypeError(f"nbytes must be an integer, got {type(nbytes).__name__}")
        nbytes = nbytes.__index__()
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes > MAX_NBYTES:
        raise ValueError(f"nbytes={nbytes} is larger than any device (limit {MAX_NBYTES} B)")
    return <size_t>nbytes
