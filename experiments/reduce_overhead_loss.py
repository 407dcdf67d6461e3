"""Does torch.compile(mode="reduce-overhead") (CUDA graphs by torch) of the loss alone work over
steps whose temperature changes, and then whose rows change?

Answer (one H100, 2026-12-06, a probe of these same steps before this script was written; not
yet diagnosed): no. The loss alone, compiled so, a new
temperature each step (1.0, 1.25, ...), T = 64 four times then 96 and 80, fresh inputs each step:
with "mean" the first step is right and every later one raises RuntimeError "Expected standard
deleter"; with "none" the first four raise "Detected 2 tensor(s) in the cudagraph pool not
tracked as outputs", T = 96 is right, and T = 80 raises "Expected standard deleter". Whole
training steps so compiled with fixed options pass (tests/test_torch.py::
test_compiled_reduce_overhead), as do the same steps under torch.compile's default mode
(test_compiled_steps_whose_rows_and_options_change). A lead, from torch's source: CUDA-graph
trees checkpoint their pool's state (torch._C._cuda_setCheckpointPoolState, in
torch/_inductor/cudagraph_trees.py) and expect every live storage in it to have the caching
allocator's standard deleter; the operator's outputs (the loss, its parts, the gradients) are
views of CuPy arrays on torch's raw allocations (jsdgpu/torch_bridge.py, from_native), whose
deleters are not that one. Outputs made in torch.empty buffers (api.backward's out=, as
jsdgpu.jax writes into XLA's) would be.

    python experiments/reduce_overhead_loss.py
    python experiments/reduce_overhead_loss.py --fixed     # the same temperature every step

Each step against the float64 reference: the loss's largest error and grad_input's relative one.
"""

import argparse
import pathlib
import sys
import warnings

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixed", action="store_true", help="the same temperature every step")
    a = p.parse_args()
    import torch

    import jsdgpu
    from conftest import make_case
    from jsdgpu.torch import FusedLinearJSDLoss
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target")
    for reduction in ("mean", "none"):
        torch._dynamo.reset()
        module = FusedLinearJSDLoss(reduction=reduction)
        step = torch.compile(lambda *args: module(*args), mode="reduce-overhead")
        for i, T in enumerate((64, 64, 64, 64, 96, 80)):
            module.temperature = 1.0 if a.fixed else 1.0 + 0.25 * i
            case = make_case(rng, T=T, bias=False)
            ts = [torch.from_numpy(case[n]).cuda() for n in names]
            ts[0].requires_grad_(True), ts[1].requires_grad_(True)
            try:
                out = step(*ts)
                out.sum().backward()
            except RuntimeError as e:
                print(reduction, i, T, "raised", str(e).splitlines()[0], flush=True)
                continue
            want = jsdgpu.reference(**{n: case[n] for n in names}, reduction=reduction,
                                    temperature=module.temperature,
                                    grad_output=None if reduction == "mean" else np.ones(T))
            err = np.abs(out.detach().cpu().numpy() - want[0]).max()
            g = np.linalg.norm(ts[0].grad.cpu().numpy() - want[3]) / np.linalg.norm(want[3])
            print(reduction, i, T, f"loss error {err:.1e}, grad_input {g:.1e}", flush=True)


if __name__ == "__main__":
    main()
