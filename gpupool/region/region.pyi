from contextlib import AbstractContextManager
from typing import Any, Literal

from gpupool.core.pool import Pool
from gpupool.region.planned import Planner
from gpupool.stats import RegionStats

class Region:
    pool: Pool
    on_exit: str
    scope: str
    skip_first: bool
    debug: bool
    trace: bool
    planner: Planner | None
    def __init__(
        self,
        pool: Pool | None = None,
        on_exit: Literal["detach", "invalidate"] = "detach",
        collect: Literal["young", "full"] | None = "young",
        max_cached_bytes: int | None = None,
        skip_first: bool = False,
        debug: bool = False,
        trace: bool = False,
        scope: Literal["thread", "process"] = "thread",
        name: str | None = None,
        plan: bool | dict[str, Any] = False,
    ) -> None: ...
    def __enter__(self) -> Region: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool: ...
    def keep(self, obj: Any) -> Any: ...
    def release(self) -> None: ...
    def stats(self) -> RegionStats: ...
    def reset_peak_stats(self) -> None: ...
    def enter_in_thread(self) -> AbstractContextManager[Region]: ...

def _regions_by_cache() -> dict[int, tuple[int, str | None]]: ...
