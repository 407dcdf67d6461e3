"""The GPU backend: products.py (cuBLAS and cuBLASLt), sources.py and src/ (the CUDA row kernels
and their instantiations), kernels.py (loading and launching them) and backend.py (the chunk
loop's steps over CuPy arrays). Importing this package imports no CuPy: sources.py needs none."""
