# cython: language_level=3, boundscheck=False, wraparound=False
"""The CUDA IPC export table: a file of shared memory made by the exporting process (in
``/dev/shm``, mode 0600, an exclusive ``flock`` held for its life, unlinked at exit) of 16-byte
slots (``src/gp_ipc.h``), which importers map to check a slot before they open a handle.

While an importer maps a segment it holds a read lock on the segment's slot (an
open-file-description lock: the kernel drops it when the process ends, even killed) and counts
itself in it (``count_opened``), so the exporter's ``collect`` (``ipc/export.pyx``) forgets the
count of an importer that died without closing: a count without a lock.
"""
from libc.errno cimport errno as c_errno
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from gpupool.records.ipcslot cimport gp_ipc_slot, gp_ipc_add_opened

import atexit
import fcntl
import glob
import os
import secrets
import struct
import tempfile
import threading

from gpupool.errors import IpcError

PREFIX = "gpupool-ipc-"

# This process's IPC state: the exporter's records (ipc/export.pyx) and the importer's tables
# and mappings (ipc/mapping.pyx).
lock = threading.RLock()


def _table_dir():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


cdef class Table:
    """An export table mapped in this process: the exporter's own (``own``) or another
    process's, opened to check and count its slots."""

    def __cinit__(self, str path, int fd, bint own):
        cdef void* base = mmap(NULL, table_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if base == MAP_FAILED:
            err = c_errno
            os.close(fd)
            raise OSError(err, f"mmap of the IPC export table {path}")
        self.path, self.fd, self.own, self.slots = path, fd, own, <gp_ipc_slot*>base

    def __dealloc__(self):
        # The exporter's own stays mapped for the process's life: buffers and segments that
        # die later (at interpreter shutdown, after this module) still write their slots.
        if self.slots != NULL and not self.own:
            munmap(self.slots, table_bytes())

    cdef gp_ipc_slot* slot(self, size_t index) except NULL:
        if index == 0 or index >= SLOTS:
            raise IpcError(f"not a gpupool IPC handle: slot {index} of a table of {SLOTS}",
                           "malformed")
        return &self.slots[index]

    cdef size_t index(self, gp_ipc_slot* slot) noexcept:
        return <size_t>(slot - self.slots)

    def alive(self):
        """Whether the exporting process still holds the table (its exclusive lock)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False


def remove_stale_tables(directory):
    """Unlink the tables of processes that died without their exit handler (no lock held)."""
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


cdef Table _make_own_table():
    directory = _table_dir()
    remove_stale_tables(directory)
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, table_bytes())
        fcntl.flock(fd, fcntl.LOCK_EX)          # held for life: importers see it alive
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    table = Table(path, fd, True)
    atexit.register(_unlink_own, path, os.getpid())
    return table


def _unlink_own(path, pid):
    # A fork() child inherits the handler: the table is its parent's, which still exports.
    if os.getpid() != pid:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


cdef Table _own = None          # this process's table, made at its first export
_own_pid = 0


cdef Table own_table():
    """This process's export table, made at the first call (and again in a forked child)."""
    global _own, _own_pid
    if _own is None or _own_pid != os.getpid():
        _own = _make_own_table()
        _own_pid = os.getpid()
    return _own


cdef Table current_own_table():
    """This process's export table if it made one (not a parent's, inherited), else None."""
    if _own is None or _own_pid != os.getpid():
        return None
    return _own


cdef Table made_own_table():
    """The last export table made in this process or its parent (None: none was made)."""
    return _own


_FLOCK = struct.Struct("hh4xqqi4x")    # struct flock (x86-64 and arm64 Linux)


def lock_slot(Table table, size_t index, bint lock):
    """Take (or drop) the importer's read lock on a slot's 16 bytes (F_OFD_SETLK)."""
    fcntl.fcntl(table.fd, fcntl.F_OFD_SETLK,
                _FLOCK.pack(fcntl.F_RDLCK if lock else fcntl.F_UNLCK, os.SEEK_SET,
                            index * sizeof(gp_ipc_slot), sizeof(gp_ipc_slot), 0))


def slot_locked(Table table, size_t index):
    """Whether some importer holds a lock on a slot (F_OFD_GETLK)."""
    found = fcntl.fcntl(table.fd, fcntl.F_OFD_GETLK,
                        _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, index * sizeof(gp_ipc_slot),
                                    sizeof(gp_ipc_slot), 0))
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def count_opened(Table table, size_t index):
    """Count this process in a segment's slot: its lock first (see the module's notes)."""
    lock_slot(table, index, True)
    _add_opened(table, index, 1)


def uncount_opened(Table table, size_t index):
    _add_opened(table, index, -1)
    lock_slot(table, index, False)


def _add_opened(Table table, size_t index, int delta):
    gp_ipc_add_opened(table.slot(index), delta)


_test_tables = {}


def _add_to_slot(path, size_t index, int delta):
    """For tests: what another process's mapping of a segment (+1) and its close (-1) do to a
    slot of this process's table, through a table opened as an importer opens it."""
    table = _test_tables.get(path)
    if table is None:
        table = _test_tables[path] = Table(path, os.open(path, os.O_RDWR | os.O_CLOEXEC), False)
    (count_opened if delta > 0 else uncount_opened)(table, index)
