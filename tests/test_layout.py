"""The layout stays readable: no file of the package over 500 lines, every module in the README's
layout table, and every docs/design.md section that the code cites by name there."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jsdgpu"
MOST_LINES = 500


def package_files():
    return [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in p.parts]


def test_no_file_of_the_package_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in package_files() if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_every_module_in_the_readme_layout_table():
    """A module is named in the table by its path, or by its directory's (jsdgpu/cpu/, jsdgpu/cuda/),
    or, among the front ends' row, by its file name."""
    table = re.search(r"## Layout\n(.*?)\n## ", (ROOT / "README.md").read_text(), re.S).group(1)
    named = set(re.findall(r"`([\w/.]+)`", table))
    missing = [str(p.relative_to(ROOT)) for p in PACKAGE.glob("*.py")
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in named]
    missing += [d for d in ("jsdgpu/cpu/", "jsdgpu/cuda/") if d not in named]
    assert not missing, missing


def test_cited_design_sections_exist():
    headings = [h.strip() for h in re.findall(r"^##+ (.+)$", (ROOT / "docs" / "design.md").read_text(), re.M)]
    cited = set()
    for p in [*package_files(), *ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("experiments/*.py")]:
        # a name may run over lines, in comments and docstrings alike
        names = re.findall(r'design\.md, "([^"]+)"', p.read_text())
        cited |= {re.sub(r"\s*\n\s*(#\s*|//\s*)?", " ", name) for name in names}
    assert cited  # the pattern finds the citations
    unresolved = sorted(name for name in cited if not any(h.startswith(name) for h in headings))
    assert not unresolved, unresolved
