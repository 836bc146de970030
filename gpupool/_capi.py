"""The C API capsule's module: ``gpupool._capi._C_API`` is the name the header imports
(include/gpupool.h, GPUPOOL_CAPSULE); the table is made in ``gpupool.c_api.table``."""
from gpupool.c_api.table import _C_API  # noqa: F401
