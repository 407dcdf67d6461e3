"""The repository's scripts (bench/, experiments/) run on any machine as far as they can without a
GPU: --help, and the benchmark's report from the committed results; and none of them replaces a
library internal (they take the library's seams instead)."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("experiments/*.py"), *ROOT.glob("examples/*.py")])
MAINS = [p for p in SCRIPTS if "__main__" in p.read_text()]


def test_scripts_found():
    names = {p.name for p in MAINS}
    assert {"bench.py", "bench_vocab_parallel.py", "profile_step.py", "host_time.py",
            "fused_row_kernel.py", "jax_step.py", "ab_versions.py", "products.py", "sharp_rows.py",
            "graph_replay.py"} <= names


@pytest.mark.parametrize("path", MAINS, ids=[p.name for p in MAINS])
def test_help(path):
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout


def test_report_renders_the_committed_results(tmp_path):
    shutil.copy(ROOT / "bench" / "results" / "h200.json", tmp_path / "h200.json")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--render",
                          str(tmp_path / "h200.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "h200.md").read_text()
    assert "| jsdgpu | 8192 | fwd_bwd |" in table and "jsdgpu ÷ floor" in table
    assert table == (ROOT / "bench" / "results" / "h200.md").read_text()


def _library_names(tree):
    """Names a script binds to jsdgpu's modules, classes and functions by its imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("jsdgpu")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jsdgpu"):
            names |= {a.asname or a.name for a in node.names}
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_no_script_replaces_library_internals(path):
    tree = ast.parse(path.read_text())
    library = _library_names(tree)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            assert not (isinstance(target, ast.Attribute) and isinstance(base, ast.Name)
                        and base.id in library), f"{path.name}:{node.lineno} assigns to {ast.unparse(target)}"
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "monkeypatch.setattr"):
            assert not (node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in library), \
                f"{path.name}:{node.lineno} sets an attribute of the library"
