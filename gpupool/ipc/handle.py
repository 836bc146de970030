"""The CUDA IPC handle of a gpupool buffer: its fields, its bytes, and how it pickles.

An :class:`IpcHandle` names the upstream allocation a block lives in and the block's place in
it. It packs into a few hundred bytes (``to_bytes`` / ``from_bytes``: a magic number, a
version, the fields and a CRC-32, so garbage is refused, never trusted). Virtual-memory pages
("posix_fd" handles) are named by file descriptors, which only the kernel can carry from one
process to another:

* pickled by ``multiprocessing`` (a ``Queue``, a ``Pipe``, a ``Pool``'s arguments, a spawned
  ``Process``'s arguments), each descriptor travels with ``multiprocessing.reduction.DupFd``
  (``SCM_RIGHTS`` over a Unix socket, or the spawn's own descriptor passing): the reducer is
  registered with ``multiprocessing.reduction.ForkingPickler``;
* pickled with plain ``pickle`` (or sent as ``to_bytes()``), only the descriptors' numbers in
  the process that held them travel; the importer fetches them from that process with
  ``pidfd_getfd`` (Linux 5.6+, and permission to trace it: same user and a permissive
  ``kernel.yama.ptrace_scope``, or ``CAP_SYS_PTRACE``), and says why when it cannot.
"""

import binascii
import os
import struct
from multiprocessing import reduction

from gpupool.errors import IpcError

__all__ = ["IpcHandle"]

MAGIC = b"GPIH"
VERSION = 1
KINDS = ("mem_handle", "posix_fd")
_HEAD = struct.Struct("<4sHBBqqi16sQQQQQQQQ")   # magic .. page_bytes
_LEN = struct.Struct("<H")
_COUNT = struct.Struct("<I")
_FD = struct.Struct("<i")
_CRC = struct.Struct("<I")
_MAX_FIELD = 4096                   # bytes of a variable field (a path, a driver handle)
_MAX_FDS = 1 << 20                  # descriptors of one handle (pages of one buffer)

# The fields, in order, with what they hold; to_bytes packs them all.
FIELDS = (
    "kind",             # "mem_handle" (cuIpcGetMemHandle) or "posix_fd" (one fd per page)
    "simulated",        # host memory of gpupool.testing.SimulatedDevice
    "pid",              # the exporting process
    "fd_pid",           # the process whose descriptors remote_fds numbers (posix_fd)
    "device",           # the device's ordinal in the exporting process
    "device_uuid",      # the device's UUID (16 bytes), the same in every process
    "buffer_slot",      # the exported buffer's slot in the exporter's export table ...
    "buffer_serial",    # ... and the serial it had then
    "segment_slot",     # the upstream allocation's slot (mem_handle), 0 for posix_fd ...
    "segment_serial",   # ... and its serial
    "offset",           # bytes from the allocation's (or first page's) start to the buffer
    "nbytes",           # bytes of the buffer
    "alloc_bytes",      # bytes of the allocation, or of the pages
    "page_bytes",       # posix_fd: bytes of a page; else 0
    "table",            # path of the exporter's export table (shared memory)
    "mem",              # mem_handle: the driver's handle of the allocation; else b""
    "event",            # the IPC event's handle (b"": none to wait for)
    "remote_fds",       # posix_fd: the page descriptors' numbers in process fd_pid
)


class IpcHandle:
    """What another process needs to open a gpupool buffer: ``gpupool.open_ipc(handle)``.

    Made by ``DeviceBuffer.ipc_handle()``; picklable (see the module's notes on file
    descriptors) and convertible to bytes (``to_bytes``, ``IpcHandle.from_bytes``).

    Attributes
    ----------
    kind : str
        ``"mem_handle"``: the driver's handle of one ``cuMemAlloc`` allocation (upstream
        "driver"), opened with ``cuIpcOpenMemHandle``; ``"posix_fd"``: one file descriptor
        per virtual-memory page (upstream "vmm"), imported with
        ``cuMemImportFromShareableHandle`` and mapped.
    pid : int
        The exporting process.
    device : int
        The device's ordinal in the exporting process (``CUDA_VISIBLE_DEVICES`` may number
        it otherwise elsewhere: ``device_uuid`` names it everywhere).
    device_uuid : bytes
        16 bytes, ``cuDeviceGetUuid``.
    offset : int
        Bytes from the start of the upstream allocation (or of the first page) to the
        buffer's memory.
    nbytes : int
        Bytes of the buffer.
    alloc_bytes : int
        Bytes of the upstream allocation (or of the pages) that the handle maps.
    simulated : bool
        Host memory of a ``gpupool.testing.SimulatedDevice``.
    """

    __slots__ = (*FIELDS, "_fds", "__weakref__")

    def __init__(self, **fields):
        missing = set(FIELDS) - set(fields)
        unknown = set(fields) - set(FIELDS) - {"fds"}
        if missing or unknown:
            raise TypeError(f"IpcHandle needs the fields {', '.join(FIELDS)}; missing "
                            f"{sorted(missing)}, unknown {sorted(unknown)}")
        for name in FIELDS:
            object.__setattr__(self, name, fields[name])
        object.__setattr__(self, "remote_fds", tuple(self.remote_fds))
        # Descriptors this object owns (closed with it): the pages' in this process.
        object.__setattr__(self, "_fds", tuple(fields.get("fds", ())))

    def __setattr__(self, name, value):
        raise AttributeError("an IpcHandle is immutable")

    def __del__(self):
        for fd in getattr(self, "_fds", ()):
            try:
                os.close(fd)
            except (OSError, TypeError):    # TypeError: os is gone at shutdown
                pass

    @property
    def fds(self):
        """The page descriptors this process holds (posix_fd), owned by the handle."""
        return self._fds

    def fields(self):
        """The fields as a dict (the descriptors this process holds left out)."""
        return {name: getattr(self, name) for name in FIELDS}

    def __eq__(self, other):
        return isinstance(other, IpcHandle) and self.fields() == other.fields()

    def __hash__(self):
        return hash(self.to_bytes())

    def __repr__(self):
        return (f"<gpupool.IpcHandle {self.kind} pid={self.pid} device={self.device} "
                f"offset={self.offset} nbytes={self.nbytes}"
                f"{' simulated' if self.simulated else ''}>")

    # Bytes ---------------------------------------------------------------------------

    def to_bytes(self):
        """The handle as bytes (``from_bytes`` reads them back). A "posix_fd" handle's
        descriptors do not travel in bytes: the importer fetches them from ``fd_pid``."""
        head = _HEAD.pack(MAGIC, VERSION, KINDS.index(self.kind), int(bool(self.simulated)),
                          self.pid, self.fd_pid, self.device, self.device_uuid,
                          self.buffer_slot, self.buffer_serial, self.segment_slot,
                          self.segment_serial, self.offset, self.nbytes, self.alloc_bytes,
                          self.page_bytes)
        parts = [head]
        for field in (self.table.encode(), self.mem, self.event):
            parts += [_LEN.pack(len(field)), field]
        parts.append(_COUNT.pack(len(self.remote_fds)))
        parts += [_FD.pack(fd) for fd in self.remote_fds]
        body = b"".join(parts)
        return body + _CRC.pack(binascii.crc32(body))

    @classmethod
    def from_bytes(cls, data):
        """The handle that ``to_bytes`` packed.

        Raises
        ------
        IpcError
            ``data`` is not a gpupool IPC handle (reason "malformed"): wrong magic, version,
            length or checksum, or fields that contradict each other.
        TypeError
            ``data`` is not bytes-like.
        """
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise TypeError(f"an IPC handle is an IpcHandle or its bytes, not "
                            f"{type(data).__name__}") from None
        if len(data) < _HEAD.size + _CRC.size or data[:4] != MAGIC:
            raise _malformed("it does not start with a gpupool IPC handle's magic number"
                             if data[:4] != MAGIC else f"{len(data)} bytes are too few")
        body, (crc,) = data[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
        if binascii.crc32(body) != crc:
            raise _malformed("its checksum does not match (corrupted or truncated)")
        (_, version, kind, flags, pid, fd_pid, device, uuid, buffer_slot, buffer_serial,
         segment_slot, segment_serial, offset, nbytes, alloc_bytes,
         page_bytes) = _HEAD.unpack_from(body)
        if version != VERSION:
            raise _malformed(f"it is of version {version}; this gpupool reads {VERSION}")
        if kind >= len(KINDS) or flags > 1:
            raise _malformed(f"unknown kind {kind} or flags {flags}")
        pos, fields = _HEAD.size, []
        for _ in range(3):
            if pos + _LEN.size > len(body):
                raise _malformed("it ends inside its fields")
            (n,), pos = _LEN.unpack_from(body, pos), pos + _LEN.size
            fields.append(body[pos:pos + n])
            pos += n
        if pos + _COUNT.size > len(body):
            raise _malformed("it ends inside its fields")
        (nfds,), pos = _COUNT.unpack_from(body, pos), pos + _COUNT.size
        if pos + nfds * _FD.size != len(body):
            raise _malformed("its length does not match its fields")
        fds = tuple(_FD.unpack_from(body, pos + i * _FD.size)[0] for i in range(nfds))
        try:
            table = fields[0].decode()
        except UnicodeDecodeError:
            raise _malformed("its export table's path is not text") from None
        handle = cls(kind=KINDS[kind], simulated=bool(flags), pid=pid, fd_pid=fd_pid,
                     device=device, device_uuid=uuid, buffer_slot=buffer_slot,
                     buffer_serial=buffer_serial, segment_slot=segment_slot,
                     segment_serial=segment_serial, offset=offset, nbytes=nbytes,
                     alloc_bytes=alloc_bytes, page_bytes=page_bytes, table=table,
                     mem=fields[1], event=fields[2], remote_fds=fds)
        handle.check()
        return handle

    def check(self):
        """Raise ``IpcError`` (reason "malformed") if the fields contradict each other."""
        problems = []
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r}")
        if not (isinstance(self.device_uuid, bytes) and len(self.device_uuid) == 16):
            problems.append("a device UUID that is not 16 bytes")
        if self.pid <= 0 or self.device < 0:
            problems.append(f"pid {self.pid} or device {self.device}")
        if self.nbytes <= 0 or self.offset + self.nbytes > self.alloc_bytes:
            problems.append(f"{self.nbytes} B at offset {self.offset} of {self.alloc_bytes} B")
        if self.buffer_slot <= 0 or not self.table:
            problems.append("no export slot")
        if self.kind == "mem_handle" and (not self.mem or self.segment_slot <= 0
                                          or self.remote_fds):
            problems.append("a memory handle without the driver's handle or its segment")
        if self.kind == "posix_fd" and (
                self.page_bytes <= 0 or len(self.remote_fds) > _MAX_FDS
                or self.alloc_bytes != self.page_bytes * len(self.remote_fds)
                or self.offset >= self.page_bytes or self.mem):
            problems.append(f"{len(self.remote_fds)} pages of {self.page_bytes} B for "
                            f"{self.alloc_bytes} B at offset {self.offset}")
        if any(len(f) > _MAX_FIELD for f in (self.table.encode(), self.mem, self.event)):
            problems.append("a field over 4 KiB")
        if problems:
            raise _malformed("; ".join(problems))

    # Pickling ------------------------------------------------------------------------

    def __reduce__(self):
        # Plain pickle: bytes only. A posix_fd handle whose descriptors this process holds
        # names them here, for pidfd_getfd.
        data = self._with_fd_holder().to_bytes()
        return IpcHandle.from_bytes, (data,)

    def _with_fd_holder(self):
        """This handle, or for one holding its pages' descriptors here, a copy naming them
        (fd_pid: this process)."""
        if not self._fds or self.fd_pid == os.getpid():
            return self             # the exporter's own: its export keeps remote_fds open
        fields = self.fields()
        fields.update(fd_pid=os.getpid(), remote_fds=self._fds)
        return IpcHandle(**fields)


def _malformed(why):
    return IpcError(f"not a gpupool IPC handle: {why}", "malformed")


def _reduce_for_multiprocessing(handle):
    """ForkingPickler's reduction: the page descriptors travel as DupFd objects (descriptor
    passing), each detached once by the receiving process."""
    fds = handle._fds or ()
    return _rebuild_with_fds, (handle.to_bytes(), [reduction.DupFd(fd) for fd in fds])


def _rebuild_with_fds(data, dupfds):
    fields = IpcHandle.from_bytes(data).fields()
    fds = [dup.detach() for dup in dupfds]
    return IpcHandle(**fields, fds=fds)


reduction.register(IpcHandle, _reduce_for_multiprocessing)
