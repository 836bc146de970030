"""Allocation traces: what a program allocated and freed, in order, to replay through allocators.

A trace is a sequence of events ``(op, id, nbytes, stream)``: ``op`` is ``ALLOC`` (0) or
``FREE`` (1); ``id`` names the allocation (ids are numbered 0, 1, 2... in the order of their
allocations); ``nbytes`` is the size requested (a free repeats its allocation's); ``stream`` is
a small stream index (0 is the legacy default stream, 1, 2... other streams in the order the
program first used them; a free repeats its allocation's stream). Allocations still live at the
end of a trace (parameters, optimizer state) are simply never freed.

Saved as a compressed NumPy file (``.npz``: arrays ``op``, ``id``, ``nbytes``, ``stream`` and a
JSON string ``meta``), a few hundred KiB for a few training steps. Made by
``record_trace.py`` from PyTorch's memory history (:func:`from_snapshot`), or made up on any
machine by :func:`synthetic` (a training-like pattern, for tests without a GPU).
"""

import json
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

ALLOC, FREE = 0, 1
FORMAT = 1
TRACE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "traces")
MAX_STREAMS = 256

# PyTorch memory history actions that end an allocation (free_requested: the tensor died;
# free_completed: the block may be reused, after the streams that used it are done; older
# releases wrote "free").
_FREE_ACTIONS = ("free_requested", "free_completed", "free")


@dataclass
class Trace:
    """A validated allocation trace (see the module docstring for its events).

    Parameters
    ----------
    name : str
    op, ids, nbytes, stream : array-like of int
        One entry per event.
    meta : dict
        JSON-serializable facts about the trace (source, model, steps, versions...).

    Raises
    ------
    ValueError
        The events are not a valid trace (see :meth:`validate`).
    """

    name: str
    op: np.ndarray
    ids: np.ndarray
    nbytes: np.ndarray
    stream: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.op = np.asarray(self.op, dtype=np.uint8)
        self.ids = np.asarray(self.ids, dtype=np.int64)
        self.nbytes = np.asarray(self.nbytes, dtype=np.int64)
        self.stream = np.asarray(self.stream, dtype=np.int64)
        self.validate()
        self.stream = self.stream.astype(np.uint8)

    def __len__(self):
        return len(self.op)

    def validate(self):
        """Check the events; raise ValueError naming the first bad one.

        Every allocation has a new id (numbered in order), a size > 0 and a stream index in
        ``[0, 256)``; every free names a live allocation and repeats its size and stream.
        """
        n = len(self.op)
        if not all(len(a) == n for a in (self.ids, self.nbytes, self.stream)):
            raise ValueError("op, ids, nbytes and stream must have the same length")
        live = {}
        next_id = 0
        for k, (op, i, nbytes, s) in enumerate(self._rows()):
            if op == ALLOC:
                if i != next_id:
                    raise ValueError(f"event {k}: allocation id {i}, expected {next_id}")
                if nbytes <= 0 or not 0 <= s < MAX_STREAMS:
                    raise ValueError(f"event {k}: allocation of {nbytes} B on stream {s}")
                live[i] = (nbytes, s)
                next_id += 1
            elif op == FREE:
                if live.pop(i, None) != (nbytes, s):
                    raise ValueError(f"event {k}: free of id {i} ({nbytes} B, stream {s}) "
                                     "matches no live allocation")
            else:
                raise ValueError(f"event {k}: op {op} is neither ALLOC (0) nor FREE (1)")

    def _rows(self):
        return zip(self.op.tolist(), self.ids.tolist(), self.nbytes.tolist(),
                   self.stream.tolist(), strict=True)

    def events(self, streams=None):
        """The events as a list of ``(op, id, nbytes, stream)`` Python ints, for a replay loop.

        Parameters
        ----------
        streams : sequence, optional
            What each stream index becomes (``streams[index]``: a handle, a stream object);
            default: the index itself.
        """
        if streams is None:
            return list(self._rows())
        return [(op, i, n, streams[s]) for op, i, n, s in self._rows()]

    @property
    def num_allocs(self):
        return int(np.count_nonzero(self.op == ALLOC))

    @property
    def num_streams(self):
        """Stream indices used: the largest index + 1 (0 for an empty trace)."""
        return int(self.stream.max()) + 1 if len(self) else 0

    def live_bytes(self):
        """Bytes live after each event (requested sizes, no rounding): an int64 array."""
        return np.cumsum(np.where(self.op == ALLOC, self.nbytes, -self.nbytes))

    def peak_live_bytes(self):
        """The most bytes live at once (requested sizes): what an allocator that wastes
        nothing would reserve."""
        return int(self.live_bytes().max(initial=0))

    def summary(self):
        """Counts and sizes for reports (JSON-serializable)."""
        live = self.live_bytes()
        return {"events": len(self), "allocations": self.num_allocs,
                "streams": self.num_streams, "peak_live_bytes": int(live.max(initial=0)),
                "live_at_end_bytes": int(live[-1]) if len(live) else 0,
                "allocated_bytes": int(self.nbytes[self.op == ALLOC].sum())}


def first_steps(trace, n):
    """The first ``n`` steps of ``trace``: its events before ``meta["step_starts"][n]`` (all
    of them when it has ``n`` steps), what a run of ``n`` steps records; the last step's
    tails (freed in the step that would follow) stay live at its end. Its meta is the
    trace's, with ``step_starts`` cut to ``n`` and ``steps`` set to ``n``.

    Raises
    ------
    TypeError
        ``n`` is not an integer (a bool is not one).
    ValueError
        ``trace`` has no ``meta["step_starts"]``, or ``n`` is not from 1 to its steps.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an integer number of steps, got {n!r}")
    starts = trace.meta.get("step_starts")
    if not starts:
        raise ValueError(f"{trace.name}: no step starts (meta['step_starts']) to cut at")
    if not 1 <= n <= len(starts):
        raise ValueError(f"{trace.name}: n must be from 1 to its {len(starts)} steps, got {n}")
    end = starts[n] if n < len(starts) else len(trace)
    meta = dict(trace.meta, step_starts=list(starts[:n]), steps=int(n))
    return Trace(trace.name, trace.op[:end], trace.ids[:end], trace.nbytes[:end],
                 trace.stream[:end], meta=meta)


class _Builder:
    """Collects events with fresh ids; used by the converters and the synthetic trace."""

    def __init__(self):
        self.rows, self._live, self._next = [], {}, 0

    def alloc(self, nbytes, stream=0):
        """Append an allocation; returns its id."""
        i = self._next
        self._next += 1
        self._live[i] = (nbytes, stream)
        self.rows.append((ALLOC, i, nbytes, stream))
        return i

    def free(self, i):
        """Append the free of allocation ``i``."""
        nbytes, stream = self._live.pop(i)
        self.rows.append((FREE, i, nbytes, stream))

    def trace(self, name, meta):
        cols = list(zip(*self.rows, strict=True)) if self.rows else [(), (), (), ()]
        return Trace(name, *cols, meta=meta)


# Files -------------------------------------------------------------------------------------

def save(trace, path):
    """Write ``trace`` to ``path`` (``.npz``, compressed), creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = dict(trace.meta, name=trace.name, format=FORMAT)
    with open(path, "wb") as f:
        np.savez_compressed(f, op=trace.op, id=trace.ids.astype(np.uint32),
                            nbytes=trace.nbytes, stream=trace.stream,
                            meta=np.array(json.dumps(meta, sort_keys=True)))


def load(path):
    """Read a trace written by :func:`save`.

    Raises
    ------
    ValueError
        Not a trace file of this format, or invalid events.
    """
    with np.load(path, allow_pickle=False) as data:
        missing = {"op", "id", "nbytes", "stream", "meta"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: not an allocation trace (missing {sorted(missing)})")
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: trace format {meta.get('format')}, expected {FORMAT}")
        name = meta.pop("name", os.path.splitext(os.path.basename(path))[0])
        meta.pop("format")
        return Trace(name, data["op"], data["id"], data["nbytes"], data["stream"], meta=meta)


def find(folder=TRACE_DIR):
    """Paths of the ``.npz`` files in ``folder``, sorted; [] when it does not exist."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".npz"))


# Sources -----------------------------------------------------------------------------------

def from_snapshot(snapshot, name, device=0, meta=None):
    """Convert PyTorch's memory history into a trace.

    Parameters
    ----------
    snapshot : dict
        ``torch.cuda.memory._snapshot()`` taken while ``_record_memory_history`` was on: its
        ``device_traces[device]`` is a list of entries with ``action``, ``addr``, ``size``
        (for ``alloc`` and ``free_requested``: the size requested) and ``stream`` (the
        ``cudaStream_t`` as an int; 0 is the legacy default stream).
    name : str
    device : int
        Device ordinal whose history to take.
    meta : dict, optional
        Extra facts for the trace's ``meta``.

    Returns
    -------
    Trace
        An allocation is freed at its first ``free_requested`` (the tensor's death; later
        ``free_completed`` entries of it are ignored) or, if none came, ``free_completed``.
        Segment actions (the allocator's own ``cudaMalloc`` calls) are left out. Frees of
        blocks allocated before recording began are left out and counted in
        ``meta["unmatched_frees"]``.

    Raises
    ------
    ValueError
        Two live allocations at one address, or more than 256 streams.
    """
    builder, live, streams, unmatched = _Builder(), {}, {0: 0}, 0
    actions = Counter()
    for k, entry in enumerate(snapshot["device_traces"][device]):
        action = entry["action"]
        actions[action] += 1
        if action == "alloc":
            addr = entry["addr"]
            if addr in live:
                raise ValueError(f"history entry {k}: alloc at {addr:#x}, which is live")
            stream = streams.setdefault(int(entry["stream"]), len(streams))
            if stream >= MAX_STREAMS:
                raise ValueError(f"history entry {k}: more than {MAX_STREAMS} streams")
            live[addr] = builder.alloc(int(entry["size"]), stream)
        elif action in _FREE_ACTIONS:
            i = live.pop(entry["addr"], None)
            if i is not None:
                builder.free(i)
            elif action != "free_completed":
                unmatched += 1
    info = {"source": "torch.cuda.memory._snapshot", "history_entries": sum(actions.values()),
            "actions": dict(sorted(actions.items())), "unmatched_frees": unmatched,
            "stream_handles": sorted(streams, key=streams.get)}
    return builder.trace(name, dict(meta or {}, **info))


def without_markers(trace, marker_nbytes):
    """The trace without its marker allocations (those of exactly ``marker_nbytes``, which a
    recording program makes at the start of each step) and their frees; the index of the
    first event after each marker is listed in ``meta["step_starts"]``."""
    builder, ids, starts = _Builder(), {}, []
    for op, i, nbytes, stream in trace.events():
        if nbytes == marker_nbytes:
            if op == ALLOC:
                starts.append(len(builder.rows))
            continue
        if op == ALLOC:
            ids[i] = builder.alloc(nbytes, stream)
        else:
            builder.free(ids.pop(i))
    return builder.trace(trace.name, dict(trace.meta, step_starts=starts))


def synthetic(steps=4, layers=6, seed=0, name="synthetic"):
    """A made-up training-like trace, for tests and for runs before real ones are recorded.

    Parameters: ``layers`` weights (16 KiB to 4 MiB, kept to the end), then ``steps`` steps
    of: a data batch (4 MiB, on stream 1, as a loader's copy would be); a forward pass that
    keeps one activation per layer (256 KiB to 8 MiB) and frees a temporary per layer; a
    backward pass in reverse that allocates each weight's gradient and passes an input
    gradient down, freeing the layer's activation; an Adam-like optimizer (two state buffers
    per weight from the first step on, a temporary per weight); the gradients freed at the
    step's end (``zero_grad(set_to_none=True)``). The same sizes every step; some are not
    multiples of 512. Deterministic for a given ``seed``.

    Returns
    -------
    Trace
    """
    rng = np.random.default_rng(seed)

    def sizes(lo, hi):
        return [int(x) for x in rng.integers(lo, hi, size=layers)]

    weights, acts = sizes(16 << 10, 4 << 20), sizes(256 << 10, 8 << 20)
    b = _Builder()
    params = [b.alloc(w) for w in weights]
    state = []
    for _ in range(steps):
        batch = b.alloc(4 << 20, stream=1)
        saved = []
        for a in acts:
            tmp = b.alloc(a // 2 + 100)
            saved.append(b.alloc(a))
            b.free(tmp)
        loss = b.alloc(4)
        grads, grad_in = [], b.alloc(acts[-1])
        for layer in reversed(range(layers)):
            grads.append(b.alloc(weights[layer]))
            grad_out, grad_in = grad_in, b.alloc(acts[layer])
            b.free(grad_out)
            b.free(saved[layer])
        for i in (grad_in, loss, batch):
            b.free(i)
        if not state:
            state = [b.alloc(w) for w in weights for _ in range(2)]
        for w in weights:
            b.free(b.alloc(w))
        for g in grads:
            b.free(g)
    del params, state                   # live to the end, as a model's would be
    return b.trace(name, {"source": "synthetic", "steps": steps, "layers": layers,
                          "seed": seed})
