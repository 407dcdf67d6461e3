"""jsdgpu: the fused-linear Jensen-Shannon distillation loss, computed chunk by chunk from hidden
states and LM-head weights, on the GPU (CuPy) or the CPU (NumPy), without the full logits."""

from ._api import JSDDistillLoss, backward, forward
from .reference import reference

__all__ = ["forward", "backward", "JSDDistillLoss", "reference"]
__version__ = "0.1.0"
