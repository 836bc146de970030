"""The IPC handle: its bytes and pickling (plain pickle and multiprocessing's pickler, which
carries a POSIX file descriptor handle's descriptors), and the refusal of what is not a
handle. On a GPU (marked gpu): garbage and a corrupted driver handle refused by another
process without a crash."""

import gc
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ipc_peers import MIB, PAGE, needs_cupy, needs_memfd
from ipc_peers import mpool, msim, server, upstream  # noqa: F401 (fixtures)

import gpupool
from gpupool.ipc.handle import FIELDS

pytestmark = needs_memfd


def handle_fields(kind="mem_handle", npages=1):
    """A strategy of valid handle fields."""
    u64 = st.integers(1, 2**63 - 1)
    page = 2 * MIB
    alloc = st.just(page * npages) if kind == "posix_fd" else st.integers(512, 2**40)
    return st.fixed_dictionaries({
        "kind": st.just(kind), "simulated": st.booleans(), "pid": st.integers(1, 2**31 - 1),
        "fd_pid": st.integers(1, 2**31 - 1), "device": st.integers(0, 64),
        "device_uuid": st.binary(min_size=16, max_size=16), "buffer_slot": u64,
        "buffer_serial": u64, "alloc_bytes": alloc,
        "table": st.text(min_size=1, max_size=80).filter(lambda t: "\x00" not in t),
        "event": st.binary(max_size=64),
    }).flatmap(lambda f: st.fixed_dictionaries({
        **{k: st.just(v) for k, v in f.items()},
        "offset": st.integers(0, min(f["alloc_bytes"] - 1, page - 1)),
    })).flatmap(lambda f: st.fixed_dictionaries({
        **{k: st.just(v) for k, v in f.items()},
        "nbytes": st.integers(1, f["alloc_bytes"] - f["offset"]),
        "segment_slot": st.just(0) if kind == "posix_fd" else u64,
        "segment_serial": st.just(0) if kind == "posix_fd" else u64,
        "page_bytes": st.just(page if kind == "posix_fd" else 0),
        "mem": st.just(b"") if kind == "posix_fd" else st.binary(min_size=1, max_size=64),
        "remote_fds": st.lists(st.integers(0, 2**31 - 1), min_size=npages, max_size=npages)
        if kind == "posix_fd" else st.just(()),
    }))


any_handle_fields = st.one_of(handle_fields(), st.integers(1, 8).flatmap(
    lambda n: handle_fields("posix_fd", n)))


@given(any_handle_fields)
@settings(max_examples=200, deadline=None)
def test_a_handle_round_trips_through_its_bytes_and_plain_pickle(fields):
    handle = gpupool.IpcHandle(**fields)
    assert gpupool.IpcHandle.from_bytes(handle.to_bytes()) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert ForkingPickler.loads(ForkingPickler.dumps(handle)) == handle
    assert set(handle.fields()) == set(FIELDS)


@given(st.binary(max_size=400))
@settings(max_examples=300, deadline=None)
def test_garbage_bytes_are_refused_as_malformed(data):
    with pytest.raises(gpupool.IpcError) as info:
        gpupool.IpcHandle.from_bytes(data)
    assert info.value.reason == "malformed"
    assert str(info.value).startswith("not a gpupool IPC handle: ")


@given(handle_fields(), st.data())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_truncated_or_altered_handle_is_refused(fields, data):
    raw = gpupool.IpcHandle(**fields).to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(0, len(raw) - 1))
    altered = bytearray(raw)
    altered[flip] ^= data.draw(st.integers(1, 255))
    for bad in (raw[:cut], bytes(altered)):
        with pytest.raises(gpupool.IpcError) as info:
            gpupool.IpcHandle.from_bytes(bad)
        assert info.value.reason == "malformed"


def test_open_ipc_refuses_what_is_not_a_handle(mpool):
    with pytest.raises(TypeError, match="IpcHandle or its bytes"):
        gpupool.open_ipc(12345)
    with pytest.raises(gpupool.IpcError, match="not a gpupool IPC handle") as info:
        gpupool.open_ipc(b"\x00" * 300, pool=mpool)
    assert info.value.reason == "malformed"
    with pytest.raises(TypeError, match="IpcHandle needs the fields"):
        gpupool.IpcHandle(kind="mem_handle")
    handle = mpool.allocate(100).ipc_handle()
    with pytest.raises(AttributeError, match="immutable"):
        handle.nbytes = 5
    error = pickle.loads(pickle.dumps(gpupool.IpcError("why", "released")))
    assert (str(error), error.reason) == ("why", "released")


def test_a_posix_fd_handle_carries_its_descriptors_through_multiprocessings_pickler():
    fds = [os.memfd_create(f"page{i}") for i in range(3)]
    fields = dict(kind="posix_fd", simulated=True, pid=os.getpid(), fd_pid=os.getpid(),
                  device=0, device_uuid=b"u" * 16, buffer_slot=1, buffer_serial=1,
                  segment_slot=0, segment_serial=0, offset=100, nbytes=1000,
                  alloc_bytes=3 * PAGE, page_bytes=PAGE, table="t", mem=b"", event=b"",
                  remote_fds=fds)
    handle = gpupool.IpcHandle(**fields, fds=[os.dup(fd) for fd in fds])
    received = ForkingPickler.loads(ForkingPickler.dumps(handle))
    assert received == handle
    assert [os.fstat(fd).st_ino for fd in received.fds] == [os.fstat(fd).st_ino for fd in fds]
    assert set(received.fds).isdisjoint(fds) and set(received.fds).isdisjoint(handle.fds)
    owned = received.fds
    del received
    gc.collect()
    for fd in owned:                            # the handle closed what it owned
        with pytest.raises(OSError):
            os.fstat(fd)
    # Relayed with plain pickle, a handle holding descriptors names them in this process.
    relayed = pickle.loads(pickle.dumps(ForkingPickler.loads(ForkingPickler.dumps(handle))))
    assert relayed.fd_pid == os.getpid()
    for fd in fds:
        os.close(fd)


@pytest.mark.gpu
@needs_cupy
def test_garbage_and_a_corrupted_driver_handle_are_refused_without_a_crash(server):
    reason, _ = server.refused("open", "x", b"\x00" * 200, {})
    assert reason == "malformed"
    pool = gpupool.Pool(device=0, upstream="driver")
    buf = pool.allocate(1000)
    fields = buf.ipc_handle().fields()
    fields["mem"] = bytes(64)                   # the slots are right, the driver's handle not
    reason, message = server.refused("open", "x", gpupool.IpcHandle(**fields), {})
    assert reason == "open_failed" and "driver refused" in message
    assert server.call("stats")["ipc"]["mappings"] == 0
