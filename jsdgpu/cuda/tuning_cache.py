"""The products' tuned algorithms kept on disk, so that a new process does not time them again.

Tuning a product class times its cuBLASLt candidates on its first product, about 60 ms a class;
the benchmark's run meets 38 classes at T = 1024 and 24 more at 8192, which cost a fresh
process's first steps about two seconds more than tuned ones (docs/design.md, "Products"). Each
choice a process times is appended to a file as one JSON line, and a later process takes the
choices it finds there instead of timing them again.

A choice holds where it was made: its scope is the GPU's name and compute capability and
cuBLASLt's version (an algorithm's bytes mean nothing to another version, and another GPU runs
other ones fastest). The first line of a class in the file is its choice for every later process,
so that every process that reads the file gives a call the same bits; a process that timed the
class itself, beside another, keeps its own for its life. Lines are appended with O_APPEND, one
write each, so processes that tune at once do not interleave them; a line that does not parse is
skipped.

JSDGPU_GEMM_CACHE: the file (default $XDG_CACHE_HOME/jsdgpu/gemm_algorithms.jsonl, or under
~/.cache), or 0 for none. JSDGPU_GEMM_TUNING=0 (the heuristic's first candidate everywhere)
reads and writes nothing.
"""

import json
import os
import pathlib
import warnings


def default_path():
    """The file JSDGPU_GEMM_CACHE names, the default where it is unset, None where it is 0 (or
    where it is unset and no home folder can be found: tuning in the process alone)."""
    setting = os.environ.get("JSDGPU_GEMM_CACHE")
    if setting == "0":
        return None
    if setting:
        return pathlib.Path(setting)
    try:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    except RuntimeError:  # no HOME, nor a password entry of this user
        return None
    return pathlib.Path(base) / "jsdgpu" / "gemm_algorithms.jsonl"


class TuningCache:
    """The choices of one scope (a string) kept in the file at path: get(key) and put(key, algo),
    key a tuple of ints and tuples of ints, algo the algorithm's bytes."""

    def __init__(self, path, scope):
        self.path, self.scope = pathlib.Path(path), scope
        self.kept = {}
        try:
            with open(self.path, encoding="utf-8") as lines:
                for line in lines:
                    self._read(line)
        except FileNotFoundError:
            pass
        except OSError as error:
            self._give_up(error)

    def _read(self, line):
        try:
            entry = json.loads(line)
            if entry["scope"] == self.scope:
                self.kept.setdefault(_key(entry["class"]), bytes.fromhex(entry["algorithm"]))
        except (ValueError, KeyError, TypeError):  # a torn or foreign line: not a choice
            pass

    def get(self, key):
        return self.kept.get(key)

    def put(self, key, algo):
        """Keep algo for key, in this process and in the file (where the class has no line yet)."""
        if key in self.kept:
            return
        self.kept[key] = algo
        if self.path is None:
            return
        line = json.dumps({"scope": self.scope, "class": key, "algorithm": algo.hex()}) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as error:
            self._give_up(error)

    def _give_up(self, error):
        """The file cannot be read or written: tune in this process alone, and say so once."""
        warnings.warn(f"jsdgpu: the products' tuning cache {self.path} is not usable ({error}); "
                      "set JSDGPU_GEMM_CACHE to another file, or to 0", RuntimeWarning, stacklevel=3)
        self.path = None


def _key(value):
    """JSON's lists back to the tuples a class key is."""
    return tuple(_key(v) for v in value) if isinstance(value, list) else value
