"""The options objects (jsdgpu.options): one place for each default and check."""

import dataclasses

import pytest

import jsdgpu
from jsdgpu.options import DEFAULTS, Divergence, LossOptions, RunOptions, split_options


def test_defaults_are_liger_s():
    assert (DEFAULTS.weight_hard_loss, DEFAULTS.weight_soft_loss, DEFAULTS.beta, DEFAULTS.temperature,
            DEFAULTS.ignore_index) == (0.5, 0.5, 0.5, 1.0, -100)
    assert RunOptions() == RunOptions(chunk_size=None, memory_budget=None, compute_grad=True)


def test_frozen_and_normalized():
    opts = LossOptions(beta=1, temperature=2, ignore_index=7)
    assert type(opts.beta) is float and type(opts.temperature) is float and opts.ignore_index == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.beta = 0.3


@pytest.mark.parametrize("beta,divergence", [(0.0, Divergence.FORWARD_KL), (1e-6, Divergence.JSD),
                                             (0.5, Divergence.JSD), (1.0, Divergence.REVERSE_KL)])
def test_divergence_by_beta(beta, divergence):
    assert LossOptions(beta=beta).divergence is divergence


def test_w_soft_over_t():
    assert LossOptions(weight_soft_loss=0.6, temperature=2.0).w_soft_over_t == pytest.approx(0.3)


def test_split_options():
    loss, run = split_options(dict(beta=0.3, chunk_size=5, num_valid_tokens=4))
    assert loss == LossOptions(beta=0.3) and run == RunOptions(chunk_size=5, num_valid_tokens=4.0)
    with pytest.raises(TypeError, match="unknown options: betta"):
        split_options(dict(betta=0.3))
    with pytest.raises(TypeError, match="betta"):
        jsdgpu.forward(None, None, None, None, None, betta=0.3)


def test_normalizer():
    assert RunOptions().normalizer(0) == 1.0 and RunOptions().normalizer(7) == 7.0
    assert RunOptions(num_valid_tokens=2.5).normalizer(7) == 2.5


@pytest.mark.parametrize("name", ["chunk_size", "memory_budget"])
@pytest.mark.parametrize("value,error", [(0, ValueError), (-5, ValueError), (2.5, TypeError), ("64", TypeError),
                                         (True, TypeError)])
def test_sizes_are_positive_integers(name, value, error):
    with pytest.raises(error, match=name):
        RunOptions(**{name: value})
    assert getattr(RunOptions(**{name: 3}), name) == 3


@pytest.mark.parametrize("name", ["compute_grad", "grad_weight_float32", "capturable"])
def test_flags_are_booleans(name):
    with pytest.raises(TypeError, match=name):
        RunOptions(**{name: "no"})
    assert getattr(RunOptions(**{name: False}), name) is False
