"""What a bug report needs: versions, the CUDA driver and devices, gpupool's settings, whether
its allocator for PyTorch is built, its pools.

``python -m gpupool`` prints it. Inside a program, ``print(gpupool.diagnose.report())`` also
shows the status of every default pool that program made. Nothing here makes a pool; the driver
is asked through ``cuda.bindings.driver`` (the free memory of a device needs its primary
context, which is retained for the question and released). Without a driver the report says
so in one line and goes on with what does not need one. Where PyTorch is installed it is
imported (which starts no CUDA work) to tell which allocator ``gpupool.torch.use()`` would install.
"""

import argparse
import contextlib
import io
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata

import gpupool
from gpupool.limits import _VARIABLES as _LIMIT_VARIABLES
from gpupool.limits import parse_limit
from gpupool.stats import format_bytes

__all__ = ["Device", "Facts", "describe_limit", "format_report", "gather", "main", "report",
           "torch_allocator_state"]

LIMIT_VARIABLES = tuple(_LIMIT_VARIABLES.values())     # as the pool reads them
UPSTREAM_VARIABLE = "GPUPOOL_UPSTREAM"
MAGAZINES_VARIABLE = "GPUPOOL_MAGAZINES"  # "0": no per-thread magazines (read at import)
TORCH_ALLOCATOR_VARIABLE = "GPUPOOL_TORCH_ALLOCATOR"  # "pluggable": gpupool.torch.use() skips it
DEFAULT_UPSTREAM = "vmm"             # "driver" on a device without virtual memory management
# Installed distributions worth naming in a report, when present (never imported).
FRAMEWORKS = ("cupy-cuda13x", "cupy-cuda12x", "numba-cuda", "torch", "jax", "scikit-learn")
_NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"
_NAME_LENGTH = 256  # bytes for cuDeviceGetName


@dataclass
class Device:
    """One CUDA device as the driver reports it (bytes)."""

    ordinal: int
    name: str
    total_bytes: int
    free_bytes: int | None = None  # None: not read; ``problem`` says why
    problem: str = ""


@dataclass
class Facts:
    """Everything the report shows, gathered by :func:`gather` (or made up, in tests).

    Attributes
    ----------
    versions : list of (str, str)
        ``(what, version)``: gpupool, Python, cuda-bindings, NumPy, in that order.
    frameworks : list of (str, str)
        Other installed distributions of :data:`FRAMEWORKS` and their versions.
    driver_problem : str or None
        Why there is no driver or no device, one line; None when the driver answered.
    driver_version : str or None
        The kernel module's version (``/proc/driver/nvidia/version``), None where unknown.
    cuda_version : int or None
        ``cuDriverGetVersion``: 1000 * major + 10 * minor, the newest CUDA the driver runs.
    devices : list of Device
    environment : dict of str to str
        The values of ``GPUPOOL_UPSTREAM``, ``GPUPOOL_HARD_LIMIT``, ``GPUPOOL_SOFT_LIMIT``,
        ``GPUPOOL_MAGAZINES`` and ``GPUPOOL_TORCH_ALLOCATOR`` that are set (an empty value
        counts as unset, as for the pool).
    torch_allocator : str
        Whether gpupool's allocator for PyTorch is built, and why not
        (:func:`torch_allocator_state`).
    pools : list of (int, str)
        ``(device, text)``: each default pool's ``repr`` and ``gpupool.pool_status()``.
    """

    versions: list
    frameworks: list = field(default_factory=list)
    driver_problem: str | None = None
    driver_version: str | None = None
    cuda_version: int | None = None
    devices: list = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    torch_allocator: str = ""
    pools: list = field(default_factory=list)


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


def _version(distribution):
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _kernel_module_version():
    try:
        with open(_NVIDIA_VERSION_FILE) as f:
            # "... x86_64 Kernel Module  580.65.06  ..." or "... Open Kernel Module for x86_64
            # 580.159.04  Release Build ...": the first dotted number after "Kernel Module".
            match = re.search(r"Kernel Module\b.*?\s(\d+(?:\.\d+)+)\s", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


class _DriverError(Exception):
    """A driver call failed; the message names the call and the error."""


def _check(cu, call, *args):
    """``call(*args)``'s results after the error code; _DriverError when it failed."""
    err, *results = call(*args)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise _DriverError(f"{call.__name__} failed: {getattr(err, 'name', err)}")
    return results[0] if len(results) == 1 else tuple(results)


def _free_bytes(cu, dev):
    """Free bytes on ``dev``, read with its primary context current for the question."""
    ctx = _check(cu, cu.cuDevicePrimaryCtxRetain, dev)
    try:
        _check(cu, cu.cuCtxPushCurrent, ctx)
        try:
            free, _total = _check(cu, cu.cuMemGetInfo)
        finally:
            _check(cu, cu.cuCtxPopCurrent)
    finally:
        _check(cu, cu.cuDevicePrimaryCtxRelease, dev)
    return free


def _probe_driver(facts, cu):
    """Fill the driver's and the devices' part of ``facts`` from ``cu``, a
    ``cuda.bindings.driver``; on any failure, ``driver_problem`` says which."""
    try:
        (err,) = cu.cuInit(0)
    except RuntimeError as exc:  # cuda-bindings cannot load libcuda
        facts.driver_problem = (f"none (libcuda cannot be loaded: {_one_line(exc)}); gpupool "
                                "needs one, or gpupool.testing.SimulatedDevice as the upstream")
        return
    try:
        facts.cuda_version = _check(cu, cu.cuDriverGetVersion)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise _DriverError(f"cuInit failed: {getattr(err, 'name', err)}")
        for ordinal in range(_check(cu, cu.cuDeviceGetCount)):
            dev = _check(cu, cu.cuDeviceGet, ordinal)
            name = _check(cu, cu.cuDeviceGetName, _NAME_LENGTH, dev)
            device = Device(ordinal, name.split(b"\0", 1)[0].decode(errors="replace"),
                            _check(cu, cu.cuDeviceTotalMem, dev))
            try:
                device.free_bytes = _free_bytes(cu, dev)
            except _DriverError as exc:
                device.problem = str(exc)
            facts.devices.append(device)
    except _DriverError as exc:
        facts.driver_problem = str(exc)
    if not facts.devices and facts.driver_problem is None:
        facts.driver_problem = "the driver reports no CUDA device"


def _pool_texts(pools):
    """``(device, text)`` for each pool of ``{device: Pool}``: its repr and its status."""
    texts = []
    for device, pool in sorted(pools.items()):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                gpupool.pool_status(pool=pool)
        except Exception as exc:  # noqa: BLE001 -- a report shows what it cannot read
            out.write(f"status unavailable: {_one_line(exc)}\n")
        texts.append((device, f"{pool!r}\n{out.getvalue().rstrip()}"))
    return texts


def torch_allocator_state(torch=None):
    """One line on gpupool's allocator for PyTorch (``gpupool.torch.use()``): built (where),
    still to be compiled on the first ``use()``, or why it cannot be built here.

    Parameters
    ----------
    torch : module, optional
        PyTorch; default: imported where it is installed.

    Returns
    -------
    str
        Also when PyTorch is missing or cannot be imported (then saying so). Never raises
        for a missing prerequisite.
    """
    if torch is None:
        if _version("torch") is None:
            return "PyTorch is not installed"
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 -- a report shows what it cannot read
            return f"PyTorch cannot be imported ({_one_line(exc)})"
    from gpupool.adapters import torch_allocator

    return torch_allocator.state(torch)


def gather(environ=None, driver=None, pools=None, torch=None):
    """Collect the facts of this process and machine.

    Parameters
    ----------
    environ : mapping, optional
        Default: ``os.environ``.
    driver : module, optional
        Default: ``cuda.bindings.driver``.
    pools : dict of int to Pool, optional
        Default: gpupool's default pools (``gpupool._pools``).
    torch : module, optional
        Default: PyTorch, imported where it is installed (see :func:`torch_allocator_state`).

    Returns
    -------
    Facts
    """
    environ = os.environ if environ is None else environ
    facts = Facts(versions=[
        ("gpupool", gpupool.__version__),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()}, "
                   f"{sys.executable}) on {platform.platform()}"),
        ("cuda-bindings", _version("cuda-bindings") or "not installed"),
        ("NumPy", _version("numpy") or "not installed"),
    ])
    facts.frameworks = [(name, v) for name in FRAMEWORKS if (v := _version(name))]
    facts.environment = {name: environ[name] for name in (UPSTREAM_VARIABLE, *LIMIT_VARIABLES,
                                                          MAGAZINES_VARIABLE,
                                                          TORCH_ALLOCATOR_VARIABLE)
                         if environ.get(name)}
    if driver is None:
        from cuda.bindings import driver
    _probe_driver(facts, driver)
    if facts.cuda_version is not None:
        facts.driver_version = _kernel_module_version()
    facts.torch_allocator = torch_allocator_state(torch)
    facts.pools = _pool_texts(gpupool._pools if pools is None else pools)
    return facts


class _NoDevice(Exception):
    pass


def describe_limit(raw, device_totals):
    """A limit variable's value, raw and in bytes, as the pool would read it.

    Parameters
    ----------
    raw : str
        The variable's value, e.g. ``"8GiB"`` or ``"50%"``.
    device_totals : list of int
        Total bytes of each device, by ordinal: a percentage is resolved for each.

    Returns
    -------
    str
        ``'8GiB' = 8589934592 B (8.000 GiB)``; for a percentage, the bytes on every device;
        for a malformed value, parse_limit's message. Never raises for a bad value.
    """
    def resolve(total):
        def device_total():
            if total is None:
                raise _NoDevice
            return total

        nbytes = parse_limit(raw, device_total)
        return f"{nbytes} B ({format_bytes(nbytes)})"

    try:
        if raw.strip().endswith("%"):
            if not device_totals:
                resolve(None)
            return f"{raw!r} = " + ", ".join(
                f"{resolve(total)} on device {i}" for i, total in enumerate(device_totals))
        return f"{raw!r} = {resolve(None)}"
    except _NoDevice:
        return f"{raw!r}: a share of each device's memory (no device here to resolve it)"
    except (TypeError, ValueError) as exc:
        return f"{raw!r}: the pool refuses it: {_one_line(exc)}"


def describe_upstream(raw):
    """``GPUPOOL_UPSTREAM``'s value, and whether ``Pool`` accepts it."""
    from gpupool.core.upstreams import UPSTREAMS as _UPSTREAMS

    if raw in _UPSTREAMS:
        return repr(raw)
    return f"{raw!r}: the pool refuses it: must be one of {', '.join(_UPSTREAMS)}"


def format_report(facts):
    """The report's text for ``facts`` (see :class:`Facts`), lines ending in newlines."""
    lines = [f"{what} {version}" for what, version in facts.versions]
    if facts.frameworks:
        lines.append("Also installed: " + ", ".join(f"{n} {v}" for n, v in facts.frameworks))
    if facts.cuda_version is not None:
        major, minor = facts.cuda_version // 1000, facts.cuda_version % 1000 // 10
        lines.append(f"CUDA driver {facts.driver_version or '(version unknown)'}, CUDA "
                     f"{major}.{minor} (cuDriverGetVersion: {facts.cuda_version})")
    if facts.driver_problem is not None:
        lines.append(f"CUDA driver: {facts.driver_problem}")
    for d in facts.devices:
        free = (f"{format_bytes(d.free_bytes)} free" if d.free_bytes is not None
                else f"free memory unknown ({d.problem})")
        lines.append(f"Device {d.ordinal}: {d.name}, {format_bytes(d.total_bytes)} total, {free}")
    upstream = facts.environment.get(UPSTREAM_VARIABLE)
    lines.append(f"Upstream: {describe_upstream(upstream)} ({UPSTREAM_VARIABLE})"
                 if upstream else
                 f"Upstream: {DEFAULT_UPSTREAM!r} (the default; {UPSTREAM_VARIABLE} is not set)")
    totals = [d.total_bytes for d in facts.devices]
    for name in LIMIT_VARIABLES:
        raw = facts.environment.get(name)
        lines.append(f"{name}: " + ("not set" if raw is None else describe_limit(raw, totals)))
    if facts.environment.get(MAGAZINES_VARIABLE, "").strip() == "0":
        lines.append(f"Magazines: off ({MAGAZINES_VARIABLE}=0)")
    else:
        lines.append(f"Magazines: on (the default; {MAGAZINES_VARIABLE} is not 0)")
    choice = facts.environment.get(TORCH_ALLOCATOR_VARIABLE)
    lines.append(f"gpupool's allocator for PyTorch: {facts.torch_allocator}" + (
        f" ({TORCH_ALLOCATOR_VARIABLE}={choice!r}: use() takes the pluggable allocator)"
        if choice == "pluggable" else ""))
    if not facts.pools:
        lines.append("Pools: none made in this process")
    for device, text in facts.pools:
        lines.append(f"Pool of device {device}:")
        lines += [f"  {line}" for line in text.splitlines()]
    return "".join(f"{line}\n" for line in lines)


def report():
    """The report of this process and machine, as text; see :func:`gather`."""
    return format_report(gather())


def main(argv=None):
    """``python -m gpupool``: print the report; the exit status, 0."""
    argparse.ArgumentParser(
        prog="python -m gpupool",
        description="Print what a gpupool bug report needs: versions, the CUDA driver and "
                    "devices, gpupool's environment variables, whether its allocator for "
                    "PyTorch is built, its pools.",
    ).parse_args(argv)
    sys.stdout.write(report())
    return 0
