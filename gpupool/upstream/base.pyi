IPC_MEM_HANDLE: str
IPC_POSIX_FD: str

class Upstream:
    device: int
    stream_ordered: bool
    host_accessible: bool
    @property
    def ipc_kind(self) -> str | None: ...
    @property
    def ipc_refusal(self) -> str | None: ...
