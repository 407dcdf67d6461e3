"""The arrays' checks of docs/contract.md ("Bad input"), made before any loss work starts (the
options' are jsdgpu.options')."""

import ml_dtypes
import numpy as np

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
ARRAY_NAMES = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
               "student_bias", "teacher_bias")


def array_kind(a):
    """'numpy', 'cupy' or None (not an array this core takes directly)."""
    if isinstance(a, np.ndarray):
        return "numpy"
    if type(a).__module__.startswith("cupy"):
        return "cupy"
    return None


def gpu_available():
    """Whether CuPy is installed and sees a CUDA device."""
    try:
        import cupy
        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or no driver
        return False


def _device_of(a):
    return a.device.id if array_kind(a) == "cupy" else "cpu"


def check_arrays(arrays):
    """arrays: dict name -> array (biases may be None). Returns the kind, 'numpy' or 'cupy'.

    Checks kinds, devices, ranks, shapes and dtypes; the target's values are checked where the
    backend selects the valid rows (select_rows).
    """
    present = {k: v for k, v in arrays.items() if v is not None}
    for name, a in present.items():
        if array_kind(a) is None:
            raise TypeError(f"{name} must be a NumPy or CuPy array (or a DLPack tensor of "
                            f"PyTorch or JAX), got {type(a).__module__}.{type(a).__name__}")
    kinds = {array_kind(a) for a in present.values()}
    if len(kinds) > 1:
        host = [k for k, a in present.items() if array_kind(a) == "numpy"]
        raise ValueError(f"a mix of host and device arrays: {', '.join(host)} on the host, "
                         "the rest on the GPU")
    devices = {_device_of(a) for a in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on GPU {_device_of(a)}" for k, a in present.items())
        raise ValueError(f"arrays on different devices: {where}")

    ranks = dict(student_input=2, student_weight=2, teacher_input=2, teacher_weight=2, target=1,
                 student_bias=1, teacher_bias=1)
    for name, a in present.items():
        if a.ndim != ranks[name]:
            raise ValueError(f"{name} must have rank {ranks[name]}, got shape {tuple(a.shape)}")

    xs, ws = arrays["student_input"], arrays["student_weight"]
    xt, wt = arrays["teacher_input"], arrays["teacher_weight"]
    target = arrays["target"]
    T = xs.shape[0]
    for name in ("teacher_input", "target"):
        if arrays[name].shape[0] != T:
            raise ValueError(f"{name} has {arrays[name].shape[0]} rows but student_input has {T}")
    if ws.shape[1] != xs.shape[1]:
        raise ValueError(f"student_weight has hidden size {ws.shape[1]} but student_input has "
                         f"{xs.shape[1]}")
    if wt.shape[1] != xt.shape[1]:
        raise ValueError(f"teacher_weight has hidden size {wt.shape[1]} but teacher_input has "
                         f"{xt.shape[1]}")
    if wt.shape[0] < ws.shape[0]:
        raise ValueError(f"teacher_weight has a vocabulary of {wt.shape[0]}, smaller than "
                         f"student_weight's {ws.shape[0]} (Vt >= Vs is required)")
    if ws.shape[0] < 1:
        raise ValueError("student_weight must have at least one vocabulary row")
    for bias, weight in (("student_bias", ws), ("teacher_bias", wt)):
        b = arrays[bias]
        if b is not None and b.shape[0] != weight.shape[0]:
            raise ValueError(f"{bias} has length {b.shape[0]} but its weight has "
                             f"{weight.shape[0]} rows")

    for name in ("student_input", "student_weight", "teacher_input", "teacher_weight",
                 "student_bias", "teacher_bias"):
        a = arrays[name]
        if a is not None and a.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {a.dtype}; "
                            "use bfloat16, float16 or float32")
    for x, w in (("student_input", "student_weight"), ("teacher_input", "teacher_weight")):
        if arrays[x].dtype != arrays[w].dtype:
            raise TypeError(f"{x} ({arrays[x].dtype}) and {w} ({arrays[w].dtype}) must have "
                            "the same dtype")
    if target.dtype.kind not in "iu":
        raise TypeError(f"target must have an integer dtype, got {target.dtype}")
    return kinds.pop()


def target_error(row, value, vocab, ignore_index):
    """The ValueError for target[row] = value, outside [0, vocab) and not ignore_index."""
    return ValueError(f"target[{row}] = {value} is outside [0, {vocab}) and is not "
                      f"ignore_index ({ignore_index})")


def target_masks(target_host, vocab, ignore_index):
    """(valid, bad) of a NumPy integer array: the entries in [0, vocab) and not ignore_index,
    and those outside it and not ignore_index."""
    t = np.asarray(target_host, dtype=np.int64)  # no copy where it is int64 already
    kept = t != ignore_index
    bad = kept & ((t < 0) | (t >= vocab))
    return kept & ~bad, bad


def check_target(target_host, vocab, ignore_index):
    """target_host: a NumPy integer array. Raise if a non-ignored entry is outside [0, vocab);
    else return the indices of the non-ignored (valid) entries."""
    valid, bad = target_masks(target_host, vocab, ignore_index)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise target_error(i, int(target_host[i]), vocab, ignore_index)
    return np.flatnonzero(valid)
