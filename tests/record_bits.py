"""Does a change that should move code, not math, keep every output's bits?

A pytest plugin: with JSDGPU_RECORD_BITS=<file>, every call of jsdgpu.forward, forward_topk,
backward and teacher_topk that a test makes has its outputs hashed (SHA-256 of their bytes, in
call order within the test), and the hashes are written to <file> as JSON, by test. Run the
tests of two versions with the same JSDGPU_SEED (the fixture `rng` then draws the same inputs),
then compare the two files:

    mkdir -p /tmp/old && git archive REV jsdgpu tests pytest.ini | tar -x -C /tmp/old
    export JSDGPU_SEED=7
    (cd /tmp/old && JSDGPU_RECORD_BITS=/tmp/old.json PYTHONPATH=.:$OLDPWD/tests \\
        python -m pytest -p record_bits -m gpu tests/test_chunks.py tests/test_topk.py)
    JSDGPU_RECORD_BITS=/tmp/new.json PYTHONPATH=.:tests \\
        python -m pytest -p record_bits -m gpu tests/test_chunks.py tests/test_topk.py
    python tests/record_bits.py /tmp/old.json /tmp/new.json [--shapes]

Calls inside a CUDA-graph capture are recorded as such, not hashed (nothing may be read then);
a call that raises is recorded by its exception's type; every matrix product on the GPU is
recorded by its shape. With the products' tuning (jsdgpu.cuda.products), two processes may pick
different algorithms: compare bits with JSDGPU_GEMM_TUNING=0, or only the products' shapes (the
path each call took) with --shapes. Answer: docs/design.md, "The chunk
engine" (the layout's change, outputs compared over the GPU tests of the engine and both losses).
"""

import hashlib
import json
import os
import sys

_calls = {}  # test id -> [hash or note, ...]
_test = [None]


def _digest(value):
    if value is None or isinstance(value, (int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_digest(v) for v in value) + ")"
    if hasattr(value, "hard_loss"):  # a Context: its loss parts
        return _digest((value.hard_loss, value.soft_loss))
    import numpy as np
    array = value.get() if hasattr(value, "get") else np.asarray(value)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16] + str(array.dtype)


def _capturing():
    try:
        import cupy
        return cupy.cuda.get_current_stream().is_capturing()
    except Exception:
        return False


def _recorded(name, function):
    def call(*args, **kwargs):
        record = _calls.setdefault(_test[0], [])
        try:
            out = function(*args, **kwargs)
        except Exception as error:
            record.append(f"{name} raised {type(error).__name__}")
            raise
        record.append(f"{name} in a capture" if _capturing() else f"{name} {_digest(out)}")
        return out
    return call


def _product(m, n, k):
    _calls.setdefault(_test[0], []).append(f"gemm {m}x{n}x{k}")


_observing = []  # the products' observer, entered for the session


def pytest_configure(config):
    if os.environ.get("JSDGPU_RECORD_BITS"):
        import jsdgpu
        for name in ("forward", "forward_topk", "backward", "teacher_topk"):
            setattr(jsdgpu, name, _recorded(name, getattr(jsdgpu, name)))
        try:  # the GPU's products, by shape: the path a call took, whatever algorithms the tuning chose
            from jsdgpu.cuda import products
        except Exception:  # no CUDA here
            return
        _observing.append(products.observing(_product))
        _observing[0].__enter__()


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def pytest_unconfigure(config):
    for observer in _observing:
        observer.__exit__(None, None, None)
    path = os.environ.get("JSDGPU_RECORD_BITS")
    if path:
        with open(path, "w") as f:
            json.dump(_calls, f, indent=0, sort_keys=True)


def compare(old_path, new_path, shapes_only=False):
    old, new = (json.load(open(p)) for p in (old_path, new_path))
    if shapes_only:  # the products' shapes and the raised calls: what does not depend on the tuning
        old, new = ({t: [c for c in calls if c.startswith("gemm") or "raised" in c] for t, calls in d.items()}
                    for d in (old, new))
        new = {t: calls for t, calls in new.items() if t in old}
    differ = [t for t in sorted(set(old) | set(new)) if old.get(t) != new.get(t)]
    # the same calls in another order: tests whose ranks are threads (test_parallel.ThreadRanks),
    # which record their calls in the order the threads happen to run
    reordered = [t for t in differ if sorted(old.get(t, [])) == sorted(new.get(t, []))]
    differ = [t for t in differ if t not in reordered]
    calls = sum(len(v) for v in new.values())
    print(f"{len(new)} tests, {calls} calls recorded; {len(differ)} tests differ"
          + (f" ({len(reordered)} more record the same calls in another order)" if reordered else ""))
    for t in differ:  # each test's first call that differs
        a, b = old.get(t, []), new.get(t, [])
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  {t}, call {i}: {a[i] if i < len(a) else None} | {b[i] if i < len(b) else None}")
    return not differ


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--shapes", action="store_true", help="compare only the products' shapes and the raised calls")
    args = p.parse_args()
    sys.exit(0 if compare(args.old, args.new, args.shapes) else 1)
