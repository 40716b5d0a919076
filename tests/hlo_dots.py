"""Read the matmuls out of lowered StableHLO text (jit(...).lower(...).as_text() or an
Exported's mlir_module()): the precision tests' one helper for every family's steps."""
from __future__ import annotations

import re

# stablehlo.dot_general %a, %b, ... : (tensor<AxBxbf16>, tensor<BxCxbf16>) -> tensor<AxCxf32>; mmjax's
# CPU matmul kernel (mmjax.kernels.cpu_gemv) counts as a dot: stablehlo.custom_call @mmjax_gemv_bf16(...)
_DOT = re.compile(r"stablehlo\.(?:dot_general|dot|ragged_dot|custom_call @mmjax_(?:gemv_\w+|matmul_bf16p))\b.*?:\s*"
                  r"\((tensor<[^>]*>), (tensor<[^>]*>)[^)]*\)"
                  r"\s*->\s*(tensor<[^>]*>)")


def dots(text: str) -> list[tuple[str, str, str]]:
    """(lhs type, rhs type, result type) of every dot in the module (mmjax's CPU matmul kernel
    calls included), e.g. ("tensor<1x64xbf16>", ...)."""
    return _DOT.findall(text)


def elem(t: str) -> str:
    """tensor<4x1x64xbf16> -> bf16"""
    return t[:-1].rsplit("x", 1)[-1] if "x" in t else t[7:-1]


def bf16_dot_violations(text: str) -> list[tuple[str, str, str]]:
    """Dots with a bf16 operand that are not bf16 x bf16 -> f32 (mixed operands, or a bf16
    result: XLA:CPU's AMX path is the f32-result one)."""
    return [d for d in dots(text) if "bf16" in (elem(d[0]), elem(d[1]))
            and (elem(d[0]), elem(d[1]), elem(d[2])) != ("bf16", "bf16", "f32")]
