"""safetensors -> params pytree, strictly: every tensor the family needs must be present with the
right shape, every tensor in the files must be used (or explicitly ignored). Orbax save/restore of
the converted params for fast reloads."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from mmjax.errors import CheckpointError


class TensorSource:
    """Lazy reader over one or many (sharded) safetensors files with name normalisation.

    `take(name, shape)` returns a float32-or-native numpy array and records the name as used;
    `check_all_used()` raises naming every unexpected tensor. Each tensor is read from its file's
    byte range into a buffer of its own (the header's offsets), not through a memory map: a
    mapped file's pages count in the process's resident memory once read, so loading through one
    held a second copy of the whole checkpoint until the end.
    """

    def __init__(self, model_dir: str | os.PathLike, normalize: Callable[[str], str] = lambda s: s):
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors weights found (only safetensors are supported)",
                                  param="model")
        self._headers: dict[str, tuple[dict, int]] = {}
        self._paths: dict[str, Path] = {}
        self._where: dict[str, tuple[str, str]] = {}
        for f in files:
            path = d / f
            if not path.is_file():
                raise CheckpointError(f"{d}: shard {f} named in the index is missing", param="model")
            self._headers[f] = _header(path)
            self._paths[f] = path
            for raw in self._headers[f][0]:
                self._where[normalize(raw)] = (f, raw)
        self._used: set[str] = set()
        self._ignored: set[str] = set()
        self._dir = d

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"checkpoint is missing weight '{name}' (expected shape {tuple(shape)})",
                                  param=name)
        f, raw = self._where[name]
        arr = self._get(f, raw)
        if arr.dtype == _FP8 and name.endswith(".weight"):
            arr = self._dequantize_fp8(name, arr)
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"weight '{name}' has shape {tuple(arr.shape)}, expected {tuple(shape)}",
                                  param=name)
        self._used.add(name)
        return arr

    def _get(self, f: str, raw: str) -> np.ndarray:
        meta, start = self._headers[f]
        m = meta[raw]
        dtype = _DTYPES.get(m["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self._paths[f].name}: tensor '{raw}' has dtype {m['dtype']}, which is not "
                                  f"supported", param=raw)
        b, e = m["data_offsets"]
        data = np.fromfile(self._paths[f], dtype=np.uint8, count=e - b, offset=start + b)
        return data.view(dtype).reshape(m["shape"])

    def _dequantize_fp8(self, name: str, w: np.ndarray) -> np.ndarray:
        """An fp8 "compressed-tensors" / FBGEMM-fp8 Linear weight [out, in] (float8_e4m3fn) with
        its `weight_scale` ([out, 1] per channel, or one per tensor) -> float32 w * scale. The
        per-token `input_scale` of static activation schemes is not used (activations stay in
        the model's dtype, or are quantized per token with quantize="fp8"). Block-scaled fp8
        (DeepSeek-V3 / Qwen3 "fp8": `weight_scale_inv` per block, `_dequantize_fp8_blocks`)."""
        base = name[: -len("weight")]
        scale_name = base + "weight_scale"
        if scale_name not in self._where and base + "weight_scale_inv" in self._where:
            return self._dequantize_fp8_blocks(name, w)
        if scale_name not in self._where:
            raise CheckpointError(f"fp8 weight '{name}' has no '{scale_name}' (nor a block-scaled "
                                  f"'{base}weight_scale_inv')", param=name)
        f, raw = self._where[scale_name]
        scale = self._get(f, raw).astype(np.float32)
        self._used.add(scale_name)
        self._ignored |= {n for n in (base + "input_scale", base + "input_scale_ub") if n in self._where}
        if scale.size == 1:
            return w.astype(np.float32) * scale.reshape(())
        if scale.size != w.shape[0]:
            raise CheckpointError(f"'{scale_name}' has shape {scale.shape}: expected one scale per output "
                                  f"channel ({w.shape[0]}) or one per tensor", param=scale_name)
        return w.astype(np.float32) * scale.reshape(-1, 1)

    def _dequantize_fp8_blocks(self, name: str, w: np.ndarray) -> np.ndarray:
        """A block-scaled fp8 weight [out, in] with `weight_scale_inv` [ceil(out / bo), ceil(in / bi)]
        (quantization_config {"quant_method": "fp8", "weight_block_size": [bo, bi]}, [128, 128]
        in DeepSeek-V3 / Qwen3 checkpoints; despite its name the tensor multiplies: w * s per
        block, as DeepSeek's and transformers' dequantization do) -> float32 [out, in]."""
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        f, raw = self._where[scale_name]
        s = self._get(f, raw).astype(np.float32)
        bo, bi = self._fp8_block_size()
        out, d_in = w.shape
        if s.ndim != 2 or s.shape != (-(-out // bo), -(-d_in // bi)):
            raise CheckpointError(f"'{scale_name}' has shape {s.shape}: expected one scale per {bo}x{bi} block of "
                                  f"the {w.shape} weight", param=scale_name)
        self._used.add(scale_name)
        full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :d_in]
        return w.astype(np.float32) * full

    def _fp8_block_size(self) -> tuple[int, int]:
        """quantization_config.weight_block_size of the checkpoint's config.json ([128, 128] if absent)."""
        cfg_path = self._dir / "config.json"
        qc = json.loads(cfg_path.read_text()).get("quantization_config", {}) if cfg_path.is_file() else {}
        block = qc.get("weight_block_size") or (128, 128)
        if len(block) != 2 or min(block) <= 0:
            raise CheckpointError(f"quantization_config.weight_block_size must be [rows, cols], got {block}",
                                  param="weight_block_size")
        return int(block[0]), int(block[1])

    def ignore(self, pattern: str) -> None:
        """Tensors the family knowingly does not use (e.g. CLIP's post_layernorm in LLaVA)."""
        rx = re.compile(pattern)
        self._ignored |= {n for n in self._where if rx.fullmatch(n)}

    def check_all_used(self) -> None:
        extra = sorted(set(self._where) - self._used - self._ignored)
        if extra:
            shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
            raise CheckpointError(f"checkpoint has unexpected weights: {shown}", param=extra[0])


import ml_dtypes  # noqa: E402 (ships with jax)

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": _FP8, "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
           "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
           "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
           "BOOL": np.dtype(np.bool_)}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor table {name: {dtype, shape, data_offsets}} and where its data
    starts."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        try:
            meta = json.loads(fh.read(n))
        except ValueError:
            raise CheckpointError(f"{path.name}: not a safetensors file (unreadable header)", param="model") from None
    meta.pop("__metadata__", None)
    return meta, 8 + n


def save_module(module, directory: str | os.PathLike) -> Path:
    """A module's weights with orbax, in the portable layout (every matmul weight [in, out]: the
    CPU kernels' packing undone; restore with `restore_module`)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from mmjax.packed_weights import unpacked

    directory = Path(directory).absolute()
    state = nnx.to_pure_dict(nnx.state(module))
    state = jax.tree.map(np.asarray, unpacked(state))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory, state, force=True)
    return directory


def restore_module(module, directory: str | os.PathLike, quantize: str | None = None,
                   group_size: int | None = None) -> None:
    """Fill an abstractly built module from weights saved by `save_module` (quantize / group_size:
    how the saved copy is quantized, `mmjax.quant.read_quantization`)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from mmjax.quant import abstract_quantized

    directory = Path(directory).absolute()
    if not directory.exists():
        raise CheckpointError(f"no orbax checkpoint at {directory}", param="directory")
    state = nnx.state(module)
    like = nnx.to_pure_dict(state)
    if quantize is not None:       # the saved copy holds QArrays where the module's linear layers are
        flat = dict(nnx.to_flat_state(state))
        like = nnx.to_pure_dict(nnx.from_flat_state({
            p: v.replace(abstract_quantized(v.get_value(), quantize, group_size)
                         if v.get_metadata().get("quantize") or p[-1] in ("gate_up_proj", "down_proj") and
                         len(v.get_value().shape) == 3 else v.get_value())
            for p, v in flat.items()}))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(directory, like)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(module, state)
