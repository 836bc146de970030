from collections.abc import Callable
from typing import Any

from gpupool.core.pool import Pool

class CupyAllocator:
    pool: Pool | None
    def __init__(
        self,
        pool: Pool | None,
        *,
        get_pool: Callable[[int], Pool],
        current_device: Callable[[], int],
        stream_ptr: Callable[[], int] | None,
        current_stream: Callable[[], Any],
        unowned_memory: Callable[..., Any],
        memory_pointer: Callable[..., Any],
        memory: Callable[[int], Any],
    ) -> None: ...
    @classmethod
    def for_cupy(
        cls, cupy: Any, pool: Pool | None, get_pool: Callable[[int], Pool]
    ) -> CupyAllocator: ...
    def malloc(self, nbytes: int) -> Any: ...
    def __call__(self, nbytes: int) -> Any: ...
