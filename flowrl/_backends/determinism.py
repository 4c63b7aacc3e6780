"""torch's deterministic algorithms in a replica or trainer process (``PipelineConfig.deterministic``).

Called before the model's ``setup()``: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when CUDA
initialises, so it is set first (a model already on CUDA keeps what it had). torch is
imported only here and only when asked: flowrl runs without torch. The setting is
process-wide: in process (backend ``"inprocess"``) it holds for the whole driver process.
"""

from __future__ import annotations

import importlib.util
import os

# cuBLAS's fixed workspace: without it, deterministic algorithms refuse cuBLAS calls on CUDA >= 10.2
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_torch() -> bool:
    """Turn torch's deterministic algorithms on in this process; False when torch is absent."""
    if importlib.util.find_spec("torch") is None:
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    import torch

    torch.use_deterministic_algorithms(True)
    # cuDNN picks its algorithms by timing them unless told not to
    torch.backends.cudnn.benchmark = False
    return True
