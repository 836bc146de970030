"""IPC exports on the simulated device (CPU): the offsets of blocks cut from segments and of
pages, the export table (a buffer's handle retired with its block, slots and events reused,
given-back exports forgotten), and a segment that an importer holds open kept from the driver
by trim. On a GPU (marked gpu): the vmm upstream's pages are requested shareable."""

import gc
import os

import pytest
from conftest import check_invariants
from ipc_peers import KIB, MIB, PAGE, RETIRED, needs_cupy, needs_memfd
from ipc_peers import mpool, msim, vpool, vsim  # noqa: F401 (fixtures)

import gpupool
from gpupool.ipc import export, mapping, table
from gpupool.testing import SimulatedDevice

pytestmark = needs_memfd


def segment_base(sim, handle, buf):
    """The start of the simulated allocation the handle names (checked to be one)."""
    base = buf.ptr - handle.offset
    assert base in sim._shared and sim._arrays[base][1] == handle.alloc_bytes
    return base


def test_blocks_cut_from_one_segment_export_their_offsets_in_it(mpool, msim):
    bufs = [mpool.allocate(n) for n in (1000, 4096, 70_000, 512)]
    handles = [b.ipc_handle() for b in bufs]
    bases = {segment_base(msim, h, b) for h, b in zip(handles, bufs, strict=True)}
    assert len(bases) == 1                      # one shared segment holds them all
    base = bases.pop()
    assert len({(h.segment_slot, h.segment_serial, h.mem) for h in handles}) == 1
    assert len({h.buffer_slot for h in handles}) == 4
    for h, b in zip(handles, bufs, strict=True):
        assert (h.kind, h.nbytes, h.simulated, h.device) == ("mem_handle", b.nbytes, True, 0)
        assert h.offset == b.ptr - base
    assert sorted(h.offset for h in handles) == [0, 1024, 5120, 75264]
    big = mpool.allocate(30 * MIB)              # a segment of its own
    h = big.ipc_handle()
    assert h.offset == 0 and segment_base(msim, h, big) == big.ptr
    assert h.alloc_bytes >= 30 * MIB and h.segment_slot != handles[0].segment_slot


def test_blocks_of_expandable_segments_export_their_pages(vpool, vsim):
    a = vpool.allocate(100 * KIB)
    b = vpool.allocate(50 * KIB)                # starts inside a's last page
    for buf in (a, b):
        h = buf.ipc_handle()
        first = buf.ptr - h.offset
        assert h.kind == "posix_fd" and h.page_bytes == PAGE and 0 <= h.offset < PAGE
        assert (first - min(vsim._ranges)) % PAGE == 0      # pages from the range's start
        assert h.alloc_bytes == len(h.remote_fds) * PAGE >= h.offset + buf.nbytes
        assert h.alloc_bytes - PAGE < h.offset + buf.nbytes   # no page more than needed
        assert len(h.fds) == len(h.remote_fds) and set(h.fds).isdisjoint(h.remote_fds)
        assert (h.segment_slot, h.mem) == (0, b"")


def test_a_buffers_handle_is_retired_with_its_block(mpool, msim):
    region = gpupool.Region(pool=mpool, on_exit="invalidate")
    ways = {}
    ways["closed"] = mpool.allocate(1000)
    ways["freed"] = mpool.allocate(1000)
    with region:
        ways["invalidated"] = mpool.allocate(1000)
        handles = {way: buf.ipc_handle() for way, buf in ways.items()}
    ways["closed"].close()
    del ways["freed"]
    for way, h in handles.items():
        serial, state, opened = mapping._slot_state(h.table, h.buffer_slot)
        assert (serial, state, opened) == (h.buffer_serial, RETIRED, 0), way
    kept = mpool.allocate(1000)
    h = kept.ipc_handle()
    assert mapping._slot_state(h.table, h.buffer_slot)[1] == 1        # live


def test_exporting_a_buffer_again_reuses_its_slot_and_event(mpool, msim):
    buf = mpool.allocate(1000)
    s = msim.create_stream()
    first, again, on_s = buf.ipc_handle(), buf.ipc_handle(), buf.ipc_handle(stream=s)
    assert first.buffer_slot == again.buffer_slot == on_s.buffer_slot
    assert first.event == again.event
    assert len(msim.calls_named("ipc_event_create")) == 1
    records = msim.calls_named("ipc_event_record")
    assert [stream for _, stream in records] == [0, 0, s]      # the buffer's, then s


def test_collect_forgets_given_back_exports_and_reuses_their_slots(mpool, msim):
    export.collect()
    start = export._stats()
    for _ in range(300):
        buf = mpool.allocate(4096)
        buf.ipc_handle()
        buf.close()
    export.collect()
    stats = export._stats()
    assert stats["records"] - start["records"] <= 1     # the shared segment's record stays
    assert stats["used_slots"] - start["used_slots"] <= 1
    assert len(msim.calls_named("ipc_event_destroy")) >= 299
    check_invariants(mpool)
    assert mpool.stats().in_use_bytes == 0


def test_a_posix_fd_exports_descriptors_close_with_the_buffer(vpool):
    buf = vpool.allocate(3 * PAGE)
    h = buf.ipc_handle()
    remote = h.remote_fds
    os.fstat(remote[0])
    del buf
    gc.collect()
    for fd in remote:                           # the export's own descriptors are closed
        with pytest.raises(OSError):
            os.fstat(fd)
    assert len(h.fds) == 3                      # the handle's stay until it dies


def test_trim_keeps_a_segment_that_an_importer_holds_open(mpool, msim):
    buf = mpool.allocate(1000)
    h = buf.ipc_handle()
    reserved = mpool.stats().reserved_bytes
    table._add_to_slot(h.table, h.segment_slot, 1)           # what an importer's open does
    del buf
    export.collect()                                          # a live importer's count stays
    assert mpool.trim() == 0 and mpool.stats().reserved_bytes == reserved
    assert msim.calls_named("free") == []
    table._add_to_slot(h.table, h.segment_slot, -1)          # ... and its close
    assert mpool.trim() == reserved and msim.calls_named("free") != []
    assert mapping._slot_state(h.table, h.segment_slot)[1] == RETIRED
    check_invariants(mpool)


def test_a_pool_that_ends_leaves_an_imported_segment_allocated():
    sim = SimulatedDevice(shareable=True)
    pool = gpupool.Pool(upstream=sim)
    h = pool.allocate(1000).ipc_handle()
    table._add_to_slot(h.table, h.segment_slot, 1)
    del pool
    gc.collect()
    assert sim.calls_named("free") == [] and sim.errors == []
    table._add_to_slot(h.table, h.segment_slot, -1)


@pytest.mark.gpu
@needs_cupy
def test_vmm_pages_are_requested_shareable():
    upstream = gpupool.VmmUpstream(0)
    assert upstream.shareable, upstream.ipc_refusal    # the H200 supports POSIX fds
    assert gpupool.VmmUpstream(0, shareable=False).ipc_refusal.endswith("GPUPOOL_UPSTREAM=driver")
