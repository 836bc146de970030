from gpupool.upstream.upstreams import Upstream

class BlockOwner:
    upstream: Upstream
    device: int
