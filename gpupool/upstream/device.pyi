from gpupool.upstream.base import Upstream

class DriverDevice(Upstream):
    def __init__(self, device: int = 0) -> None: ...
