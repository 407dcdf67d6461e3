"""The GPU backend (jsdgpu.backend.Backend) over CuPy arrays: the steps every loss takes
(steps.py), the online loss's row work (online_work.py) and the top-k loss's (topk_work.py)."""

from .online_work import CudaOnlineRows
from .steps import CudaSteps
from .topk_work import CudaTopKRows


class CudaBackend(CudaSteps, CudaOnlineRows, CudaTopKRows):
    """Stateless: the chunk loop's steps as static methods, one instance per process
    (call.backend_for)."""
