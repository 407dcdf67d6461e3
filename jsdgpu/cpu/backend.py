"""The CPU backend (jsdgpu.backend.Backend) over NumPy arrays: the steps every loss takes
(steps.py), the online loss's row work (online_work.py) and the top-k loss's (topk_work.py)."""

from .online_work import CpuOnlineRows
from .steps import CpuSteps
from .topk_work import CpuTopKRows


class CpuBackend(CpuSteps, CpuOnlineRows, CpuTopKRows):
    """Stateless: the chunk loop's steps as static methods, one instance per process
    (call.backend_for)."""
