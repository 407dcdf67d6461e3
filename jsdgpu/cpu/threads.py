"""How many threads a CPU row kernel takes: Numba's all, or one where its rows are too small a
job to pay for a parallel region (docs/design.md, "The CPU backend")."""

import functools

import numba

# A kernel whose first array has fewer values than this runs on one thread. NumPy's products
# run on OpenBLAS's threads, which keep spinning for a while after each product, and Numba's
# (OpenMP) threads spin too after a parallel region, which ends only when its last thread has
# had a core: on two cores a step at T = 64, V = 1000 took 7.6-7.7 ms with the kernels parallel
# and 0.72-0.73 on one thread; at 4-8 million values one thread was 5-10% faster, at 1 million
# 10% slower (python experiments/cpu_threads.py, docs/design.md "The CPU backend").
PARALLEL_FROM = 2**23


def rows_in_parallel(kernel):
    """kernel (Numba's, parallel over the rows of its first argument), launched on one thread
    where that argument holds fewer than PARALLEL_FROM values, on Numba's threads elsewhere."""
    @functools.wraps(kernel)
    def launch(x, *args):
        if x.size >= PARALLEL_FROM:
            return kernel(x, *args)
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return kernel(x, *args)
        finally:
            numba.set_num_threads(threads)
    return launch
