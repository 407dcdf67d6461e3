"""The fused row kernel at the SM clock a step leaves it, against its time alone.

Inside a step the row kernel runs after the logits products, which hold the H200 at its power
limit: its SM clock falls, and the kernel's time with it, while the copy bandwidth (HBM) stays.
This times the kernel (2048 rows of the benchmark's logits) and a 1 GiB device copy, each (1)
after a 0.3 s pause and the same work back to back, as `bench.py` times the kernel alone (G
apart from the logits), and (2) after 30 ms of the logits products, as in a step (G over them);
with the SM clock just before and just after, measured by one thread spinning 200k cycles of
clock64 against the globaltimer. Medians of 12 rounds, the cases interleaved in each. The SM
cycles per row (time times clock) show whether the kernel's time follows the SM clock.

    python bench/probe_clocks.py
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

ROWS, ROUNDS = 2048, 12

CLOCK_SOURCE = r'''
extern "C" __global__ void sm_clock(unsigned long long* out) {
  unsigned long long t0, t1;
  const long long c0 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (clock64() - c0 < 200000) {}
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = c1 - c0;
  out[1] = t1 - t0;
}'''


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import cupy

    import bench
    from jsdgpu._cupy_backend import launch_rows
    from jsdgpu._driver import LossOptions

    clock = cupy.RawKernel(CLOCK_SOURCE, "sm_clock")
    # alone, G has memory of its own (as bench.py times the kernel: the logits stay); in a step it
    # goes over the student logits, which the products write anew
    xs, ws, xt, wt, target, be, alone = bench.one_chunk(ROWS, np.random.default_rng(0))
    work = be.prepare(ws, wt, None, None, ROWS, ROWS, fused=True)
    opts = LossOptions(0.5, 0.5, 0.5, 1.0, -100)
    ce, jsd, terms = (cupy.empty(ROWS, np.float32) for _ in range(3))
    src = cupy.ones(2**28, np.float32)
    dst = cupy.empty_like(src)

    def products():  # the chunk's logits, written where the row kernel reads them
        be.logits(work, xs, xt)

    def rows():
        launch_rows(work, ROWS, target, opts, ce, jsd, work["G"], terms)

    def rows_alone():
        launch_rows(alone, ROWS, target, opts, ce, jsd, alone["G"], terms)

    def step_like():  # ~30 ms of products, the last ones the kernel's own logits
        for _ in range(14):
            products()

    def back_to_back():
        cupy.cuda.Device().synchronize()
        time.sleep(0.3)  # the clocks come back up from the products
        for _ in range(5):
            rows_alone()

    def copies():
        cupy.cuda.Device().synchronize()
        time.sleep(0.3)
        for _ in range(3):
            copy()

    def copy():
        cupy.copyto(dst, src)

    cases = {("row kernel", "back to back"): (back_to_back, rows_alone),
             ("row kernel", "after 30 ms of products"): (step_like, rows),
             ("1 GiB copy", "back to back"): (copies, copy),
             ("1 GiB copy", "after 30 ms of products"): (step_like, copy)}
    for before, timed in cases.values():
        before()
        timed()
    found = {case: ([], [], []) for case in cases}
    clocks = [cupy.zeros(2, np.uint64) for _ in range(2)]
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(ROUNDS):
        for case, (before, timed) in cases.items():
            before()
            clock((1,), (1,), (clocks[0],))
            start.record()
            timed()
            stop.record()
            clock((1,), (1,), (clocks[1],))
            cupy.cuda.Device().synchronize()
            ms = cupy.cuda.get_elapsed_time(start, stop)
            found[case][0].append(ms)
            for mhz, c in zip(found[case][1:], clocks):
                cycles, ns = (int(x) for x in c.get())
                mhz.append(1e3 * cycles / ns)

    copy_bytes = 2 * src.nbytes
    row_bytes = ROWS * bench.V * (4 + 4 + 2)  # the logits read once, G written once
    copy_rate = {when: copy_bytes / (statistics.median(found[("1 GiB copy", when)][0]) * 1e-3)
                 for when in ("back to back", "after 30 ms of products")}
    print("| what | when | ms | SM MHz before / after | µs per row | SM cycles per row | TB/s "
          "| of the copy bandwidth then |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (what, when), (ms, before, after) in found.items():
        ms = statistics.median(ms)
        clocks_text = f"{statistics.median(before):.0f} / {statistics.median(after):.0f}"
        if what == "row kernel":
            rate = row_bytes / (ms * 1e-3)
            us = 1e3 * ms / ROWS
            cycles = us * (statistics.median(before) + statistics.median(after)) / 2
            print(f"| {what} | {when} | {ms:.3f} | {clocks_text} | {us:.3f} | {cycles:.0f} | {rate / 1e12:.2f} "
                  f"| {rate / copy_rate[when]:.0%} |")
        else:
            print(f"| {what} | {when} | {ms:.3f} | {clocks_text} | | | {copy_bytes / (ms * 1e-3) / 1e12:.2f} | |")


if __name__ == "__main__":
    main()
