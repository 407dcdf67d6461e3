"""jsdgpu: the fused-linear Jensen-Shannon distillation loss, computed chunk by chunk from hidden
states and LM-head weights, on the GPU (CuPy) or the CPU (NumPy), without the full logits.

The data path: jsdgpu.api (forward, backward) -> jsdgpu.chunks (the chunk loop) -> a backend
(jsdgpu.cpu or jsdgpu.cuda: products and row kernels); jsdgpu.torch and jsdgpu.jax are the
framework front ends, jsdgpu.reference the float64 statement of the math (docs/contract.md).
"""

from .api import JSDDistillLoss, backward, forward
from .options import Divergence, LossOptions, RunOptions
from .reference import reference

__all__ = ["forward", "backward", "JSDDistillLoss", "LossOptions", "RunOptions", "Divergence",
           "reference"]
__version__ = "0.1.0"
