"""jsdgpu: the fused-linear Jensen-Shannon distillation loss, computed chunk by chunk from hidden
states and LM-head weights, on the GPU (CuPy) or the CPU (NumPy), without the full logits.

The data path: jsdgpu.api (forward; backward from jsdgpu.call) -> jsdgpu.engine (the chunk loop, its
plan jsdgpu.chunks and its head jsdgpu.ahead) running a loss (jsdgpu.online) -> a backend (jsdgpu.cpu
or jsdgpu.cuda: products and row kernels); jsdgpu.torch and jsdgpu.jax are the
framework front ends, jsdgpu.reference the float64 statement of the math (docs/contract.md).
jsdgpu.topk is offline distillation: the loss against a teacher's stored top-k log-probabilities,
another loss of the same engine, and the teacher's top-k made chunk by chunk.
"""

from .api import JSDDistillLoss, backward, forward
from .options import Divergence, LossOptions, RunOptions, TopKOptions
from .reference import reference, reference_topk
from .topk import TopKDistillLoss, forward_topk, teacher_topk

__all__ = ["forward", "backward", "JSDDistillLoss", "LossOptions", "RunOptions", "Divergence",
           "reference", "forward_topk", "TopKDistillLoss", "TopKOptions", "teacher_topk", "reference_topk"]
__version__ = "0.1.0"
