"""IPC refusals in the exporting process (CPU): a handle opened in its own process, memory
that gpupool does not own (arrays of gpupool memory made by an adapter or the C API export
their block), an upstream without IPC, empty and closed buffers, a simulated handle opened
without a simulated pool. On a GPU (marked gpu): the same refusals on the real driver."""

import numpy as np
import pytest
from ipc_peers import RETIRED, cupy, needs_cupy, needs_memfd
from ipc_peers import gpu_pool, mpool, msim, upstream  # noqa: F401 (fixtures)

import gpupool
from gpupool.ipc import export, mapping
from gpupool.testing import SimulatedDevice

pytestmark = needs_memfd


def test_a_handle_opened_in_its_own_process_is_refused(mpool):
    h = mpool.allocate(1000).ipc_handle()
    for handle in (h, h.to_bytes()):
        with pytest.raises(gpupool.IpcError, match="made in this process") as info:
            gpupool.open_ipc(handle)
        assert info.value.reason == "same_process"


class Foreign:
    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = {"shape": (array.nbytes,), "typestr": "|u1",
                                         "data": (array.ctypes.data, False), "version": 3,
                                         "strides": None, "stream": None}


def test_memory_gpupool_does_not_own_is_refused(mpool):
    wrapped = gpupool.as_buffer(Foreign(np.zeros(4096, np.uint8)), pool=mpool)
    with pytest.raises(gpupool.IpcError, match="wraps memory that gpupool does not own") as info:
        wrapped.ipc_handle()
    assert info.value.reason == "foreign_memory"
    assert "copy it into a gpupool buffer" in str(info.value)
    # A wrapper of a gpupool buffer exports that buffer's memory, at its own address.
    buf = mpool.allocate(8192)
    view = gpupool.as_buffer(buf.view(np.uint8, (8192,)))
    assert view.ipc_handle().offset == buf.ipc_handle().offset


def test_an_array_of_gpupool_memory_made_by_an_adapter_exports_its_buffer(mpool):
    # As a CuPy array of gpupool.cupy's allocator: only its interface reaches as_buffer, and
    # the DeviceBuffer holding the block (the array's memory owner) is what is exported.
    buf = mpool.allocate(8192)
    array = Foreign(np.zeros(1, np.uint8))
    array.__cuda_array_interface__ = dict(buf.__cuda_array_interface__, shape=(4096,),
                                          data=(buf.ptr + 1024, False))
    h = gpupool.as_buffer(array, pool=mpool).ipc_handle()   # the wrapper may go at once
    own = buf.ipc_handle()
    assert (h.offset, h.nbytes) == (own.offset + 1024, 4096)
    assert (h.buffer_slot, h.buffer_serial) == (own.buffer_slot, own.buffer_serial)
    del array
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == 1          # the buffer holds it
    buf.close()
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == RETIRED


def test_an_array_of_c_api_memory_exports_while_it_lives(mpool, default_pools):
    # As a PyTorch tensor under gpupool.torch.use(): a block of the C API, no DeviceBuffer.
    gpupool.set_pool(mpool)
    from gpupool.adapters import torch_entry

    ptr = torch_entry._torch_malloc(8192, 0, 0)
    array = Foreign(np.zeros(1, np.uint8))
    array.__cuda_array_interface__ = {"shape": (8192,), "typestr": "|u1", "version": 3,
                                      "data": (ptr, False), "strides": None, "stream": None}
    h = gpupool.as_buffer(array, pool=mpool).ipc_handle()
    assert h.nbytes == 8192 and mapping._slot_state(h.table, h.buffer_slot)[1] == 1
    del array
    export.collect()                                  # the array died: its export with it
    assert mapping._slot_state(h.table, h.buffer_slot)[1] != 1
    torch_entry._torch_free(ptr, 8192, 0, 0)


def test_memory_of_an_upstream_without_ipc_is_refused_naming_the_alternative():
    for sim in (SimulatedDevice(), SimulatedDevice(stream_ordered=True)):
        buf = gpupool.Pool(upstream=sim).allocate(1000)
        with pytest.raises(gpupool.IpcError, match=r"SimulatedDevice\(shareable=True\)") as info:
            buf.ipc_handle()
        assert info.value.reason == "not_exportable"
    with pytest.raises(ValueError, match="cannot be shareable"):
        SimulatedDevice(stream_ordered=True, shareable=True)
    refusal = gpupool.upstream.mempool._ASYNC_REFUSAL           # AsyncUpstream's (a GPU's) message
    assert "'async'" in refusal and "upstream 'vmm'" in refusal and "'driver'" in refusal


def test_empty_closed_and_forked_buffers_are_refused(mpool):
    with pytest.raises(ValueError, match="empty buffer"):
        mpool.allocate(0).ipc_handle()
    buf = mpool.allocate(100)
    buf.close()
    with pytest.raises(gpupool.InvalidBufferError):
        buf.ipc_handle()


def test_a_simulated_handle_needs_a_simulated_pool(mpool, default_pools):
    h = mpool.allocate(1000).ipc_handle()
    fields = h.fields()
    fields.update(table="/nonexistent/other-process", pid=1)
    other = gpupool.IpcHandle(**fields)         # as if another process had made it
    gpupool._pools.pop(0, None)
    gpupool.core.defaults._forget(0)
    with pytest.raises(gpupool.IpcError, match="pool on a gpupool.testing.SimulatedDevice") \
            as info:
        gpupool.open_ipc(other)
    assert info.value.reason == "wrong_device"
    elsewhere = gpupool.Pool(upstream=SimulatedDevice(uuid=b"another GPU UUID"))
    with pytest.raises(gpupool.IpcError, match="GPU-") as info:
        gpupool.open_ipc(other, pool=elsewhere)
    assert info.value.reason == "wrong_device"
    with pytest.raises(TypeError, match="pool must be a gpupool.Pool"):
        gpupool.open_ipc(other, pool="pool")
    with pytest.raises(gpupool.IpcError, match="has exited") as info:
        gpupool.open_ipc(other, pool=mpool)     # no such table: its process is gone
    assert info.value.reason == "exporter_exited"


@pytest.mark.gpu
@needs_cupy
def test_a_handle_opened_in_its_own_process_is_refused_on_a_gpu(gpu_pool):
    buf = gpu_pool.allocate(1000)
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.open_ipc(buf.ipc_handle())
    assert info.value.reason == "same_process"


@pytest.mark.gpu
@needs_cupy
def test_memory_gpupool_does_not_own_is_refused_on_a_gpu():
    wrapped = gpupool.as_buffer(cupy.zeros(4096, dtype=cupy.uint8))
    with pytest.raises(gpupool.IpcError) as info:
        wrapped.ipc_handle()
    assert info.value.reason == "foreign_memory"


@pytest.mark.gpu
@needs_cupy
def test_memory_of_the_async_upstream_is_refused_naming_the_alternatives():
    buf = gpupool.Pool(device=0, upstream="async").allocate(1000)
    with pytest.raises(gpupool.IpcError, match="upstream 'vmm'") as info:
        buf.ipc_handle()
    assert info.value.reason == "not_exportable" and "'driver'" in str(info.value)
