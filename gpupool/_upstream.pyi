class Upstream:
    device: int

class DriverUpstream(Upstream):
    def __init__(self, device: int = 0) -> None: ...

class PythonUpstream(Upstream):
    def _set_device(self, device: int) -> None: ...
