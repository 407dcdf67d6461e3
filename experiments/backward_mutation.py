"""Could compiled backward skip its multiply by grad_output where grad_output is 1?

jsdgpu.torch's operator computes the gradients for grad_output 1 in forward; compiled backward
multiplies them by grad_output, a pass over grad_weight (docs/design.md, "The front ends"). A
skip would be a custom operator that scales the saved gradients in place unless grad_output is 1.
This builds that pattern on toy operators of its own (forward returns the loss and its
gradients; backward mutates the saved gradients, then returns them), compiles a step with
torch.compile, and prints Inductor's backward code: whether the mutation runs on the saved
buffers, and whether a copy of them is left beside it (a kernel that loads and stores every
element: a pass as long as the multiply it would spare). Runs on the CPU (Inductor's C++
backend); the graph passes are the same on the GPU.

    python experiments/backward_mutation.py

Answer (torch 2.14, this repository's CI kind of machine, 2026-12-04): the mutation is put on
the saved buffers, and a kernel that copies each of them onto itself is left before it, so the
pass is not spared (docs/design.md, "The front ends").
"""

import argparse


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch
    from torch import Tensor
    from torch._inductor.utils import run_and_get_code

    @torch.library.custom_op("backward_mutation::loss", mutates_args=())
    def loss(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ones = torch.ones(x.shape[0], w.shape[0])
        return (x @ w.T).sum(), ones @ w, ones.T @ x

    @loss.register_fake
    def _(x, w):
        return x.new_empty(()), torch.empty_like(x), torch.empty_like(w)

    @torch.library.custom_op("backward_mutation::scale_unless_one_", mutates_args=("gx", "gw"))
    def scale_unless_one_(gx: Tensor, gw: Tensor, g: Tensor) -> None:
        if float(g) != 1.0:
            gx.mul_(g)
            gw.mul_(g)

    @scale_unless_one_.register_fake
    def _(gx, gw, g):
        return None

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])

    def backward(ctx, grad, *unused):
        gx, gw = ctx.saved_tensors
        scale_unless_one_(gx, gw, grad)
        return gx, gw

    loss.register_autograd(backward, setup_context=setup)
    step = torch.compile(lambda x, w: loss(x, w)[0], fullgraph=True)
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)

    def train_step():
        (3.0 * step(x, w)).backward()
    _, codes = run_and_get_code(train_step)
    want = 3.0 * torch.ones(8, 32).T @ x.detach()
    print("gradients right:", torch.allclose(w.grad, want))
    code = codes[-1]  # the backward's
    body = code[code.index("def call(self, args):"):]
    print(body[:body.index("return")].rstrip())
    copies = [line for line in code.splitlines() if ".store(in_out_ptr" in line]
    print(f"\nkernels' in-place stores in the backward: {len(copies)} (a copy of a saved gradient onto itself each)")


if __name__ == "__main__":
    main()
