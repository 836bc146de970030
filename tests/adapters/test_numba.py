"""The Numba EMM plugin (gpupool.numba): lazily imported, Numba's interface, allocation through
the pool on the simulated device; on a GPU (marked gpu): Numba arrays and kernels on gpupool
memory, the environment variable, memory info, IPC offsets and regions."""

import gc
import os
import pickle
import reprlib
import subprocess
import sys
import textwrap
import types
import weakref

import numpy as np
import pytest
from conftest import check_invariants

import gpupool
import gpupool.numba
from gpupool.testing import SimulatedDevice

KIB = 1 << 10


def run_python(code, **env):
    """Run ``code`` in a fresh interpreter; its CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **env))


def test_importing_the_adapter_does_not_import_numba():
    result = run_python("""
        import sys
        import pydoc
        import gpupool.numba
        assert "use" in dir(gpupool.numba)
        assert "EMM plugin" in pydoc.render_doc(gpupool.numba)
        print(sorted(name for name in sys.modules if name.split(".")[0] == "numba"))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_without_numba_the_plugin_says_what_to_install():
    result = run_python("""
        import sys

        class NoNumba:                      # as if numba were not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "numba":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoNumba())
        import gpupool.numba
        for attempt in (lambda: gpupool.numba.GpupoolNumbaManager, gpupool.numba.use,
                        lambda: gpupool.numba._numba_memory_manager):
            try:
                attempt()
            except ImportError as exc:
                print(type(exc).__name__, exc)
        try:
            gpupool.numba.no_such_name
        except AttributeError as exc:
            print("AttributeError", exc)
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["ImportError gpupool.numba needs Numba's CUDA target: "
                         "pip install 'gpupool[numba]' (or pip install numba-cuda)"] * 3
    assert lines[3] == "AttributeError module 'gpupool.numba' has no attribute 'no_such_name'"


# With Numba installed ------------------------------------------------------------------------

@pytest.fixture
def numba_cuda():
    return pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


@pytest.fixture
def manager_class(numba_cuda):
    return gpupool.numba.GpupoolNumbaManager


@pytest.fixture
def numba_driver(numba_cuda, monkeypatch):
    """Numba's driver module, its choice of memory manager restored after the test."""
    from numba.cuda.cudadrv import driver

    monkeypatch.setattr(driver, "_memory_manager", driver._memory_manager)
    monkeypatch.setattr(driver.driver, "devices", {})    # as if Numba had made no context yet
    return driver


class FakeDevice:
    def __init__(self, ordinal):
        self.id = ordinal


class FakeContext:
    """What the plugin reads of a Numba context: its device's ordinal (weak-referenceable)."""

    def __init__(self, ordinal=0, memory_manager=None):
        self.device = FakeDevice(ordinal)
        self.memory_manager = memory_manager


@pytest.fixture
def manager(manager_class, pool):
    """The plugin for a context of device 0, drawing from the simulated pool."""
    return manager_class(context=FakeContext(), pool=pool)


def test_the_class_is_an_emm_plugin_of_interface_version_1(numba_cuda, manager_class):
    assert issubclass(manager_class, numba_cuda.HostOnlyCUDAMemoryManager)
    assert issubclass(manager_class, numba_cuda.GetIpcHandleMixin)
    assert gpupool.numba._numba_memory_manager is manager_class
    dummy = manager_class(context=None)         # as numba.cuda.set_memory_manager makes it
    assert dummy.interface_version == 1
    for name in ("memalloc", "get_memory_info", "get_ipc_handle", "initialize", "reset",
                 "defer_cleanup", "memhostalloc", "mempin"):
        assert not getattr(getattr(manager_class, name), "__isabstractmethod__", False), name


def test_use_installs_the_plugin(numba_driver, manager_class):
    gpupool.numba.use()
    assert numba_driver._memory_manager is manager_class
    gpupool.numba.use()                         # again: harmless


def test_use_refuses_once_numba_made_a_context_with_another_manager(numba_driver, monkeypatch):
    device = FakeDevice(0)
    device.primary_context = FakeContext(memory_manager=object())
    monkeypatch.setattr(numba_driver.driver, "devices", {0: device})
    with pytest.raises(RuntimeError, match="before Numba's first CUDA call.*"
                                           "NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba"):
        gpupool.numba.use()


def test_memalloc_takes_a_block_from_the_pool_and_numba_frees_it(manager, pool):
    pointer = manager.memalloc(1000)
    address, size = pointer.device_pointer_value, pointer.size
    stats = check_invariants(pool)
    assert (size, stats.in_use_bytes, stats.num_allocs) == (1000, 1024, 1)
    assert address % 256 == 0
    view = pointer.view(16, 48)                 # Numba's slices keep the allocation alive
    assert view.device_pointer_value == address + 16
    del pointer
    assert pool.stats().in_use_bytes == 1024
    del view
    assert pool.stats().in_use_bytes == 0
    assert pool.allocate(1000).ptr == address   # the same block, back in the pool


def test_zero_size_allocation(manager, pool):
    pointer = manager.memalloc(0)
    assert pointer.size == 0 and pointer.device_pointer_value is None
    assert pointer.view(0).size == 0
    assert pool.stats().num_allocs == 0


def test_defer_cleanup_holds_frees_until_the_outermost_exit(manager, pool):
    kept = manager.memalloc(100)
    with manager.defer_cleanup():
        with manager.defer_cleanup():
            pointer = manager.memalloc(3000)
            del pointer
        assert pool.stats().in_use_bytes == 512 + 3072
    assert pool.stats().in_use_bytes == 512
    del kept
    assert pool.stats().in_use_bytes == 0


def test_a_region_hands_numba_the_same_addresses_every_step(manager, pool):
    region = gpupool.Region(pool=pool)
    steps, misses = [], []
    for _ in range(3):
        with region:
            a, b = manager.memalloc(1000), manager.memalloc(300 * KIB)
            steps.append((a.device_pointer_value, b.device_pointer_value))
            del a, b
        misses.append(region.stats().cache_misses)
    assert steps[0] == steps[1] == steps[2]
    assert misses[0] >= 1 and misses[2] == misses[0]     # later steps never grow


def test_reset_trims_and_memory_info_comes_from_the_driver(manager, pool, sim):
    pointer = manager.memalloc(1 << 20)
    del pointer
    assert pool.stats().reserved_bytes > 0
    manager.reset()
    assert pool.stats().reserved_bytes == 0
    assert tuple(manager.get_memory_info()) == pool.mem_info() == (sim.capacity, sim.capacity)


@pytest.mark.usefixtures("default_pools")
def test_without_a_pool_it_draws_from_the_default_pool_of_the_context_device(manager_class,
                                                                              pool):
    gpupool.set_pool(pool)
    manager = manager_class(context=FakeContext(0))
    manager.initialize()
    assert manager.pool() is pool
    pointer = manager.memalloc(64)
    assert pool.stats().num_allocs == 1
    del pointer


def test_refusals(manager_class, manager, pool):
    with pytest.raises(ValueError, match="pool of device 0 given for a Numba context of device 1"):
        manager_class(context=FakeContext(1), pool=pool)
    with pytest.raises(ValueError, match="empty Numba allocation"):
        manager.get_ipc_handle(manager.memalloc(0))
    with pytest.raises(gpupool.OutOfMemoryError):
        manager_class(context=FakeContext(), pool=gpupool.Pool(
            upstream=SimulatedDevice(capacity=1 << 20))).memalloc(4 << 20)


class FakeRawDevice:
    """What a ``cuda.bindings.driver.CUdevice`` offers the plugin: ``int()``, no ``id``."""

    def __init__(self, ordinal):
        self._ordinal = ordinal

    def __int__(self):
        return self._ordinal


def _context_of(device):
    context = FakeContext()
    context.device = device
    return context


@pytest.mark.parametrize("shape", ["Device", "weak proxy of a Device", "CUdevice stand-in",
                                   "CUdevice"])
def test_the_context_device_is_a_numba_device_or_a_raw_cudevice(manager_class, pool, shape):
    # Numba's own contexts hold a weak proxy of a Device; a context made over a primary
    # context that another library created holds the CUdevice it was given.
    from numba.cuda.cudadrv.driver import binding

    made = [{"Device": FakeDevice, "CUdevice stand-in": FakeRawDevice,
             "CUdevice": binding.CUdevice}.get(shape, FakeDevice)(n) for n in (0, 1)]
    devices = [weakref.proxy(d) for d in made] if shape.startswith("weak") else made
    manager = manager_class(context=_context_of(devices[0]), pool=pool)
    pointer = manager.memalloc(1000)
    assert pool.stats().num_allocs == 1
    del pointer
    with pytest.raises(ValueError, match="pool of device 0 given for a Numba context of device 1"):
        manager_class(context=_context_of(devices[1]), pool=pool)


def test_a_context_device_without_an_ordinal_is_refused(manager_class, pool):
    with pytest.raises(TypeError, match="Numba context's device has no ordinal: 'gpu0'"):
        manager_class(context=_context_of("gpu0"), pool=pool)


# On a GPU ------------------------------------------------------------------------------------

@pytest.fixture
def gpu_pool(request):
    """A pool of device 0 (on the upstream named by the test's ``upstream`` mark, if any)."""
    mark = request.node.get_closest_marker("upstream")
    return gpupool.Pool(device=0, upstream=mark.args[0] if mark else None)


@pytest.fixture
def numba_on_gpupool(numba_cuda, manager_class, gpu_pool):
    """Numba's context of device 0 allocating from ``gpu_pool`` during the test.

    Numba chooses a context's manager when it creates the context, which another test in
    this process may have done already, so the test swaps the context's manager (the
    subprocess tests below use the documented switches).
    """
    context = numba_cuda.current_context()
    previous = context.memory_manager
    context.memory_manager = manager_class(context=context, pool=gpu_pool)
    yield gpu_pool
    context.memory_manager = previous


@pytest.mark.gpu
def test_device_arrays_and_kernels_on_gpupool_memory(numba_cuda, numba_on_gpupool):
    pool = numba_on_gpupool

    @numba_cuda.jit
    def fill(out):
        i = numba_cuda.grid(1)
        if i < out.size:
            out[i] = i * 0.5

    warm = numba_cuda.device_array(100, dtype=np.float32)
    fill[1, 128](warm)      # compiles: Numba's first compilation can keep its arguments
    before = pool.stats().num_allocs
    array = numba_cuda.device_array(100_000, dtype=np.float32)
    assert pool.stats().num_allocs == before + 1
    fill[(100_000 + 255) // 256, 256](array)
    np.testing.assert_array_equal(array.copy_to_host(), np.arange(100_000) * 0.5)
    if os.environ.get("GPUPOOL_UNDER_SANITIZER") == "1":
        # Under compute-sanitizer numba-cuda keeps the launch's argument tuple alive from C
        # (seen on the H200: a 1-tuple holding the array, with no Python referrer), so the
        # array a kernel ran on outlives `del`: the return is checked on one no kernel saw.
        array = numba_cuda.device_array(100_000, dtype=np.float32)
    address = array.__cuda_array_interface__["data"][0]
    alive = weakref.ref(array)
    del array
    gc.collect()            # Numba's launch machinery can leave the array in a reference cycle
    holders = _who_holds(alive)
    assert holders is None, f"the array is still referenced by {holders}"
    assert pool.allocate(400_000).ptr == address   # its block went back to the pool


def _who_holds(ref, depth=3):
    """None when ref's object is gone; else who keeps it alive, a few levels up (types and
    short reprs, this function's own lists and frames left out), for a failure message."""
    obj = ref()
    if obj is None:
        return None
    lines, level = [], [obj]
    del obj
    for _ in range(depth):
        up = []
        for held in level:
            up.extend(r for r in gc.get_referrers(held)
                      if r is not level and r is not up and r is not lines
                      and not isinstance(r, types.FrameType))
        lines.append([f"{type(r).__name__}:{reprlib.repr(r)}" for r in up[:6]])
        level = up[:6]
    return lines


@pytest.mark.gpu
def test_defer_cleanup_and_memory_info_through_numba(numba_cuda, numba_on_gpupool):
    pool = numba_on_gpupool
    with numba_cuda.defer_cleanup():
        array = numba_cuda.device_array(1 << 20, dtype=np.uint8)
        del array
        assert pool.stats().in_use_bytes == 1 << 20
    assert pool.stats().in_use_bytes == 0
    free, total = numba_cuda.current_context().get_memory_info()
    assert 0 < free <= total == pool.mem_info()[1]


@pytest.mark.gpu
def test_a_region_gives_numba_arrays_the_same_addresses(numba_cuda, numba_on_gpupool):
    region = gpupool.Region(pool=numba_on_gpupool)
    steps = []
    for _ in range(3):
        with region:
            a = numba_cuda.device_array((256, 256), dtype=np.float32)
            b = numba_cuda.to_device(np.arange(1000))
            steps.append((a.__cuda_array_interface__["data"][0],
                          b.__cuda_array_interface__["data"][0]))
            del a, b
    assert steps[0] == steps[1] == steps[2]


# What a sandboxed machine answers when it does not support CUDA IPC.
IPC_UNAVAILABLE = ("CUDA_ERROR_OPERATING_SYSTEM", "CUDA_ERROR_NOT_PERMITTED",
                   "CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_MAP_FAILED")


def _ipc_handle_or_skip(array):
    """``array.get_ipc_handle()``; skips where the machine (a sandbox) refuses CUDA IPC."""
    from numba.cuda.cudadrv.driver import CudaAPIError

    try:
        return array.get_ipc_handle()
    except CudaAPIError as exc:
        if any(name in str(exc) for name in IPC_UNAVAILABLE):
            pytest.skip(f"CUDA IPC is unavailable here: {exc}")
        raise


@pytest.mark.gpu
@pytest.mark.upstream("driver")         # cuIpcGetMemHandle shares cuMemAlloc memory only
def test_ipc_handle_of_a_shared_segment_block_carries_its_offset(numba_cuda, numba_on_gpupool,
                                                                   tmp_path):
    from cuda.bindings import driver

    def address_and_base(array):
        address = array.__cuda_array_interface__["data"][0]
        err, base, _ = driver.cuMemGetAddressRange(address)
        assert not err
        return address, int(base)

    arrays = [numba_cuda.to_device(np.arange(250, dtype=np.int32) + 1000 * k) for k in range(3)]
    # 1 KiB blocks cut from one shared segment: at most one starts its driver allocation.
    k = next(k for k, array in enumerate(arrays) if len(set(address_and_base(array))) == 2)
    array, (address, base) = arrays[k], address_and_base(arrays[k])
    handle = _ipc_handle_or_skip(array)
    assert handle._ipc_handle.offset == address - base > 0
    # Another process opens the handle and reads this block's values, not the segment's first.
    path = tmp_path / "handle.pickle"
    path.write_bytes(pickle.dumps(handle))
    child = run_python(f"""
        import pickle
        with open({str(path)!r}, "rb") as f:
            handle = pickle.load(f)
        with handle as array:
            print(array.copy_to_host().tolist())
    """)
    if child.returncode and any(name in child.stderr for name in IPC_UNAVAILABLE):
        pytest.skip(f"this machine cannot open CUDA IPC handles: {child.stderr[-300:]}")
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == str(list(range(1000 * k, 1000 * k + 250)))


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["environment", "use"])
def test_numba_programs_allocate_from_gpupool_when_switched_on(switch):
    pytest.importorskip("numba.cuda")
    env = {"NUMBA_CUDA_MEMORY_MANAGER": "gpupool.numba"} if switch == "environment" else {}
    result = run_python(f"""
        import numpy as np
        from numba import cuda
        import gpupool, gpupool.numba
        if {switch == "use"}:
            gpupool.numba.use()
        array = cuda.to_device(np.arange(1000))
        manager = cuda.current_context().memory_manager
        print(type(manager).__name__, gpupool.get_pool(0).stats().num_allocs,
              int(array.copy_to_host().sum()))
        if {switch == "use"}:
            gpupool.numba.use()             # again, with its own context made: harmless
    """, **env)
    assert result.returncode == 0, result.stderr
    name, allocs, total = result.stdout.split()
    assert (name, total) == ("GpupoolNumbaManager", str(sum(range(1000))))
    assert int(allocs) >= 1


@pytest.mark.gpu
def test_use_after_numba_made_its_context_is_refused():
    pytest.importorskip("numba.cuda")
    result = run_python("""
        from numba import cuda
        import gpupool.numba
        cuda.current_context()
        try:
            gpupool.numba.use()
        except RuntimeError as exc:
            print(exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "Numba already created its CUDA context on device 0" in result.stdout


@pytest.mark.gpu
def test_numba_on_a_primary_context_another_library_created():
    # As numba-cuda's Test3rdPartyContext: a Numba Context made from a raw CUdevice and the
    # primary context's handle, then Numba's own context over it, under the plugin.
    pytest.importorskip("numba.cuda")
    result = run_python("""
        import numpy as np
        from numba import cuda
        from numba.cuda.cudadrv import driver
        import gpupool

        device = driver.binding.CUdevice(0)
        handle = driver.driver.cuDevicePrimaryCtxRetain(device)
        outside = driver.Context(device, handle)
        outside.push()
        try:
            assert int(cuda.current_context().handle) == int(outside.handle)
            array = cuda.to_device(np.arange(1000))
            print(type(outside.memory_manager).__name__, int(array.copy_to_host().sum()),
                  gpupool.get_pool(0).stats().num_allocs >= 1)
            del array
        finally:
            outside.pop()
            driver.driver.cuDevicePrimaryCtxRelease(device)
    """, NUMBA_CUDA_MEMORY_MANAGER="gpupool.numba")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["GpupoolNumbaManager", str(sum(range(1000))), "True"]
