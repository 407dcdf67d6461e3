"""The CPU backend's chunking: every chunk size gives the reference's answer."""

import pytest

import jsdgpu
from jsdgpu._driver import chunk_rows
from conftest import make_case, rel_err


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 7, 100])
def test_chunk_sizes_agree(rng, chunk_size):
    case = make_case(rng, T=17, bias=True, ignored=0.3, vt=1100)
    loss, ctx = jsdgpu.forward(**case, chunk_size=chunk_size, beta=0.7, temperature=1.5)
    gi, gw, gb = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case, beta=0.7, temperature=1.5)
    assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0]
    for got, want in zip((gi, gw, gb), ref[3:]):
        assert rel_err(got, want) <= 1e-4


def test_chunk_rows_from_budget():
    assert chunk_rows(100, 7, 10, 10**9) == 7  # an explicit chunk size wins
    assert chunk_rows(100, None, 10, 10**9) == 100  # everything fits: one chunk
    assert chunk_rows(100, None, 10, 400) == 34  # 40 rows fit: 3 chunks of at most 34
    assert chunk_rows(100, None, 10, 5) == 1  # not even one row fits: one row per chunk

