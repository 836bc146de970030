"""What every part of the simulated device shares: the log of its simulated driver calls, the
misuses it saw, and its byte counts."""


class SimulatedBase:
    """The call log, the misuses and the byte counts of a ``SimulatedDevice`` (see its
    Attributes: ``calls``, ``errors``, ``used``, ``device_bytes``, ``peak_device_bytes``)."""

    def _init_base(self):
        self.used = self.device_bytes = self.peak_device_bytes = 0
        self.calls = []
        self.errors = []

    def calls_named(self, name):
        """The arguments of every call named ``name``, in order."""
        return [args for call, args in self.calls if call == name]

    def _misuse(self, what):
        self.errors.append(what)
        raise ValueError(f"simulated device: {what}")

    def _count(self, nbytes, rounded):
        self.used += nbytes
        self.device_bytes += rounded
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
