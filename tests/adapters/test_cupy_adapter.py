"""The compiled CuPy allocator (gpupool.cupy, gpupool.adapters.cupy_allocator) on the simulated
device, with a fake ``cupy`` module (tests/fake_cupy.py) in sys.modules: device and pool
resolution, the stream handed through, regions, errors as Pool.allocate raises them, and the
block's return when CuPy drops the memory. gpupool.cupy.allocator refuses an explicit pool on
the simulated device (the real CuPy cannot use its host memory), so the tests of an explicit
pool make the allocator as it does, for the fake (``allocator``). tests/adapters/test_cupy.py
runs the real CuPy on a GPU."""

import os
import sys
import weakref

import pytest
from conftest import check_invariants, fresh_python
from fake_cupy import FakeCupy, Memory, MemoryPointer, UnownedMemory

import gpupool
import gpupool.cupy
from gpupool.adapters.cupy_allocator import CupyAllocator
from gpupool.testing import SimulatedDevice

KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture
def fake(monkeypatch):
    module = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def allocator(pool):
    """What ``allocator(pool)`` returns, for the fake CuPy in sys.modules."""
    return CupyAllocator.for_cupy(sys.modules["cupy"], pool, gpupool.get_pool).malloc


def not_called():
    raise AssertionError("the adapter asked for CuPy's current stream object")


def run_python(code):
    """Run ``code`` in a fresh interpreter that can import fake_cupy; (returncode, output)."""
    result = fresh_python(code)
    return result.returncode, result.stdout + result.stderr


def test_importing_the_adapter_does_not_import_cupy():
    code, out = run_python("""
        import sys
        import gpupool.cupy
        assert "gpupool.adapters.cupy_allocator" in sys.modules
        print(sorted(name for name in sys.modules if name.split(".")[0] == "cupy"))
    """)
    assert code == 0, out
    assert out.strip() == "[]"


def test_dir_lists_the_public_api_not_the_names_the_module_imports():
    public = [name for name in dir(gpupool.cupy) if not name.startswith("__")]
    assert public == gpupool.cupy.__all__ == ["allocator"]
    assert "__doc__" in dir(gpupool.cupy)


def test_without_cupy_making_an_allocator_raises_import_error():
    code, out = run_python("""
        import sys

        class NoCupy:                       # as if cupy were not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "cupy":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.modules.pop("cupy", None)
        sys.meta_path.insert(0, NoCupy())
        import gpupool.cupy
        try:
            gpupool.cupy.allocator()
        except ImportError as exc:
            print(type(exc).__name__, exc)
    """)
    assert code == 0, out
    assert out.strip() == ("ImportError gpupool.cupy needs CuPy for CUDA 13: pip install "
                           "'gpupool[cupy]' (or pip install cupy-cuda13x)")


def test_an_allocation_is_a_device_buffer_wrapped_for_cupy(fake, pool):
    alloc = allocator(pool)
    assert type(alloc.__self__).__name__ == "CupyAllocator" and alloc.__self__.pool is pool
    pointer = alloc(1000)
    assert type(pointer) is MemoryPointer and type(pointer.mem) is UnownedMemory
    buf = pointer.mem._owner
    assert isinstance(buf, gpupool.DeviceBuffer) and buf.pool is pool
    assert pointer.ptr == pointer.mem.ptr == buf.ptr != 0 and buf.ptr % 256 == 0
    assert pointer.mem.size == buf.nbytes == 1000
    assert pointer.mem.device_id == pointer.device_id == 0
    stats = check_invariants(pool)
    assert stats.num_allocs == 1 and stats.in_use_bytes == gpupool.size_class(1000)


def test_memory_returns_to_the_pool_when_cupy_drops_it(fake, pool):
    alloc = allocator(pool)
    pointer = alloc(300 * KIB)
    first = pointer.ptr
    owner = weakref.ref(pointer.mem._owner)
    del pointer
    assert owner() is None
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0 and stats.num_frees == 1
    assert alloc(300 * KIB).ptr == first            # cached, handed back at once


@pytest.mark.parametrize("stream_ptr_function", [False, True])
def test_the_block_is_allocated_on_cupys_current_stream(monkeypatch, stream_ptr_function):
    sim = SimulatedDevice(stream_ordered=True)
    pool = gpupool.Pool(upstream=sim)
    fake = FakeCupy(stream_ptr_function=stream_ptr_function)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    if stream_ptr_function:                         # the pointer function is preferred
        fake.cuda.get_current_stream = not_called
    alloc = allocator(pool)
    stream = fake.stream_ptr = sim.create_stream()
    pointer = alloc(MIB)                            # its own upstream allocation
    assert pointer.mem._owner.stream == stream
    assert sim.allocated_on[pointer.ptr][0] == stream
    first = pointer.ptr
    del pointer
    assert pool.allocate(MIB, stream=stream).ptr == first   # freed on that stream
    fake.stream_ptr = 0
    assert alloc(4 * KIB).mem._owner.stream == 0
    assert sim.errors == []


def test_an_explicit_pool_of_another_device_raises_value_error(fake, pool):
    alloc = allocator(pool)
    fake.device = 1
    with pytest.raises(ValueError, match="pool of device 0 used while CuPy's current device "
                                         "is 1; make one allocator per device"):
        alloc(1000)
    with pytest.raises(ValueError, match="device 0 .* device is 1"):
        alloc(0)                                    # checked before the size, as before
    assert pool.stats().num_allocs == 0


def test_without_a_pool_each_call_uses_the_current_devices_default_pool(fake, default_pools):
    pools = [gpupool.Pool(upstream=SimulatedDevice(device=d)) for d in (0, 1)]
    for pool in pools:
        gpupool.set_pool(pool)
    alloc = gpupool.cupy.allocator()
    assert alloc.__self__.pool is None
    a = alloc(1000)
    fake.device = 1
    b = alloc(1000)
    assert (a.mem._owner.pool, b.mem._owner.pool) == (pools[0], pools[1])
    assert b.device_id == 1
    replacement = gpupool.Pool(upstream=SimulatedDevice(device=1))
    gpupool.set_pool(replacement)                   # applies to the next call
    assert alloc(1000).mem._owner.pool is replacement
    gpupool.set_pool(pools[0], device=1)            # a default pool of the wrong device
    with pytest.raises(ValueError, match="pool of device 0 used while CuPy's current device "
                                         "is 1"):
        alloc(1000)


def test_a_device_without_a_default_pool_gets_one_from_get_pool(fake, monkeypatch, pool):
    asked = []

    def get_pool(device=None):
        asked.append(device)
        return pool

    monkeypatch.setattr(gpupool, "get_pool", get_pool)
    monkeypatch.delitem(gpupool._pools, 0, raising=False)
    alloc = gpupool.cupy.allocator()
    assert alloc(1000).mem._owner.pool is pool
    assert asked == [0]


def test_zero_bytes_give_cupys_empty_memory_without_touching_the_pool(fake, pool):
    fake.cuda.get_current_stream = not_called       # not even the stream is asked for
    pointer = allocator(pool)(0)
    assert type(pointer) is MemoryPointer and type(pointer.mem) is Memory
    assert pointer.ptr == 0 and pointer.mem.size == 0
    assert pool.stats().num_allocs == 0


def test_a_region_caches_adapter_allocations_at_the_same_addresses(fake, pool):
    alloc = allocator(pool)
    region = gpupool.Region(pool=pool)
    seen = []
    for _ in range(4):
        with region:
            a = alloc(300 * KIB)
            b = alloc(5 * KIB)
            seen.append((a.ptr, b.ptr))
            del a, b
    assert len(set(seen)) == 1
    assert seen[0][1] == seen[0][0] + 300 * KIB      # both cut from one new 2 MiB segment:
    stats = region.stats()                           # one miss (the growth), then all hits
    assert stats.cache_misses == 1 and stats.cache_hits == 7
    check_invariants(pool)


def test_out_of_memory_runs_the_callbacks_then_raises_as_pool_allocate(fake, sim):
    pool = gpupool.Pool(upstream=sim, hard_limit="3MiB")
    alloc = allocator(pool)
    asked = []
    callback = gpupool.on_oom(asked.append)
    try:
        with pytest.raises(gpupool.OutOfMemoryError) as adapter:
            alloc(8 * MIB)
        assert asked == [8 * MIB]
        with pytest.raises(gpupool.OutOfMemoryError) as direct:
            pool.allocate(8 * MIB)
    finally:
        gpupool.remove_oom_callback(callback)
    assert asked == [8 * MIB, 8 * MIB]
    assert str(adapter.value) == str(direct.value)
    assert "allocating 8.000 MiB (8388608 B)" in str(adapter.value)
    check_invariants(pool)


@pytest.mark.parametrize("nbytes, error", [(-1, ValueError), (1 << 51, ValueError),
                                           (1.5, TypeError), ("10", TypeError)])
def test_bad_sizes_raise_as_pool_allocate(fake, pool, nbytes, error):
    with pytest.raises(error, match="nbytes"):
        allocator(pool)(nbytes)
    assert pool.stats().num_allocs == 0


def test_a_pool_that_is_not_a_pool_is_refused(fake):
    with pytest.raises(TypeError, match="pool must be a gpupool.Pool or None, got str"):
        gpupool.cupy.allocator("0")


@pytest.mark.parametrize("cupy_module", [FakeCupy(), None])      # None: CuPy not installed
def test_a_pool_on_the_simulated_device_is_refused_before_cupy_is_asked(monkeypatch, pool,
                                                                        cupy_module):
    """Its host memory would reach CuPy's kernels as device memory (the first allocation then
    fails inside CuPy, blaming the driver), as gpupool.rmm.resource refuses it."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_module)
    with pytest.raises(ValueError, match=r"^a pool on a simulated device holds host memory: "
                                         r"it cannot serve CuPy's device allocations; give it "
                                         r"a pool on a GPU \(gpupool.Pool\(device=0\)\)"):
        gpupool.cupy.allocator(pool)
    assert pool.stats().num_allocs == 0


def test_a_bad_stream_from_cupy_raises(fake, pool):
    fake.stream_ptr = -5
    with pytest.raises(ValueError, match="invalid stream handle -5"):
        allocator(pool)(1000)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_the_adapter_in_a_forked_child_raises_gpupool_error():
    code, out = run_python("""
        import os, sys
        from fake_cupy import FakeCupy
        sys.modules["cupy"] = FakeCupy()
        import gpupool
        from gpupool.adapters.cupy_allocator import CupyAllocator
        from gpupool.testing import SimulatedDevice
        alloc = CupyAllocator.for_cupy(sys.modules["cupy"],
                                       gpupool.Pool(upstream=SimulatedDevice()),
                                       gpupool.get_pool).malloc
        keep = alloc(100)
        pid = os.fork()
        if pid == 0:
            try:
                alloc(100)
            except gpupool.GpupoolError as exc:
                ok = "fork" in str(exc)
            else:
                ok = False
            del keep
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    assert code == 0, out
