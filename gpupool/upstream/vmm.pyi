from gpupool.upstream.driver import DriverUpstream

class VmmUpstream(DriverUpstream):
    granularity: int
    va_bytes: int
    expandable: bool
    shareable: bool
    def __init__(self, device: int = 0, *, shareable: bool = True) -> None: ...
    @property
    def mapped_bytes(self) -> int: ...
