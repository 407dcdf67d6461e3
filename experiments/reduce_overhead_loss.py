"""Does torch.compile(mode="reduce-overhead") (CUDA graphs by torch) of the loss alone work over
steps whose temperature changes, and then whose rows change?

Answer (one H100, 2026-12-06, the code of 9801c5a): yes, every step within float32 of the float64
reference, with "mean" and "none" (T = 64 four times then 96 and 80, fresh inputs, a new
temperature each step); tests/test_torch.py::test_loss_alone_compiled_with_cuda_graphs, the same
steps and more, passes on the code since (1ec7806, its "none" operators outside the graphs).
Before, "mean" raised RuntimeError "Expected standard deleter" from its second step on, and
"none" "Detected 2 tensor(s) in the cudagraph pool not tracked as outputs" at each step of 64
rows (those of 96 and 80 rows, symbolic, take another operator): CUDA-graph trees take
over the storage of a graph's outputs, which must be the caching allocator's own blocks (the
operators' outputs were views of CuPy arrays, with DLPack's deleter), and refuse a live block of
their pool that no output holds (the rows operator's count of valid rows, a CPU tensor, made
Inductor's partition return the operator's whole output tuple, its unused parts with it).
docs/design.md, "The front ends", says what changed.

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
