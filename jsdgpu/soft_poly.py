"""The precise soft part's polynomial, shared by the GPU's kernels (in bits: jsdgpu/cuda/sources.py,
soft_terms) and the CPU's fused kernel (in nats: jsdgpu/cpu/divergences.py): every divergence's
soft part is a sum over the columns of w F(d), w a probability and d the log-ratio of the other
distribution's to it, F second order in d, and on |d| < 1 the kernels form F(d) = d^2 P(d)
(jsdgpu/cuda/src/row_math.cuh, "one column's terms"; docs/design.md, "Small divergences"). Beside
it, the gradient's: on |d| < 1 the kernels form the part of a column's gradient that is first
order in d as d Q(d), not as a difference of two rounded numbers near each other."""

import numpy as np

from .options import Divergence

SOFT_POLY_TERMS = 9  # P's coefficients, of d^0 .. d^8 (row_math.cuh's SOFT_POLY_TERMS)


def soft_term(divergence, b, d):
    """F(d) / d^2 in float64: Phi(d) = 1 + e^d (d - 1) for the KLs, H_b(d) = b Phi(d) - G(b (e^d -
    1)), G(y) = (1 + y) ln(1 + y) - y for the JSD; each by its series where its formula would
    cancel."""
    d = np.asarray(d, np.float64)
    k = np.arange(30.0)
    fact = np.cumprod(np.concatenate([[1.0], np.arange(1.0, 32.0)]))
    phi = np.where(np.abs(d) < 0.1, (d[:, None] ** k * (k + 1) / fact[2:32]).sum(1) * d**2,
                   1 + np.exp(d) * (d - 1))
    if divergence != Divergence.JSD:
        return phi / d**2
    y = b * np.expm1(d)
    g = np.where(np.abs(y) < 0.01, ((-y[:, None]) ** k / ((k + 1) * (k + 2))).sum(1) * y**2,
                 (1 + y) * np.log1p(y) - y)
    return (b * phi - g) / d**2


def mixture_weight(divergence, beta):
    """The JSD's b = min(beta, 1 - beta), the mixture's weight of the other distribution where the
    weight distribution is the one of the larger weight (0 for the KLs)."""
    return min(beta, 1.0 - beta) if Divergence(divergence) == Divergence.JSD else 0.0


def soft_poly(divergence, beta, radius=1.0, terms=SOFT_POLY_TERMS):
    """P's coefficients of d^0 .. d^(terms - 1) in float64 (d in nats), with d^2 P(d) = F(d) on
    |d| < radius: a Chebyshev fit of F(d) / d^2 at 64 nodes (analytic there: its nearest
    singularity is pi or more away), good to float32's rounding with nine terms on |d| < 1 (the
    GPU's) and seven on |d| < 1/2 (the CPU's: jsdgpu/cpu/divergences.py, NEAR_BELOW;
    tests/test_cuda_sources.py)."""
    return _fit(soft_term, divergence, beta, radius, terms)


def grad_term(divergence, b, d):
    """Q(d) in float64: forward KL's (e^d - 1) / d, whose gradient is p - q = -p d Q(d); the
    JSD's ln(1 + b (e^d - 1)) / d, the mixture's log relative to the weight distribution, ln(m /
    w), of which its gradient's h is formed; 1 for reverse KL (unused: its h is the logits'
    difference)."""
    d = np.asarray(d, np.float64)
    if divergence == Divergence.FORWARD_KL:
        return np.expm1(d) / d
    if divergence == Divergence.JSD:
        return np.log1p(b * np.expm1(d)) / d
    return np.ones_like(d)


def grad_poly(divergence, beta, radius=1.0, terms=SOFT_POLY_TERMS):
    """Q's coefficients of d^0 .. d^(terms - 1) in float64 (d in nats), with d Q(d) = forward KL's
    e^d - 1 or the JSD's ln(m / w) on |d| < radius (grad_term): a Chebyshev fit at 64 nodes, as
    soft_poly's (the JSD's nearest singularity, where 1 + b (e^d - 1) = 0, is pi or more away),
    good to float32's rounding (tests/test_cuda_sources.py). Formed so, a small divergence's gradient is
    right to float32 relative to itself: from the rounded p and q, p - q and ln(p / m) lost to
    their roundings what they are smaller than 1 (at beta 1e-6, the whole gradient)."""
    return _fit(grad_term, divergence, beta, radius, terms)


def _fit(term, divergence, beta, radius, terms):
    """The coefficients of d^0 .. d^(terms - 1) (float64) of a Chebyshev fit of term(divergence, b,
    d) at 64 nodes of [-radius, radius] (soft_poly's and grad_poly's)."""
    divergence = Divergence(divergence)
    nodes = radius * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    values = term(divergence, mixture_weight(divergence, beta), nodes)
    fit = np.polynomial.Chebyshev.fit(nodes, values, terms - 1, domain=[-radius, radius])
    return fit.convert(kind=np.polynomial.Polynomial).coef
