"""torch.multiprocessing under gpupool.torch (GPU, marked gpu): tensors of gpupool memory
sent to another process under each way of using gpupool's allocator and PyTorch's, one fresh
interpreter a scenario (tests/ipc/ipc_torch_child.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ipc_peers import UPSTREAMS, needs_cupy, needs_memfd

TORCH_CHILD = Path(__file__).resolve().parent / "ipc_torch_child.py"

pytestmark = needs_memfd


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("upstream_name", UPSTREAMS)
@pytest.mark.parametrize("scenario", ["use-native", "mempool-native", "use-use", "mempool-use",
                                      "native-use", "resend"])
def test_torch_multiprocessing_shares_tensors_of_gpupool_memory(scenario, upstream_name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    proc = subprocess.run([sys.executable, str(TORCH_CHILD), scenario], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "GPUPOOL_UPSTREAM": upstream_name})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    if scenario == "native-use":    # PyTorch's own handle, received under use(): said so
        assert result["error"][0] == "IpcError" and "mempool() here" in result["error"][1]
    elif scenario == "resend":
        assert result["error"][0] == "IpcError" and "clone it first" in result["error"][1]
    else:
        assert result["error"] is None and result["checks"] == [True] * 4, result
