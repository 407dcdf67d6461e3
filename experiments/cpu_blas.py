"""Which CPU BLAS is faster here: NumPy's (as a large call of the CPU backend takes it, split over
jsdgpu's threads with OpenBLAS on one thread) or torch's (MKL in PyTorch's x86 wheels), on the
three product shapes of a step at T = 512, V = 128256, hidden 256, and the trial product by which
the torch front end chooses (jsdgpu.cpu.products.numpy_is_faster; docs/design.md, "The CPU
backend").

    python experiments/cpu_blas.py
"""

import argparse
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jsdgpu.cpu import products  # noqa: E402
from jsdgpu.torch_bridge import _torch_matmul  # noqa: E402


def best_ms(fn, a, b, out, repeats=5):
    fn(a, b, out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a, b, out)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    # logits [T, H] @ [H, V]; grad_weight's [V, T] @ [T, H]; grad_input's [T, V] @ [V, H]
    shapes = {"logits": (512, 256, 128256), "grad_weight": (128256, 512, 256), "grad_input": (512, 128256, 256),
              "trial": products.TRIAL_SHAPE}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (m, k, n) in shapes.items():
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        out = np.empty((m, n), np.float32)
        numpy = best_ms(products._CallProducts().matmul, a, b, out)
        by_torch = best_ms(_torch_matmul, a, b, out)
        print(f"{name:12s} [{m}, {k}] @ [{k}, {n}]: NumPy {numpy:.1f} ms, torch {by_torch:.1f} ms, "
              f"NumPy ÷ torch {numpy / by_torch:.2f}")
    start = time.perf_counter()
    faster = products.numpy_is_faster(_torch_matmul)
    print(f"the trial: NumPy's {'faster' if faster else 'not faster'}, {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
