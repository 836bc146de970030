from gpupool.upstream.driver_ipc import DriverIpc

class DriverUpstream(DriverIpc):
    def __init__(self, device: int = 0) -> None: ...
