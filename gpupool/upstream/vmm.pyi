from gpupool.upstream.driver import DriverUpstream

class VmmUpstream(DriverUpstream):
    granularity: int
    va_bytes: int
    expandable: bool
    shareable: bool
    release_refused: int
    def __init__(self, device: int = 0, *, shareable: bool = True) -> None: ...
    @property
    def mapped_bytes(self) -> int: ...
    def _chunks(self, va: int, nbytes: int) -> list[tuple[int, int]]: ...
