"""The CPU backend: NumPy and Numba."""
