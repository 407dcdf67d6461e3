"""How long does the host work before a step's first matrix product, and how long is the whole
step?

The GPU idles from the moment it has run what was queued until the first product is queued, so
the host time before that product is time the step loses. Answer (H200, 2026-12-02;
docs/design.md, "The host before the first product"): at T = 1024 with every row valid, where
the call is like the last (ahead.FirstProduct), 0.031-0.050 ms before the first product's
launch with each step queued behind the last and 0.037-0.086 after cudaDeviceSynchronize (three
machines), and 0.061-0.181 until it is queued (the launch itself: jsdgpu's gemm and
cublasLtMatmul's call through ctypes; --parts times pieces of it); with half the rows ignored,
where nothing is queued ahead of the selection, 0.14-0.18 ms before the launch.

    python experiments/host_time.py                 # T = 1024, all rows valid and half ignored
    python experiments/host_time.py --tokens 1024 8192 --valid 1 --capturable
    python experiments/host_time.py --valid 1 --parts --trace 3    # where that time goes
    python experiments/host_time.py --waits synchronize spin none  # after each kind of wait

Each step starts from an idle GPU (the device synchronized), as bench.py's steps do, unless
--waits says otherwise. The first product's launch and its return are marked by
jsdgpu.cuda.products.observing's callbacks.
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def wait_idle():
    import cupy
    cupy.cuda.Device().synchronize()


def wait_spinning():
    """Wait for an idle GPU with the host thread busy (polling), not blocked in the driver."""
    import cupy
    done = cupy.cuda.Event()
    done.record()
    while not done.done:
        pass


def no_wait():
    """The GPU still busy with the last step: the next is queued behind it, as in a training loop."""


WAITS = {"synchronize": wait_idle, "spin": wait_spinning, "none": no_wait}


def host_before_first_product(step, repeats, profile=None, wait=wait_idle):
    """(median host ms from the call to its first product's launch, and to that launch's return:
    the product queued), over repeats steps, each started after wait(); with a cProfile.Profile,
    the part before the launch profiled (and the times then include its cost)."""
    from jsdgpu.cuda import products
    times, queued = [], []
    for _ in range(repeats):
        marks = []

        def mark(m, n, k):
            if not marks:
                marks.append(time.perf_counter())
                if profile is not None:
                    profile.disable()

        def mark_queued(m, n, k):
            if len(marks) == 1:
                marks.append(time.perf_counter())
        wait()
        with products.observing(mark, mark_queued):
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            step()
        times.append(1e3 * (marks[0] - start))
        queued.append(1e3 * (marks[1] - start))
    return statistics.median(times), statistics.median(queued)


def trace_before_first_product(step, shortest_us):
    """One step's calls (Python and C) before its first product, from sys.setprofile: printed in
    order, indented by depth, each with its start and duration in µs where it took at least
    shortest_us (the tracer's own cost, about 1 µs a call, is in the times)."""
    import cupy
    from jsdgpu.cuda import products
    stack, calls, end = [], [], []

    def tracer(frame, event, arg):
        now = time.perf_counter_ns()
        if event in ("call", "c_call"):
            code = frame.f_code
            name = (f"{pathlib.Path(code.co_filename).name}:{code.co_name}" if event == "call"
                    else getattr(arg, "__qualname__", repr(arg)))
            stack.append(len(calls))
            calls.append([len(stack) - 1, name, now, None])
        elif stack:
            calls[stack.pop()][3] = now

    def mark(m, n, k):
        if not end:
            sys.setprofile(None)
            end.append(time.perf_counter_ns())
    cupy.cuda.Device().synchronize()
    with products.observing(mark):
        start = time.perf_counter_ns()
        sys.setprofile(tracer)
        step()
    sys.setprofile(None)
    for depth, name, t0, t1 in calls:
        took = ((t1 or end[0]) - t0) / 1e3
        if took >= shortest_us:
            print(f"{(t0 - start) / 1e3:8.1f} {took:7.1f}  {'  ' * depth}{name}")
    print(f"{(end[0] - start) / 1e3:8.1f}          the first product")


def time_parts(args, repeats=200):
    """Median µs of each piece of a default call's host work before its first product, each run
    alone (the pieces in the order the call takes them), then of launch_floor's: back to back,
    and each right after the host has waited for an idle GPU, as a step of this script or the
    benchmark starts."""
    import cupy

    from jsdgpu import call, checks, options
    from jsdgpu.ahead import HEAD_ROWS
    from jsdgpu.chunks import plan_chunks
    from jsdgpu.cuda import products
    from jsdgpu.cuda.backend import CudaBackend as B
    xs, ws, xt, wt, target = args
    arrays = dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt, target=target,
                  student_bias=None, teacher_bias=None)
    loss_opts, run_opts = options.split_options({})
    per_row = B.bytes_per_row(ws.shape[0], wt.shape[0], ws.dtype, True, True)
    most = plan_chunks(len(xs), None, *per_row, B.default_budget(0))[0]
    work = B.prepare(ws, wt, None, None, most, True)
    head = min(HEAD_ROWS, most)
    pieces = {
        "split_options": lambda: options.split_options({}),
        "bridge (none)": lambda: call._bridge_for(arrays),
        "check_arrays": lambda: checks.check_arrays(arrays),
        "runs_capturable": lambda: call.runs_capturable(run_opts, "cupy"),
        "ascontiguousarray x4": lambda: [cupy.ascontiguousarray(a) for a in (xs, ws, xt, wt)],
        "chunk plan": lambda: plan_chunks(len(xs), None, *B.bytes_per_row(ws.shape[0], wt.shape[0], ws.dtype,
                                                                           True, True), B.default_budget(0)),
        "prepare": lambda: B.prepare(ws, wt, None, None, most, True),
        "cupy.empty": lambda: cupy.empty(1 << 20, np.uint8),
        "student logits' product (launch)": lambda: products.logits(xs[:head], ws, work.logits_s[:head]),
        "select_rows (launch)": lambda: B.select_rows(target, ws.shape[0], -100),
        **launch_floor(xs, ws, work.logits_s[:head]),
    }
    print("| piece | µs back to back | µs after a wait |")
    print("| --- | --- | --- |")
    for name, piece in pieces.items():
        times = {False: [], True: []}
        for after_wait in (False, True):
            for _ in range(repeats):
                if after_wait:
                    cupy.cuda.Device().synchronize()
                start = time.perf_counter()
                piece()
                times[after_wait].append(1e6 * (time.perf_counter() - start))
            cupy.cuda.Device().synchronize()
        print(f"| {name} | {statistics.median(times[False]):.1f} | {statistics.median(times[True]):.1f} |")


def launch_floor(xs, ws, out):
    """Pieces below the library's own code, for the least a product's launch can cost from
    Python: cublasLtMatmul's call alone (through ctypes, its arguments made ahead: the algorithm
    and workspace of xs @ ws.T, as products.logits runs it), a CuPy slice, an empty kernel's
    launch, a CuPy allocation of 4 bytes (the logits products' workspace here)."""
    import ctypes

    import cupy

    from jsdgpu.cuda import products
    rows, (v, h) = len(xs), ws.shape
    products.logits(xs, ws, out)  # its shape's algorithm chosen
    types = (products._CUDA_TYPE[ws.dtype], products._CUDA_TYPE[xs.dtype], products._CUDA_TYPE[out.dtype])
    p = products._product(cupy.cuda.Device().id, products.T, products.N, v, rows, h, h, h, out.shape[1], *types,
                          False, products.WORKSPACE_BYTES)
    space = cupy.empty(max(p.workspace, 1), np.uint8)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    args = (p.handle, p.desc, ctypes.byref(alpha), ws.data.ptr, p.a_layout, xs.data.ptr, p.b_layout,
            ctypes.byref(beta), out.data.ptr, p.d_layout, out.data.ptr, p.d_layout, ctypes.byref(p.algo),
            space.data.ptr if p.workspace else None, p.workspace, cupy.cuda.get_current_stream().ptr)
    empty_kernel = cupy.RawKernel('extern "C" __global__ void nothing(float *a) {}', "nothing")
    return {"cublasLtMatmul's call alone": lambda: p.lib.cublasLtMatmul(*args),
            "a CuPy slice": lambda: xs[:rows],
            "an empty kernel's launch": lambda: empty_kernel((1,), (32,), (out,)),
            f"cupy.empty({p.workspace})": lambda: cupy.empty(p.workspace, np.uint8)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--valid", type=float, nargs="+", default=[1.0, 0.5], help="fractions of valid rows")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--capturable", action="store_true", help="the capturable mode (no host synchronization)")
    p.add_argument("--waits", nargs="+", choices=sorted(WAITS), default=["synchronize"],
                   help="how each step waits for the last: for an idle GPU blocked in the driver "
                        "(synchronize), polling (spin), or not at all (none: queued behind it)")
    p.add_argument("--profile", action="store_true",
                   help="also the host's time before the first product by function (cProfile)")
    p.add_argument("--trace", type=float, metavar="US",
                   help="also one step's calls before its first product that took at least US µs")
    p.add_argument("--parts", action="store_true",
                   help="also the time of each piece of that host work, each alone (a default call's)")
    a = p.parse_args()
    import harness  # needs the GPU: after --help
    import jsdgpu
    options = dict(capturable=True) if a.capturable else {}
    weights = harness.make_weights(1)
    print("| T | valid rows | options | wait | host ms before the first product's launch | "
          "... until it is queued | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for T in a.tokens:
        for valid in a.valid:
            args = harness.make_sets(T, weights, np.random.default_rng(1), valid)[0]

            def step():
                jsdgpu.backward(jsdgpu.forward(*args, **options)[1])
            for _ in range(3):
                step()
            ms = harness.time_ms(lambda i: step(), 1, 3, a.repeats)
            for wait in a.waits:
                host, queued = host_before_first_product(step, a.repeats, wait=WAITS[wait])
                print(f"| {T} | {valid:.0%} | {options or 'default'} | {wait} | {host:.3f} | {queued:.3f} "
                      f"| {ms:.3f} |")
            if a.parts:
                time_parts(args)
            if a.trace is not None:
                trace_before_first_product(step, a.trace)
            if a.profile:  # the host's work before the first product, by function
                import cProfile
                import pstats
                profile = cProfile.Profile()
                host_before_first_product(step, a.repeats, profile)
                pstats.Stats(profile).sort_stats("tottime").print_stats(40)
                pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
