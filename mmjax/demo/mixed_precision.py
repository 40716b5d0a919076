"""Mixed-precision training on CPU: run a function's f32 matmuls as bf16 x bf16 -> f32 dots.

On CPUs with AMX / AVX512-BF16 (this project's 2-core Xeon), XLA's CPU backend runs a dot of
bf16 operands with an f32 result (`preferred_element_type=float32`) ~4x faster than the f32 dot
(1,030 vs 245 GFLOP/s at [2048, 480] x [480, 160]); a bf16 -> bf16 dot is no faster than f32.
JAX's own transpose rules for such a dot upcast the f32 cotangent and the saved operand to f32,
so the backward pass would stay slow: `bf16_matmuls` therefore swaps every f32 `dot_general`
in the traced function for one with a custom VJP whose two backward dots are bf16 x bf16 -> f32
as well. Everything else (norms, softmax, losses, the optimizer, the f32 master weights) is
untouched: the usual bf16 mixed-precision recipe, applied to mmjax's serving forward without
changing it.

    grads = jax.grad(bf16_matmuls(loss_fn))(params, batch)    # inside jax.jit
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore


def _matmul(x, y, xb, xm, xk, yb, yk, yn):
    """bf16 x bf16 -> f32 contraction of x's dims xk with y's yk, batched over xb / yb.
    Result: [*batch, *x's dims xm, *y's dims yn] (in those orders).

    With two or more batch dims the operands are first made one canonical [B, M, K] x [B, K, N]
    dot: XLA's CPU backend sends some such dots (e.g. a contraction that is not minor) to its
    generic dot, which has no bf16 x bf16 -> f32 kernel. With at most one, the dot is left as
    it is (its library dot takes any operand layout; transposing first costs ~20%)."""
    x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
    if len(xb) > 1:
        size = lambda a, dims: int(np.prod([a.shape[d] for d in dims], dtype=np.int64))
        b, m, k, n = size(x, xb), size(x, xm), size(x, xk), size(y, yn)
        lhs = jnp.transpose(x, (*xb, *xm, *xk)).reshape(b, m, k)
        rhs = jnp.transpose(y, (*yb, *yk, *yn)).reshape(b, k, n)
        out = lax.dot_general(lhs, rhs, (((2,), (1,)), ((0,), (0,))),
                              preferred_element_type=jnp.float32)
        return out.reshape(*(x.shape[d] for d in (*xb, *xm)), *(y.shape[d] for d in yn))
    out = lax.dot_general(x, y, ((tuple(xk), tuple(yk)), (tuple(xb), tuple(yb))),
                          preferred_element_type=jnp.float32)
    # dot_general's output: batch, then each operand's free dims in increasing order
    nb, sm, sn = len(xb), sorted(xm), sorted(yn)
    perm = (*range(nb), *(nb + sm.index(d) for d in xm),
            *(nb + len(xm) + sn.index(d) for d in yn))
    return out if perm == tuple(range(out.ndim)) else jnp.transpose(out, perm)


def bf16_dot_general(lhs, rhs, dimension_numbers, out_dtype=jnp.float32):
    """lax.dot_general(lhs, rhs, dimension_numbers) with bf16 operands and f32 accumulation,
    forward and backward (the cotangent is rounded to bf16 for the two backward dots)."""
    (lc, rc), (lb, rb) = map(lambda t: tuple(map(tuple, t)), dimension_numbers)
    lf = tuple(d for d in range(lhs.ndim) if d not in lb and d not in lc)
    rf = tuple(d for d in range(rhs.ndim) if d not in rb and d not in rc)
    nb, nm = len(lb), len(lf)
    gb, gm = tuple(range(nb)), tuple(range(nb, nb + nm))
    gn = tuple(range(nb + nm, nb + nm + len(rf)))

    @jax.custom_vjp
    def dot(x, y):
        return _matmul(x, y, lb, lf, lc, rb, rc, rf)

    def fwd(x, y):
        return dot(x, y), (x, y)

    def bwd(res, g):
        x, y = res
        dx = _matmul(g, y, gb, gm, gn, rb, rf, rc)           # [*batch, *lhs free, *contract]
        dy = _matmul(x, g, lb, lc, lf, gb, gm, gn)           # [*batch, *contract, *rhs free]
        return (jnp.transpose(dx, np.argsort((*lb, *lf, *lc))).astype(x.dtype),
                jnp.transpose(dy, np.argsort((*rb, *rc, *rf))).astype(y.dtype))

    dot.defvjp(fwd, bwd)
    return dot(lhs, rhs).astype(out_dtype)


def _eval(jaxpr, consts, args) -> list:
    """jax.core.eval_jaxpr, with f32 dot_generals swapped (also inside nested jit calls)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dot_general" and all(v.aval.dtype == jnp.float32 for v in eqn.invars):
            outs = [bf16_dot_general(*ins, eqn.params["dimension_numbers"],
                                     eqn.outvars[0].aval.dtype)]
        elif name in ("pjit", "jit"):
            outs = _eval(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, ins)
        else:
            # anything else (custom_jvp / custom_vjp calls, loops) binds unchanged, so custom
            # derivative rules such as softmax's keep working; dots inside loops stay f32
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def bf16_matmuls(fn: Callable) -> Callable:
    """fn(*args) -> the same function with its f32 matmuls in bf16 (f32 accumulation, f32
    outputs), differentiable (see `bf16_dot_general`). Traced per call: use it under jax.jit."""
    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)
    return wrapped
