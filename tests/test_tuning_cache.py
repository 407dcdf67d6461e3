"""The products' tuning cache on disk (jsdgpu/cuda/tuning_cache.py): what a process keeps, a later
one reads, in its scope only, the first choice of a class for every reader; a file that cannot be
used is said once and tuning goes on without it. (A new process taking the choices on a GPU:
tests/test_cuda_products.py.)"""

import json
import pathlib
import warnings

import pytest

from jsdgpu.cuda.tuning_cache import TuningCache, default_path

KEY = (1, 0, 128256, 1024, 2048, 2048, 2048, 128256, (14, 14, 0), 33554432)
SCOPE = "NVIDIA H200 sm_90 cublasLt 130100"


def test_a_choice_kept_is_read_by_the_next_process(tmp_path):
    path = tmp_path / "sub" / "gemm.jsonl"
    TuningCache(path, SCOPE).put(KEY, bytes(range(64)))
    assert TuningCache(path, SCOPE).get(KEY) == bytes(range(64))
    assert TuningCache(path, SCOPE).get(KEY[:-1] + (0,)) is None
    assert len(path.read_text().splitlines()) == 1


def test_another_scope_reads_nothing(tmp_path):
    path = tmp_path / "gemm.jsonl"
    TuningCache(path, SCOPE).put(KEY, b"\x01" * 64)
    other = TuningCache(path, SCOPE.replace("130100", "130200"))
    assert other.get(KEY) is None
    other.put(KEY, b"\x02" * 64)  # its own line, beside the first scope's
    assert TuningCache(path, SCOPE).get(KEY) == b"\x01" * 64
    assert TuningCache(path, other.scope).get(KEY) == b"\x02" * 64


def test_the_first_line_of_a_class_wins(tmp_path):
    """Two processes that tuned a class at once each keep their own; every later one takes the
    first line's."""
    path = tmp_path / "gemm.jsonl"
    a, b = TuningCache(path, SCOPE), TuningCache(path, SCOPE)
    a.put(KEY, b"\x0a" * 64)
    b.put(KEY, b"\x0b" * 64)
    assert (a.get(KEY), b.get(KEY)) == (b"\x0a" * 64, b"\x0b" * 64)
    assert len(path.read_text().splitlines()) == 2
    assert TuningCache(path, SCOPE).get(KEY) == b"\x0a" * 64
    b.put(KEY, b"\x0c" * 64)  # kept already: nothing more written
    assert len(path.read_text().splitlines()) == 2


def test_lines_that_do_not_parse_are_skipped(tmp_path):
    path = tmp_path / "gemm.jsonl"
    good = json.dumps({"scope": SCOPE, "class": KEY, "algorithm": "ff" * 64})
    path.write_text("\n".join(["{not json", json.dumps({"scope": SCOPE, "class": KEY}),
                               json.dumps({"scope": SCOPE, "class": KEY, "algorithm": "xyz"}), "[1, 2]", good,
                               good[:20]]) + "\n")
    assert TuningCache(path, SCOPE).get(KEY) == b"\xff" * 64


@pytest.mark.parametrize("blocked", ["its folder a file", "a folder in its place", "not writable once read"])
def test_a_file_that_cannot_be_used_is_said_once(tmp_path, blocked):
    """Tuning goes on, its choices kept in the process, with one warning that names the setting."""
    path = {"its folder a file": tmp_path / "a file" / "gemm.jsonl", "a folder in its place": tmp_path,
            "not writable once read": tmp_path / "a file" / "gemm.jsonl"}[blocked]
    if blocked == "its folder a file":
        (tmp_path / "a file").write_text("")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cache = TuningCache(path, SCOPE)
        if blocked == "not writable once read":  # read (no file yet), then its folder made a file
            (tmp_path / "a file").write_text("")
        cache.put(KEY, b"\x01" * 64)
        cache.put(KEY[:-1] + (0,), b"\x02" * 64)
    assert [w.category for w in said] == [RuntimeWarning]
    assert "JSDGPU_GEMM_CACHE" in str(said[0].message)
    assert cache.get(KEY) == b"\x01" * 64


def test_the_file_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JSDGPU_GEMM_CACHE", "0")
    assert default_path() is None
    monkeypatch.setenv("JSDGPU_GEMM_CACHE", str(tmp_path / "mine.jsonl"))
    assert default_path() == tmp_path / "mine.jsonl"
    monkeypatch.delenv("JSDGPU_GEMM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "jsdgpu" / "gemm_algorithms.jsonl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_path() == pathlib.Path.home() / ".cache" / "jsdgpu" / "gemm_algorithms.jsonl"

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    assert default_path() is None
