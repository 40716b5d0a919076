"""bf16 mixed-precision training (mmjax.demo.mixed_precision): same values and gradients as f32
up to bf16 rounding, every matmul of forward and backward in bf16, nothing else touched."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mmjax.demo.mixed_precision import bf16_dot_general, bf16_matmuls

# bf16 keeps 8 significant bits: inputs are rounded by <= 2^-9 relative, so a product of two
# rounded operands is off by <= ~0.4%; sums of many such terms partly cancel. 2% of the largest
# magnitude leaves room for the backward's rounded cotangent too, and is ~10x any f32 error.
REL = 2e-2


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn", [
    ((6, 5), (5, 7), (((1,), (0,)), ((), ()))),                      # x @ w
    ((3, 4, 6, 8), (3, 5, 6, 8), (((3,), (3,)), ((0, 2), (0, 2)))),  # "bqhd,bkhd->bhqk"
    ((4, 2, 3, 5), (3, 5, 2, 6), (((1, 3), (2, 1)), ((), ()))),      # two contracting dims
    ((2, 7, 3), (3, 2, 4), (((2,), (0,)), ((0,), (1,)))),            # batch dim not leading on rhs
])
def test_bf16_dot_general_matches_lax(lhs_shape, rhs_shape, dn):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
    y = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
    want = lax.dot_general(x, y, dn, precision=lax.Precision.HIGHEST)
    # under jit, as in training: XLA's op-by-op CPU dot has no bf16 x bf16 -> f32 kernel
    got = jax.jit(bf16_dot_general, static_argnums=2)(x, y, dn)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel(got, want) < REL
    # ... and not merely close: the operands really were rounded to bf16
    assert _rel(got, want) > 1e-5
    g = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    want_dx, want_dy = jax.vjp(lambda a, b: lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST),
                               x, y)[1](g)
    dx, dy = jax.jit(lambda a, b, g: jax.vjp(lambda a, b: bf16_dot_general(a, b, dn), a, b)[1](g))(
        x, y, g)
    assert _rel(dx, want_dx) < REL and _rel(dy, want_dy) < REL


def _model(p, x, ids):
    """A tiny attention block: nested jit, softmax (a custom_jvp), an integer gather."""
    @jax.jit
    def dense(w, h):
        return h @ w

    h = x + p["emb"][ids]                                                  # [B, T, D]
    q, k = dense(p["wq"], h), dense(p["wk"], h)
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    o = jax.nn.softmax(s, axis=-1) @ h
    return jnp.mean(jax.nn.relu(dense(p["wo"], o)) ** 2), o


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
    params = {"emb": f(11, 16), "wq": f(16, 16), "wk": f(16, 16), "wo": f(16, 16)}
    return params, f(3, 9, 16) * 2, jnp.asarray(rng.integers(0, 11, (3, 9)), jnp.int32)


def test_bf16_matmuls_value_and_grad_close_to_f32(problem):
    params, x, ids = problem
    with jax.default_matmul_precision("highest"):
        want = jax.value_and_grad(_model, has_aux=True)(params, x, ids)
    got = jax.jit(jax.value_and_grad(bf16_matmuls(_model), has_aux=True))(params, x, ids)
    (lw, ow), gw = want
    (lg, og), gg = got
    assert abs(float(lg) - float(lw)) < REL * abs(float(lw))
    assert _rel(og, ow) < REL
    for name in params:
        assert _rel(gg[name], gw[name]) < REL, name
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(gg))


def test_every_dot_is_bf16_in_forward_and_backward(problem):
    params, x, ids = problem
    hlo = jax.jit(jax.grad(lambda *a: bf16_matmuls(_model)(*a)[0])).lower(params, x, ids).as_text()
    dots = re.findall(r"stablehlo.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
                      r"(tensor<[^>]*>)", hlo)
    # forward: q, k, scores, probs @ h, out; backward: two dots for each
    assert len(dots) == 15, hlo
    for lhs, rhs, out in dots:
        assert lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xf32>"), (lhs, rhs, out)


def test_functions_without_matmuls_are_unchanged(problem):
    params, x, ids = problem
    f = lambda p, x: jnp.sum(jnp.tanh(x * p["emb"][ids]).sum(-1) ** 2)
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(params, x)["emb"],
                                  jax.jit(jax.grad(bf16_matmuls(f)))(params, x)["emb"])
