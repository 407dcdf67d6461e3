"""Where does the PyTorch front end's eager step spend the time the CuPy call does not?

Answer (H200, 2026-12-02; docs/design.md, "The front ends"): with the custom operator run
eagerly, in its dispatch and autograd rule: host time before the first product (0.56-0.65 ms
against the CuPy call's 0.07-0.17) and, in backward, GPU idle while autograd ran the operator's
Python rule (0.31 and 0.36 ms, profiled), for a step 0.9-1.3 ms longer at T = 1024; not torch's
allocator (no cudaMalloc or cudaFree in the timed steps). The eager step now goes through an
autograd Function and a pointer bridge: 4.52-4.80 ms against the CuPy call's 4.42-4.45 in the
same runs. With ignored rows that change from step to step (--ignored 0 0.4 0.1 0.3 0.2 0.35
--turns; 2026-12-04): the module 1.077-1.102 times the CuPy call at T = 1024 in four runs, then
1.044 and 1.042 with its host path cut (docs/design.md, "The front ends"); 1.00 at T = 8192.
Compiled (--tokens 1024 8192 --ignored 0 0.4 0.1 0.3 0.2 0.35 --turns --profile): 1.155 and
1.021 times the CuPy call (the module 1.064 and 0.997), its host 0.85 ms before the first
product (module 0.66, CuPy call 0.42). What sparing backward's multiply by grad_output would
gain: docs/design.md, "The front ends".

This times, on the same inputs, the step taken apart:

- cupy: jsdgpu.forward + jsdgpu.backward on CuPy arrays;
- bridged: the same on torch tensors (the bridge, torch's stream and allocator);
- bridged_grad: the same on the student's tensors as the module gets them (requiring a gradient);
- op: the custom operator called directly, its gradients computed (no autograd);
- module: FusedLinearJSDLoss, loss.backward(), the gradients dropped (as bench.py's step);
- compiled: the same module under torch.compile(fullgraph=True).

For each: the step's median ms by CUDA events, the host's ms before the first product, and
torch's count of cudaMalloc / cudaFree calls over the timed steps. --profile: one cupy, one module
and one compiled step under torch's profiler, their GPU idle gaps and their slowest CUDA runtime
calls.

    python experiments/torch_step.py --tokens 1024 8192
    python experiments/torch_step.py --tokens 1024 --profile
    python experiments/torch_step.py --parts        # the bridge's pieces alone
    python experiments/torch_step.py --ignored 0 0.4 0.1 0.3 --allocations  # a module step's, by site
    python experiments/torch_step.py --ignored 0 0.4 0.1 0.3 --profile   # other ignored rows each step
    python experiments/torch_step.py --ignored 0 0.4 0.1 0.3 --turns     # module ÷ CuPy call, in turns
    python experiments/torch_step.py --ignored 0 0.4 0.1 0.3 --first-product  # the host's Python before it

--first-product (2026-12-04): the bridge (tensor views, the stream block) and the module's own
path were most of what the module's host adds before the first product; with the block made
lighter, the module's host reached it 0.15 ms sooner, and the module took 1.045 times the CuPy
call in turns against 1.058 before (docs/design.md, "The front ends").
"""

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def variants(sets):
    import torch

    import jsdgpu
    import jsdgpu.torch as jtorch
    from harness import _torch_sets
    tsets = _torch_sets(sets, True)

    def cupy_step(i):
        loss, ctx = jsdgpu.forward(*sets[i])
        jsdgpu.backward(ctx)

    def bridged(i):
        xs, ws, xt, wt, target = tsets[i]
        loss, ctx = jsdgpu.forward(xs.detach(), ws.detach(), xt, wt, target)
        jsdgpu.backward(ctx)

    def bridged_grad(i):  # the student's tensors as the module gets them (requiring a gradient)
        xs, ws, xt, wt, target = tsets[i]
        loss, ctx = jsdgpu.forward(xs, ws, xt, wt, target)
        jsdgpu.backward(ctx)

    def op(i):
        xs, ws, xt, wt, target = tsets[i]
        with torch.no_grad():
            torch.ops.jsdgpu.fused_linear_jsd(xs, ws, xt, wt, target, None, None, 0.5, 0.5, 0.5, 1.0, -100, None,
                                              None, True, None, None, "mean", None, 1.0, 1.0, None, None)

    loss_fn = jtorch.FusedLinearJSDLoss()

    def module(i):
        xs, ws, xt, wt, target = tsets[i]
        loss_fn(xs, ws, xt, wt, target).backward()
        xs.grad = ws.grad = None

    compiled_fn = torch.compile(loss_fn, fullgraph=True)

    def compiled(i):
        xs, ws, xt, wt, target = tsets[i]
        compiled_fn(xs, ws, xt, wt, target).backward()
        xs.grad = ws.grad = None
    return dict(cupy=cupy_step, bridged=bridged, bridged_grad=bridged_grad, op=op, module=module, compiled=compiled)


def measure(fn, n_sets, repeats):
    """(median step ms by events, median host ms before the first product, cudaMalloc calls,
    cudaFree calls) over repeats steps, each from an idle GPU."""
    import cupy
    import torch

    from jsdgpu.cuda import products
    for i in range(2 * n_sets + 1):  # the products' classes tuned (experiments/first_steps.py: two rounds)
        fn(i % n_sets)
    cupy.cuda.Device().synchronize()
    stats0 = torch.cuda.memory_stats()
    steps, hosts = [], []
    for i in range(repeats):
        marks = []
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        with products.observing(lambda *_: marks or marks.append(time.perf_counter())):
            t0 = time.perf_counter()
            start.record()
            fn(i % n_sets)
            stop.record()
        stop.synchronize()
        steps.append(cupy.cuda.get_elapsed_time(start, stop))
        hosts.append(1e3 * (marks[0] - t0))
    stats1 = torch.cuda.memory_stats()
    counts = [stats1.get(k, 0) - stats0.get(k, 0) for k in ("num_device_alloc", "num_device_free")]
    return statistics.median(steps), statistics.median(hosts), *counts


def in_turns(this, other, n_sets, rounds=48):
    """The two steps timed in turns (ABBA, one step each from an idle GPU, the sets rotating as
    the rounds go): (median ms of this, of other, and the median, first and third quartiles of
    this / other per round)."""
    import cupy
    for i in range(2 * n_sets + 1):
        this(i % n_sets), other(i % n_sets)
    ours, theirs = [], []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for r in range(rounds):
        for fn, times in ((this, ours), (other, theirs))[::1 if r % 2 == 0 else -1]:
            cupy.cuda.Device().synchronize()
            start.record()
            fn(r % n_sets)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    ratios = sorted(x / y for x, y in zip(ours, theirs))
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios), ratios[rounds // 4], \
        ratios[3 * rounds // 4]


def profile(fn, out_dir, tag):
    """One step under torch's profiler: the GPU's busy time, its gaps over 20 µs (with the
    kernels around them), and the CUDA runtime calls that took over 50 µs."""
    import torch
    from torch.profiler import ProfilerActivity
    fn(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(1)
        torch.cuda.synchronize()
    if out_dir:
        prof.export_chrome_trace(str(pathlib.Path(out_dir) / f"torch_step_{tag}.json"))
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    span = gpu[-1].time_range.end - gpu[0].time_range.start
    print(f"  {tag}: {len(gpu)} GPU events, busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span")
    for a, b in zip(gpu, gpu[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 20:
            print(f"    gap {gap:7.1f} µs after {a.name[:50]} ({(a.time_range.end - a.time_range.start):.0f} µs)"
                  f", before {b.name[:50]}")
    for e in gpu:
        if e.time_range.end - e.time_range.start > 100:
            print(f"    kernel {(e.time_range.end - e.time_range.start):8.1f} µs  {e.name[:80]}")
    slow = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")
            and e.time_range.end - e.time_range.start > 50]
    for e in slow:
        print(f"    runtime {(e.time_range.end - e.time_range.start):8.1f} µs  {e.name}")


def host_profile(fn, n_sets, tag, steps=30):
    """The host's Python over `steps` steps under cProfile: the functions of most own time, and of
    most time with their callees (torch's profiler shows the GPU's gaps, not whose Python made
    them)."""
    import cProfile
    import pstats
    for i in range(3):
        fn(i % n_sets)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        fn(i % n_sets)
    profiler.disable()
    print(f"  {tag}: host profile of {steps} steps")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(45)


def host_to_first_product(fns, n_sets, names=("cupy", "bridged", "module"), steps=30):
    """Each step's Python from its start to its first product's queuing, under cProfile (which
    stops there), for each of names: its total and its functions of most time with their callees,
    then, for each name against the one before it, the functions whose own time differs most (per
    step; the profiler's own cost a call included)."""
    import cProfile
    import pstats

    import cupy

    from jsdgpu.cuda import products
    own = {}
    for name in names:
        fn = fns[name]
        for i in range(2 * n_sets + 1):
            fn(i % n_sets)
        profiler = cProfile.Profile()
        for i in range(steps):
            cupy.cuda.Device().synchronize()
            stopped = []
            with products.observing(lambda *_: stopped or (profiler.disable(), stopped.append(1))):
                profiler.enable()
                fn(i % n_sets)
            profiler.disable()
        own[name] = {f"{pathlib.Path(f[0]).name}:{f[1]}:{f[2]}": (v[2] / steps * 1e6, v[1] / steps, v[3] / steps * 1e6)
                     for f, v in pstats.Stats(profiler).stats.items()}
        print(f"  {name}: {sum(v[0] for v in own[name].values()):.1f} µs of Python a step before the first product"
              f" (profiled), {sum(v[1] for v in own[name].values()):.0f} calls; most µs with callees:")
        for k, v in sorted(own[name].items(), key=lambda kv: -kv[1][2])[:25]:
            print(f"    {v[2]:8.1f}  own {v[0]:7.1f}  calls {v[1]:5.1f}  {k}")
    for a, b in zip(names, names[1:]):
        keys = sorted(set(own[a]) | set(own[b]), key=lambda k: -abs(own[b].get(k, (0,))[0] - own[a].get(k, (0,))[0]))
        print(f"  own µs a step, {b} against {a} (the largest differences):")
        for k in keys[:20]:
            x, y = own[a].get(k, (0, 0, 0)), own[b].get(k, (0, 0, 0))
            print(f"    {y[0] - x[0]:+8.1f}  {x[0]:7.1f} -> {y[0]:7.1f}  calls {x[1]:5.1f} -> {y[1]:5.1f}  {k}")


def bridge_parts(repeats=200):
    """Median µs of the bridge's pieces, each alone, back to back: a [1024, 2048] bf16 tensor
    viewed by CuPy through DLPack and by jsdgpu.torch.to_native, a 0-d CuPy array viewed by
    torch through DLPack (from_native), the block that puts CuPy on torch's stream and
    allocator (current_stream) entered and left, and 4 KiB of device memory allocated and freed
    three ways."""
    import cupy
    import torch

    import jsdgpu.torch as jtorch
    from jsdgpu.torch_bridge import _torch_memory  # the allocator the bridge installs for a call
    t = torch.randn(1024, 2048, device="cuda").to(torch.bfloat16)
    a = cupy.zeros((), cupy.float32)
    with jtorch.current_stream(t):
        in_torch = cupy.zeros((), cupy.float32)  # in torch's memory, as a call's arrays are

    def stream_block():
        with jtorch.current_stream(t):
            pass

    def empty_in_torch():
        with jtorch.current_stream(t):
            start = time.perf_counter()
            cupy.empty(1024, cupy.float32)
            return time.perf_counter() - start
    pool = cupy.get_default_memory_pool()
    pieces = {"cupy.from_dlpack(tensor)": lambda: cupy.from_dlpack(t.detach()),
              "to_native(tensor)": lambda: jtorch.to_native(t),
              "from_native(0-d array)": lambda: jtorch.from_native(a),
              "from_native(0-d array in torch's memory)": lambda: jtorch.from_native(in_torch),
              "current_stream(tensor) block": stream_block,
              "4 KiB from CuPy's pool, freed": lambda: pool.malloc(4096),
              "4 KiB from torch for CuPy (the bridge's allocator), freed": lambda: _torch_memory(t.device.index, 4096),
              "4 KiB as a uint8 tensor, freed": lambda: torch.empty(4096, dtype=torch.uint8, device=t.device),
              "cupy.empty of 4 KiB from CuPy's pool, freed": lambda: cupy.empty(1024, cupy.float32),
              "cupy.empty of 4 KiB inside current_stream (from torch), freed": empty_in_torch}
    print("| piece | µs |")
    print("| --- | --- |")
    for name, piece in pieces.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            inside = piece()  # a float: the piece timed itself (inside the block it needs)
            times.append(1e6 * (inside if isinstance(inside, float) else time.perf_counter() - start))
        print(f"| {name} | {statistics.median(times):.1f} |")


def allocations(fn, n_sets):
    """Each allocation one step of fn makes through torch's allocator (the bridge's
    _torch_memory, seen by a profile hook): its bytes and the jsdgpu lines that made it, in order
    (after 2 steps of each set, so that no product is tuned in it)."""
    from jsdgpu.torch_bridge import _torch_memory
    for i in range(2 * n_sets):
        fn(i % n_sets)
    made = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is _torch_memory.__code__:
            sites, f = [], frame.f_back
            while f is not None and len(sites) < 3:
                if "/jsdgpu/" in f.f_code.co_filename:
                    sites.append(f"{f.f_code.co_filename.split('/jsdgpu/')[-1]}:{f.f_lineno}")
                f = f.f_back
            made.append((frame.f_locals["nbytes"], " <- ".join(sites)))
    sys.setprofile(hook)
    try:
        fn(0)
    finally:
        sys.setprofile(None)
    print(f"  {len(made)} allocations through torch's allocator in one step:")
    for nbytes, site in made:
        print(f"    {nbytes:>11d} B  {site}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", help="a folder for the profiles' traces")
    p.add_argument("--parts", action="store_true", help="also the bridge's pieces, each timed alone")
    p.add_argument("--turns", action="store_true",
                   help="the module, then the compiled module, and the CuPy call in turns, step by step")
    p.add_argument("--host-profile", action="store_true",
                   help="the cupy, module and compiled steps' Python under cProfile")
    p.add_argument("--first-product", action="store_true",
                   help="the cupy, bridged and module steps' Python before the first product, function by function")
    p.add_argument("--allocations", action="store_true",
                   help="a module step's allocations through torch's allocator, by size and site")
    p.add_argument("--ignored", type=float, nargs="+",
                   help="the sets' shares of ignored rows, one set each (a run's: 0 0.4 0.1 0.3)")
    args = p.parse_args()
    if args.parts:
        bridge_parts()
    import cupy

    from harness import make_sets, make_weights
    weights = make_weights(2)
    rng = __import__("numpy").random.default_rng(0)
    rows, turns = [], []
    for T in args.tokens:
        sets = make_sets(T, weights, rng) if args.ignored is None else [
            s for k, f in enumerate(args.ignored) for s in make_sets(T, weights[k % 2:][:1], rng, 1 - f)]
        fns = variants(sets)
        for name, fn in fns.items():
            rows.append((T, name, *measure(fn, len(sets), args.repeats)))
        for name in ("module", "compiled") if args.turns else ():
            ms, cupy_ms, ratio, low, high = in_turns(fns[name], fns["cupy"], len(sets))
            turns.append(f"| {T} | {name} | {ms:.3f} | {cupy_ms:.3f} | {ratio:.3f} ({low:.3f}-{high:.3f}) |")
        for name in ("cupy", "module", "compiled"):
            if args.profile:
                profile(fns[name], args.out, f"{name}_{T}")
            if args.host_profile:
                host_profile(fns[name], len(sets), f"{name}_{T}")
        if args.allocations:
            allocations(fns["module"], len(sets))
        if args.first_product:
            host_to_first_product(fns, len(sets))
        del sets, fns
        cupy.get_default_memory_pool().free_all_blocks()
    print("| T | step | ms (events) | host ms before the first product | cudaMalloc | cudaFree |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T, name, ms, host, mallocs, frees in rows:
        print(f"| {T} | {name} | {ms:.3f} | {host:.3f} | {mallocs} | {frees} |")
    if turns:
        print("\nIn turns with the CuPy call:\n\n| T | step | ms | CuPy call ms | ÷ CuPy call (quartiles) |\n"
              "| --- | --- | --- | --- | --- |")
        print("\n".join(turns))


if __name__ == "__main__":
    main()
