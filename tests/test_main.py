"""python -m jsdgpu (jsdgpu/__main__.py) as a user meets it: bad values get one line naming the
option and exit status 2, --help shows every default, T = 0 is loss 0, and a small run checks out
against float64; and the front ends name their extra where the framework is missing."""

import subprocess
import sys

import pytest

from jsdgpu import __main__ as cli

BAD = [(["--beta", "2"], "--beta"), (["--temperature", "0"], "--temperature"), (["--chunk-size", "0"], "--chunk-size"),
       (["--teacher-vocab", "100"], "--teacher-vocab"), (["--memory-budget", "-5"], "--memory-budget"),
       (["--memory-budget", "lots"], "--memory-budget"), (["--tokens", "-1"], "--tokens"),
       (["--ignored", "1.5"], "--ignored"), (["--weight-soft-loss", "nan"], "--weight-soft-loss"),
       (["--tokens", "x"], "--tokens"), (["--device", "tpu"], "--device")]


@pytest.mark.parametrize("argv,flag", BAD)
def test_a_bad_value_is_one_line_and_status_2(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["--device", "cpu"] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for text in ("default 1024 / 256", "default 128256 / 32000", "default 2048 / 256", "default 4096 / 512",
                 "default bfloat16 / float32", "default 0.5", "default 1.0", "2.5G on the GPU, 256M on the CPU",
                 "default 16", "default auto", "--memory-budget"):
        assert text in out, text


def test_no_tokens_is_loss_zero(capsys):
    assert cli.main(["--device", "cpu", "--tokens", "0"]) == 0
    assert "loss 0.000000" in capsys.readouterr().out


def test_a_small_run_checks_out(capsys):
    assert cli.main(["--device", "cpu", "-T", "37", "--vocab", "301", "--teacher-vocab", "309", "--student-hidden",
                     "16", "--teacher-hidden", "24", "--bias", "--ignored", "0.3", "--memory-budget", "64K"]) == 0
    captured = capsys.readouterr()
    assert "check: OK" in captured.out and "[jsdgpu] first call" in captured.err


@pytest.mark.parametrize("front_end,framework,extra", [("torch", "torch", "jsdgpu[torch]"),
                                                       ("jax", "jax", "jsdgpu[jax]")])
def test_a_front_end_without_its_framework_names_the_extra(front_end, framework, extra):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import jsdgpu.{front_end}\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert extra in out, out
