"""The parts of ``gpupool.testing.SimulatedDevice``, one concept a module: the call log and
byte counts (``base``), streams and events (``streams``), virtual memory
(``virtual_memory``), memory other processes can map (``sharing``), and the libc calls that
map host memory (``host``). ``gpupool.testing`` assembles them; import the device from there.
"""
