"""gpupool.rmm: RMM allocating from gpupool. CPU tests drive the compiled callbacks on the
simulated device and check laziness and errors without RMM; GPU tests (marked gpu) run RMM,
CuPy and PyTorch on a gpupool resource, and skip where RMM is not installed."""

import configparser
import sys
import types

import numpy as np
import pytest
from conftest import REPO, SLOW_WRITE, fresh_python

import gpupool
import gpupool.rmm
from gpupool.adapters.rmm_entry import RmmCallbacks
from gpupool.testing import SimulatedDevice

MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("default_pools")


class Stream:
    """A stream as RMM passes it to a callback: ``__cuda_stream__`` gives the handle."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.fixture
def callbacks(sim):
    return RmmCallbacks(gpupool.Pool(upstream=sim, device=0, hard_limit=16 * MiB))


# Without RMM -----------------------------------------------------------------------------

def test_the_module_imports_without_importing_rmm():
    out = fresh_python("""
        import sys
        import gpupool.rmm
        print("rmm" in sys.modules, gpupool.rmm.__all__)
        """).stdout
    assert out.split() == ["False", "['resource',", "'use']"]


@pytest.mark.parametrize("make", [gpupool.rmm.resource, gpupool.rmm.use])
def test_without_rmm_a_resource_names_the_extra(monkeypatch, make):
    monkeypatch.setitem(sys.modules, "rmm", None)       # import rmm raises ImportError
    with pytest.raises(ImportError, match=r"gpupool\[rmm\]"):
        make()


def test_bad_pools_and_devices_are_refused(sim):
    pool = gpupool.Pool(upstream=sim, device=0)
    with pytest.raises(TypeError, match="gpupool.Pool"):
        gpupool.rmm.resource("pool")
    with pytest.raises(TypeError, match="device must be an int"):
        gpupool.rmm.resource(pool, device="0")
    with pytest.raises(ValueError, match="device 0, not device 1"):
        gpupool.rmm.resource(pool, device=1)
    with pytest.raises(ValueError, match="simulated device"):
        gpupool.rmm.resource(pool)
    with pytest.raises(TypeError):
        RmmCallbacks(None)


# The callbacks, on the simulated device --------------------------------------------------

def test_allocations_are_pool_blocks_counted_and_freed(callbacks):
    pool = callbacks.pool
    ptr = callbacks.allocate(1000, Stream(0))
    assert ptr % 256 == 0                                   # RMM's alignment
    stats = pool.stats()
    assert stats.in_use_bytes == 1024 and stats.num_allocs == 1
    callbacks.deallocate(ptr, 1000, Stream(0))
    assert pool.stats().in_use_bytes == 0 and pool.stats().num_frees == 1
    assert callbacks.allocate(1000, Stream(0)) == ptr        # the cached block again
    assert pool.stats().cache_hits == 1
    callbacks.deallocate(ptr, 1000, Stream(0))


def test_zero_bytes_is_the_null_pointer_without_the_pool(callbacks):
    assert callbacks.allocate(0, Stream(0)) == 0
    callbacks.deallocate(0, 0, Stream(0))
    assert callbacks.pool.stats().num_allocs == 0


def test_streams_are_read_from_the_cuda_stream_protocol_or_taken_as_ints(callbacks):
    sim = callbacks.pool.upstream
    stream = sim.create_stream()
    ptr = callbacks.allocate(MiB, Stream(stream))
    callbacks.deallocate(ptr, MiB, stream)                   # an int handle serves too
    assert callbacks.allocate(MiB, stream) == ptr            # cached on its stream
    callbacks.deallocate(ptr, MiB, Stream(stream))
    with pytest.raises(TypeError):
        callbacks.allocate(MiB, "stream")


def test_a_block_freed_with_work_pending_goes_to_no_other_stream(callbacks):
    sim = callbacks.pool.upstream
    first, second = sim.create_stream(), sim.create_stream()
    n = 2 * MiB                                              # a whole segment: no remainder
    ptr = callbacks.allocate(n, Stream(first))
    sim.launch(first)                                        # work still running on first
    callbacks.deallocate(ptr, n, Stream(first))
    other = callbacks.allocate(n, Stream(second))
    assert other != ptr
    assert callbacks.allocate(n, Stream(first)) == ptr       # first takes it back at once
    for p, s in ((ptr, first), (other, second)):
        callbacks.deallocate(p, n, Stream(s))
    sim.complete()


def test_out_of_memory_is_a_memory_error_counted_in_the_pool(callbacks):
    with pytest.raises(gpupool.OutOfMemoryError, match="out of memory") as failure:
        callbacks.allocate(32 * MiB, Stream(0))
    assert isinstance(failure.value, MemoryError)    # what RMM turns into rmm::out_of_memory
    assert callbacks.pool.memory_stats()["num_ooms"] == 1


def test_on_oom_callbacks_run_before_the_failure(callbacks):
    kept = [callbacks.allocate(12 * MiB, Stream(0))]
    calls = []

    def release(nbytes):
        calls.append(nbytes)
        callbacks.deallocate(kept.pop(), 12 * MiB, Stream(0))
        return True

    gpupool.on_oom(release)
    try:
        ptr = callbacks.allocate(8 * MiB, Stream(0))
    finally:
        gpupool.remove_oom_callback(release)
    assert calls == [8 * MiB]
    callbacks.deallocate(ptr, 8 * MiB, Stream(0))


def test_other_failures_are_gpupool_errors(callbacks):
    with pytest.raises(gpupool.GpupoolError, match=r"allocating \d+ B for RMM on device 0 "
                                                   r"failed: invalid value"):
        callbacks.allocate(1 << 51, Stream(0))                  # absurd: over 1 PiB
    assert callbacks.pool.memory_stats()["num_ooms"] == 0


def test_a_sleeping_tag_s_request_names_the_tag():
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=4096), device=0)
    callbacks = RmmCallbacks(pool)
    with gpupool.tag("kv"):
        ptr = callbacks.allocate(1000, Stream(0))
    pool.sleep("kv")
    with gpupool.tag("kv"), pytest.raises(gpupool.SleepingMemoryError, match=r"tag 'kv' sleeps"):
        callbacks.allocate(1000, Stream(0))
    callbacks.deallocate(ptr, 1000, Stream(0))          # a sleeping block may be freed
    assert pool.stats().asleep_bytes == 0


def test_a_bad_free_goes_to_the_unraisable_hook_not_to_rmm(callbacks, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    callbacks.deallocate(12345, 10, Stream(0))                  # never handed out
    callbacks.deallocate(512, 10, "stream")
    assert [type(u.exc_value) for u in seen] == [gpupool.GpupoolError, TypeError]
    assert "freeing 10 B at 0x3039 for RMM failed: invalid value" in str(seen[0].exc_value)


def test_a_region_caches_the_allocations_made_inside_it(callbacks):
    region = gpupool.Region(pool=callbacks.pool)
    ptrs = []
    for _ in range(3):
        with region:
            ptr = callbacks.allocate(500_000, Stream(0))
            ptrs.append(ptr)
            callbacks.deallocate(ptr, 500_000, Stream(0))
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert region.stats().cache_hits == 2


# resource() and use() over a stand-in for RMM ----------------------------------------------

def fake_rmm():
    """The parts of RMM that gpupool.rmm calls: ``rmm.mr.CallbackMemoryResource`` and
    ``rmm.mr.set_per_device_resource`` (recorded in ``set``)."""

    class CallbackMemoryResource:
        def __init__(self, allocate_func, deallocate_func):
            self.allocate, self.deallocate = allocate_func, deallocate_func

    rmm = types.ModuleType("rmm")
    rmm.mr = types.ModuleType("rmm.mr")
    rmm.mr.CallbackMemoryResource = CallbackMemoryResource
    rmm.mr.set = []
    rmm.mr.set_per_device_resource = lambda device, mr: rmm.mr.set.append((device, mr))
    return rmm


def test_use_sets_a_callback_resource_over_the_pool(monkeypatch, callbacks):
    rmm = fake_rmm()
    monkeypatch.setitem(sys.modules, "rmm", rmm)
    monkeypatch.setitem(sys.modules, "rmm.mr", rmm.mr)
    # The simulated device serves no RMM resource; the stand-in's memory is never touched.
    monkeypatch.setattr(gpupool.rmm, "_check_pool", lambda pool, device: None)
    pool = callbacks.pool
    mr = gpupool.rmm.use(pool)
    assert isinstance(mr, rmm.mr.CallbackMemoryResource)
    assert rmm.mr.set == [(0, mr)] and mr.pool is pool
    assert repr(mr).startswith("<gpupool.rmm resource over <gpupool.Pool")
    ptr = mr.allocate(4096, Stream(0))
    assert pool.stats().in_use_bytes == 4096
    mr.deallocate(ptr, 4096, Stream(0))
    assert pool.stats().in_use_bytes == 0
    gpupool.set_pool(pool)
    assert gpupool.rmm.resource().pool is pool                  # the device's default pool


# RMM's own callback machinery, on the simulated device (RMM needs no GPU for this) ---------

@pytest.fixture
def rmm_on_sim(monkeypatch, callbacks):
    """(rmm, a gpupool.rmm resource over the simulated pool of ``callbacks``): RMM's resource
    calls the pool's functions without touching the memory, so RMM runs here without a GPU."""
    rmm = pytest.importorskip("rmm")
    monkeypatch.setattr(gpupool.rmm, "_check_pool", lambda pool, device: None)
    return rmm, gpupool.rmm.resource(callbacks.pool)


def test_rmm_calls_the_pool_with_its_streams(rmm_on_sim):
    rmm, mr = rmm_on_sim
    from rmm.pylibrmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM

    assert isinstance(mr, rmm.mr.DeviceMemoryResource)
    for stream in (DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM):
        ptr = mr.allocate(1000, stream)
        assert mr.pool.stats().in_use_bytes == 1024
        mr.deallocate(ptr, 1000, stream)
        assert mr.pool.stats().in_use_bytes == 0


def test_rmm_raises_memory_error_with_gpupools_message(rmm_on_sim):
    rmm, mr = rmm_on_sim
    with pytest.raises(MemoryError, match="gpupool: out of memory on device 0") as failure:
        mr.allocate(32 * MiB)
    assert not isinstance(failure.value, gpupool.GpupoolError)    # RMM's, from C++
    assert mr.pool.memory_stats()["num_ooms"] == 1
    with pytest.raises(RuntimeError, match="for RMM on device 0 failed: invalid value"):
        mr.allocate(1 << 51)


def test_rmm_hands_a_bad_free_to_the_unraisable_hook(rmm_on_sim, monkeypatch):
    rmm, mr = rmm_on_sim
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    mr.deallocate(12345, 10)
    assert [type(u.exc_value) for u in seen] == [gpupool.GpupoolError]
    assert mr.allocate(0) == 0                                  # and RMM goes on


# On the GPU, with RMM ----------------------------------------------------------------------

@pytest.fixture
def rmm():
    rmm = pytest.importorskip("rmm")               # imports rmm.mr too
    saved = rmm.mr.get_per_device_resource(0)
    yield rmm
    rmm.mr.set_per_device_resource(0, saved)


@pytest.fixture
def gpu_pool():
    return gpupool.Pool(device=0)


@pytest.mark.gpu
def test_device_buffers_are_blocks_of_the_pool(rmm, gpu_pool):
    mr = gpupool.rmm.resource(gpu_pool)
    buf = rmm.DeviceBuffer(size=MiB, mr=mr)
    stats = gpu_pool.stats()
    assert stats.in_use_bytes == MiB and stats.num_allocs == 1
    data = np.arange(MiB, dtype=np.uint8)
    buf.copy_from_host(data)
    assert (buf.copy_to_host() == data).all()
    first = buf.ptr
    del buf
    assert gpu_pool.stats().in_use_bytes == 0 and gpu_pool.stats().num_frees == 1
    assert rmm.DeviceBuffer(size=MiB, mr=mr).ptr == first        # cached, and freed again
    assert rmm.DeviceBuffer(size=0, mr=mr).ptr == 0
    assert gpu_pool.stats().in_use_bytes == 0


@pytest.mark.gpu
def test_use_makes_every_rmm_allocation_a_block(rmm, gpu_pool):
    mr = gpupool.rmm.use(gpu_pool)
    assert rmm.mr.get_per_device_resource(0) is mr
    buf = rmm.DeviceBuffer(size=3 * MiB)
    assert gpu_pool.stats().in_use_bytes == 3 * MiB
    blocks = [block for segment in gpupool.memory_snapshot(gpu_pool)["segments"]
              for block in segment["blocks"]]
    assert any(b["address"] == buf.ptr and b["state"] == "active_allocated"
               for b in blocks)                               # snapshots see it
    del buf
    assert gpu_pool.stats().in_use_bytes == 0


@pytest.mark.gpu
def test_rmm_streams_order_the_blocks(rmm, gpu_pool):
    cupy = pytest.importorskip("cupy")
    from rmm.pylibrmm.stream import Stream as RmmStream

    mr = gpupool.rmm.resource(gpu_pool)
    kernel = cupy.RawKernel(SLOW_WRITE, "slow_write")
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    n = 8 * MiB
    buf = rmm.DeviceBuffer(size=n, stream=RmmStream(a), mr=mr)
    first = buf.ptr
    with a:
        kernel((64,), (256,), (cupy.uint64(first), cupy.int64(n), cupy.int64(200_000_000)))
    del buf                                       # freed on a, the kernel still running there
    other = rmm.DeviceBuffer(size=n, stream=RmmStream(b), mr=mr)
    assert other.ptr != first                     # b does not take a's block at once
    again = rmm.DeviceBuffer(size=n, stream=RmmStream(a), mr=mr)
    assert again.ptr == first                     # a does, behind its own work
    a.synchronize()
    assert (again.copy_to_host() == 42).all()


@pytest.mark.gpu
def test_buffers_pass_between_rmm_and_cupy(rmm, gpu_pool):
    cupy = pytest.importorskip("cupy")
    from rmm.allocators.cupy import rmm_cupy_allocator

    mr = gpupool.rmm.use(gpu_pool)
    buf = rmm.DeviceBuffer(size=4096, mr=mr)
    view = cupy.asarray(buf)                      # through the CUDA Array Interface
    assert view.data.ptr == buf.ptr
    view[:] = 5
    assert (buf.copy_to_host() == 5).all()
    with cupy.cuda.using_allocator(rmm_cupy_allocator):
        x = cupy.arange(MiB, dtype=cupy.float32)
    assert gpu_pool.stats().in_use_bytes == 4096 + 4 * MiB
    assert float(x.sum()) == float(np.arange(MiB, dtype=np.float32).sum())
    del x, view, buf
    assert gpu_pool.stats().in_use_bytes == 0


@pytest.mark.gpu
def test_rmm_torch_allocator_routes_pytorch_to_the_pool(rmm):
    pytest.importorskip("torch")
    out = fresh_python("""
        import torch, rmm, gpupool, gpupool.rmm
        from rmm.allocators.torch import rmm_torch_allocator
        pool = gpupool.get_pool(0)
        gpupool.rmm.use(pool)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        t = torch.ones(1 << 20, device="cuda")
        print(pool.stats().in_use_bytes >= 4 << 20, float(t.sum()))
        buf = rmm.DeviceBuffer(size=64)
        v = torch.as_tensor(buf, device="cuda")     # an RMM buffer seen by PyTorch
        v.fill_(7)
        torch.cuda.synchronize()
        print(bool((buf.copy_to_host() == 7).all()))
        del t, v, buf
        print(pool.stats().in_use_bytes)
        """, timeout=300)
    assert out.stdout.split() == ["True", "1048576.0", "True", "0"], out.stderr


@pytest.mark.gpu
def test_out_of_memory_raises_rmms_memory_error(rmm):
    pool = gpupool.Pool(device=0, hard_limit=64 * MiB)
    mr = gpupool.rmm.resource(pool)
    with pytest.raises(MemoryError, match="gpupool: out of memory"):
        rmm.DeviceBuffer(size=128 * MiB, mr=mr)
    assert pool.memory_stats()["num_ooms"] == 1
    with pytest.raises(RuntimeError, match="for RMM on device 0 failed"):
        rmm.DeviceBuffer(size=1 << 51, mr=mr)        # absurd (over 1 PiB), not out of memory
    buf = rmm.DeviceBuffer(size=32 * MiB, mr=mr)     # and the resource still serves
    assert pool.stats().in_use_bytes == 32 * MiB
    del buf


@pytest.mark.gpu
def test_a_region_covers_rmm_allocations(rmm, gpu_pool):
    mr = gpupool.rmm.resource(gpu_pool)
    region = gpupool.Region(pool=gpu_pool)
    ptrs = []
    for _ in range(3):
        with region:
            buf = rmm.DeviceBuffer(size=500_000, mr=mr)
            ptrs.append(buf.ptr)
            del buf
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert region.stats().cache_hits == 2



def test_the_rmm_extra_installs_rmm_for_cuda_13():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    assert config["options.extras_require"]["rmm"].split() == ["rmm-cu13>=26.10"]
