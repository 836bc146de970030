"""Diagnostic for the GPU machine: which driver queries the pool makes are allowed while a
stream is being captured into a CUDA graph (global capture mode, CuPy's default)?"""
import cupy
from cuda.bindings import driver


def probe(name, call):
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            result = call(s)
        except Exception as exc:  # noqa: BLE001 - reported
            result = repr(exc)
        try:
            s.end_capture()
            capture = "capture ok"
        except Exception as exc:  # noqa: BLE001 - reported
            capture = f"capture broken: {exc}"
    print(f"{name}: {result}; {capture}")


cupy.zeros(1)
probe("cuStreamGetId(capturing stream)", lambda s: driver.cuStreamGetId(s.ptr))
probe("cuStreamIsCapturing", lambda s: driver.cuStreamIsCapturing(s.ptr))
other = cupy.cuda.Stream(non_blocking=True)
probe("cuStreamGetId(other stream)", lambda s: driver.cuStreamGetId(other.ptr))
err, event = driver.cuEventCreate(0)
probe("cuEventQuery(idle event)", lambda s: driver.cuEventQuery(event))
