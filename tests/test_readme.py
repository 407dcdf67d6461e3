"""The README's runnable examples run as they are (on the CPU)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_block(marker):
    """The python block after <!-- marker --> in the README."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert match, marker
    return match.group(1)


def test_offline_distillation_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # it saves its top-k in the working directory
    exec(compile(readme_block("offline-example"), "README.md", "exec"), {})
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
