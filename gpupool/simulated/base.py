"""What every part of the simulated device shares: the log of its simulated driver calls, the
failures injected into them, the misuses it saw, and its byte counts."""

from gpupool.simulated.failures import Failures, cuda_error


class SimulatedBase:
    """The call log, the injected failures, the misuses and the byte counts of a
    ``SimulatedDevice`` (see its Attributes: ``calls``, ``failures``, ``errors``, ``used``,
    ``device_bytes``, ``peak_device_bytes``)."""

    def _init_base(self, failures=None):
        self.used = self.device_bytes = self.peak_device_bytes = 0
        self.calls = []
        self.errors = []
        self.inject(failures)

    def inject(self, failures):
        """Make simulated driver calls fail as ``failures`` says (a
        ``gpupool.simulated.failures.Failures``, replacing the one before); None: no call
        fails any more. Returns ``failures``, whose ``injected`` lists what failed.

        Raises
        ------
        TypeError
            ``failures`` is neither a ``Failures`` nor None.
        """
        if failures is not None and not isinstance(failures, Failures):
            raise TypeError(f"inject takes a gpupool.testing.Failures or None, got "
                            f"{type(failures).__name__}")
        self.failures = failures
        return failures

    def _called(self, name, args):
        """Log the simulated driver call ``name(*args)``; raise its injected failure, if any
        (before the call has any effect, as a failed driver call has none)."""
        self.calls.append((name, args))
        self._fail(name, args)

    def _fail(self, name, args):
        """Raise the injected failure of a call or step ``name`` (not logged), if any."""
        if self.failures is not None:
            self.failures.check(name, args)

    def calls_named(self, name):
        """The arguments of every call named ``name``, in order."""
        return [args for call, args in self.calls if call == name]

    def _misuse(self, what, code=None):
        """Log the misuse ``what`` in ``errors`` and raise it: as the driver's ``CudaError``
        of ``code`` where the driver path raises that status for it (a ``CUresult``
        value), else as a ValueError."""
        self.errors.append(what)
        if code is not None:
            raise cuda_error(code, f"simulated device: {what}")
        raise ValueError(f"simulated device: {what}")

    def _count(self, nbytes, rounded):
        self.used += nbytes
        self.device_bytes += rounded
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
