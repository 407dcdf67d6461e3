"""The arrays' checks of docs/contract.md ("Bad input"), made before any loss work starts (the
options' are jsdgpu.options')."""

import functools

import ml_dtypes
import numpy as np

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
ARRAY_NAMES = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
               "student_bias", "teacher_bias", "token_weights")
WEIGHT_DTYPES = SUPPORTED_DTYPES + (np.dtype(np.float64),)  # token_weights' (taken as float32)


def array_kind(a):
    """'numpy', 'cupy' or None (not an array this core takes directly)."""
    return array_kind_of_type(type(a))


def array_kind_of_type(t):
    """array_kind of an object of type t."""
    if issubclass(t, np.ndarray):
        return "numpy"
    if t.__module__.startswith("cupy"):
        return "cupy"
    return None


def gpu_available():
    """Whether CuPy is installed and sees a CUDA device."""
    try:
        import cupy
        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or no driver
        return False


def _signature(a):
    """What the checks of an array depend on: its kind, shape, dtype and device (None for None;
    the type alone for what is not an array the checks take, which they reject)."""
    if a is None:
        return None
    kind = array_kind(a)
    if kind is None:
        return type(a)
    return kind, a.shape, a.dtype, a.data.device_id if kind == "cupy" else None


def once_per_signature(check):
    """check(arrays), run once per signature of the arrays (their names, kinds, shapes, dtypes
    and devices, all it depends on) that passes: the checks took a fifth of a default call's
    host time before its first product (docs/design.md, "The host before the first product").
    A signature that fails is checked, and raises, every time."""
    passed = {}  # signature -> the kind check returned (a bounded memo: cleared when full)

    @functools.wraps(check)
    def checked(arrays):
        key = tuple((name, _signature(a)) for name, a in arrays.items())
        kind = passed.get(key)
        if kind is None:
            kind = check(arrays)
            if len(passed) >= 64:
                passed.clear()
            passed[key] = kind
        return kind
    return checked


@once_per_signature
def check_arrays(arrays):
    """arrays: dict name -> array (biases may be None). Returns the kind, 'numpy' or 'cupy'.

    Checks kinds, devices, ranks, shapes and dtypes; the target's values are checked where the
    backend selects the valid rows (select_rows).
    """
    kind = _kind(arrays)
    _check_ranks(arrays, dict(student_input=2, student_weight=2, teacher_input=2, teacher_weight=2, target=1,
                              student_bias=1, teacher_bias=1))

    ws, wt, target = arrays["student_weight"], arrays["teacher_weight"], arrays["target"]
    _check_rows(arrays, ("teacher_input", "target"))
    _check_head(arrays, "student")
    _check_head(arrays, "teacher")
    if wt.shape[0] < ws.shape[0]:
        raise ValueError(f"teacher_weight has a vocabulary of {wt.shape[0]}, smaller than "
                         f"student_weight's {ws.shape[0]} (Vt >= Vs is required)")
    _check_bias(arrays, "student")
    _check_bias(arrays, "teacher")
    _check_float(arrays, ("student_input", "student_weight", "teacher_input", "teacher_weight", "student_bias",
                          "teacher_bias"))
    _check_same_dtype(arrays, "student")
    _check_same_dtype(arrays, "teacher")
    if target.dtype.kind not in "iu":
        raise TypeError(f"target must have an integer dtype, got {target.dtype}")
    _check_token_weights(arrays)
    return kind


def _check_token_weights(arrays):
    """token_weights, where given: [T] of a float dtype (its values: engine.row_weights)."""
    w = arrays.get("token_weights")
    if w is None:
        return
    if w.ndim != 1 or w.shape[0] != arrays["target"].shape[0]:
        raise ValueError(f"token_weights must have shape ({arrays['target'].shape[0]},) (target's), "
                         f"got {tuple(w.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"token_weights must have a float dtype, got {w.dtype}")


# the entries of a call's arrays that are functions, not arrays: api.forward_with's weight_memory
# (one that returns a native array itself); named, so that a function passed as an array still
# fails the checks (call.bridged passes these on as they are)
FUNCTIONS = frozenset({"weight_memory"})


def _kind(arrays):
    """The arrays' kind, 'numpy' or 'cupy' (None entries and FUNCTIONS left out): all of one
    kind, on one device."""
    kinds = {}
    for name, a in arrays.items():
        if a is not None and name not in FUNCTIONS:
            kinds[name] = array_kind(a)
            if kinds[name] is None:
                raise TypeError(f"{name} must be a NumPy or CuPy array (or a DLPack tensor of "
                                f"PyTorch or JAX), got {type(a).__module__}.{type(a).__name__}")
    kind = next(iter(kinds.values()))
    if any(k != kind for k in kinds.values()):
        host = [name for name, k in kinds.items() if k == "numpy"]
        raise ValueError(f"a mix of host and device arrays: {', '.join(host)} on the host, "
                         "the rest on the GPU")
    if kind == "cupy":
        devices = {name: arrays[name].data.device_id for name in kinds}
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{name} on GPU {d}" for name, d in devices.items())
            raise ValueError(f"arrays on different devices: {where}")
    return kind


def _check_ranks(arrays, ranks):
    for name, rank in ranks.items():
        a = arrays.get(name)
        if a is not None and a.ndim != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(a.shape)}")


def _check_rows(arrays, names):
    """The named arrays have student_input's T rows."""
    T = arrays["student_input"].shape[0]
    for name in names:
        if arrays[name].shape[0] != T:
            raise ValueError(f"{name} has {arrays[name].shape[0]} rows but student_input has {T}")


def _check_head(arrays, who):
    """who's ("student" or "teacher") input and weight fit together: the hidden size, and at least
    one vocabulary row."""
    x, w = arrays[f"{who}_input"], arrays[f"{who}_weight"]
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{who}_weight has hidden size {w.shape[1]} but {who}_input has {x.shape[1]}")
    if w.shape[0] < 1:
        raise ValueError(f"{who}_weight must have at least one vocabulary row")


def _check_bias(arrays, who):
    b, w = arrays[f"{who}_bias"], arrays[f"{who}_weight"]
    if b is not None and b.shape[0] != w.shape[0]:
        raise ValueError(f"{who}_bias has length {b.shape[0]} but its weight has {w.shape[0]} rows")


def _check_same_dtype(arrays, who):
    x, w = arrays[f"{who}_input"], arrays[f"{who}_weight"]
    if x.dtype != w.dtype:
        raise TypeError(f"{who}_input ({x.dtype}) and {who}_weight ({w.dtype}) must have the same dtype")


def _check_float(arrays, names):
    for name in names:
        a = arrays.get(name)
        if a is not None and a.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {a.dtype}; use bfloat16, float16 or float32")


@once_per_signature
def check_topk_arrays(arrays):
    """The top-k loss's arrays (student_input, student_weight, teacher_indices, teacher_logprobs,
    target, student_bias): kinds, devices, ranks, shapes and dtypes. Returns the kind. The ids'
    and log-probabilities' values are checked by the backend's topk_check."""
    kind = _kind(arrays)
    _check_ranks(arrays, dict(student_input=2, student_weight=2, teacher_indices=2, teacher_logprobs=2, target=1,
                              student_bias=1))
    ids, lq = arrays["teacher_indices"], arrays["teacher_logprobs"]
    _check_rows(arrays, ("teacher_indices", "teacher_logprobs", "target"))
    if ids.shape != lq.shape:
        raise ValueError(f"teacher_indices has shape {tuple(ids.shape)} but teacher_logprobs has {tuple(lq.shape)}")
    if ids.shape[1] < 1:
        raise ValueError("teacher_indices must hold at least one id per row (k >= 1)")
    _check_head(arrays, "student")
    _check_bias(arrays, "student")
    _check_float(arrays, ("student_input", "student_weight", "teacher_logprobs", "student_bias"))
    _check_same_dtype(arrays, "student")
    for name in ("teacher_indices", "target"):
        if arrays[name].dtype.kind not in "iu":
            raise TypeError(f"{name} must have an integer dtype, got {arrays[name].dtype}")
    _check_token_weights(arrays)
    return kind


@once_per_signature
def check_teacher_arrays(arrays):
    """teacher_topk's arrays (teacher_input, teacher_weight, teacher_bias). Returns the kind."""
    kind = _kind(arrays)
    _check_ranks(arrays, dict(teacher_input=2, teacher_weight=2, teacher_bias=1))
    _check_head(arrays, "teacher")
    _check_bias(arrays, "teacher")
    _check_float(arrays, ("teacher_input", "teacher_weight", "teacher_bias"))
    _check_same_dtype(arrays, "teacher")
    return kind


# the top-k's bad values, by the code topk_check's kernel writes
TOPK_SUM_SLACK = 1e-3  # the teacher's top-k probabilities may sum to 1 + this (their rounding)
_TOPK_PROBLEMS = {1: "an id outside [0, {vocab})", 2: "an id that appears twice",
                  3: f"probabilities that sum above 1 (+{TOPK_SUM_SLACK:g}), with missing_mass='bucket'"}


def topk_error(row, code, vocab):
    """The ValueError for row `row` of the teacher's top-k, by topk_check's code."""
    return ValueError(f"teacher_indices / teacher_logprobs row {row} holds "
                      f"{_TOPK_PROBLEMS[code].format(vocab=vocab)} (slots whose log-probability is -inf "
                      "are unused and not checked)")


def topk_problem(ids, lq, vocab, bucket):
    """(row, code) of the first bad row of a NumPy top-k (code: topk_error's), or None. A used
    slot is one whose log-probability is not -inf."""
    used = np.asarray(lq, np.float64) != -np.inf
    ids = np.asarray(ids, np.int64)
    codes = np.zeros(len(ids), np.int64)
    if bucket:
        with np.errstate(over="ignore"):
            total = np.where(used, np.exp(np.asarray(lq, np.float64)), 0.0).sum(axis=1)
        codes[total > 1.0 + TOPK_SUM_SLACK] = 3
    # unused slots as distinct negative ids, so they neither repeat nor count as out of range
    marked = np.where(used, ids, -1 - np.arange(ids.shape[1]))
    ordered = np.sort(marked, axis=1)
    codes[(np.diff(ordered, axis=1) == 0).any(axis=1)] = 2
    codes[(used & ((ids < 0) | (ids >= vocab))).any(axis=1)] = 1
    bad = np.flatnonzero(codes)
    return None if not len(bad) else (int(bad[0]), int(codes[bad[0]]))


def target_error(row, value, vocab, ignore_index):
    """The ValueError for target[row] = value, outside [0, vocab) and not ignore_index."""
    return ValueError(f"target[{row}] = {value} is outside [0, {vocab}) and is not "
                      f"ignore_index ({ignore_index})")


def good_weights(xp, weights):
    """Where the token weights (an xp array) are finite and >= 0: the values' check (the GPU's
    default call runs the same one in targets.cu's first_bad_weight)."""
    return xp.isfinite(weights) & (weights >= 0)


def weight_error(row, value):
    """The ValueError for token_weights[row] = value, not finite or below 0."""
    return ValueError(f"token_weights must be finite and >= 0, got token_weights[{row}] = {value}")


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
