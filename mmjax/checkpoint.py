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
    `check_all_used()` raises naming every unexpected tensor.
    """

    def __init__(self, model_dir: str | os.PathLike, normalize: Callable[[str], str] = lambda s: s):
        from safetensors import safe_open

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
        self._handles = {}
        self._paths: dict[str, Path] = {}
        self._where: dict[str, tuple[str, str]] = {}
        for f in files:
            path = d / f
            if not path.is_file():
                raise CheckpointError(f"{d}: shard {f} named in the index is missing", param="model")
            h = safe_open(str(path), framework="numpy")
            self._handles[f] = h
            self._paths[f] = path
            for raw in h.keys():
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
        try:
            return self._handles[f].get_tensor(raw)
        except (AttributeError, TypeError):
            # safetensors' numpy reader has no float8: read the bytes (header offsets) ourselves
            return _read_fp8(self._paths[f], raw)

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


try:
    import ml_dtypes
    _FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover - ml_dtypes ships with jax
    _FP8 = None


def _read_fp8(path: Path, raw: str) -> np.ndarray:
    """One F8_E4M3 tensor of a safetensors file, read from its header's byte offsets."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))[raw]
    if meta["dtype"] != "F8_E4M3":
        raise CheckpointError(f"{path.name}: tensor '{raw}' has dtype {meta['dtype']}, which is not supported",
                              param=raw)
    b, e = meta["data_offsets"]
    data = np.fromfile(path, dtype=np.uint8, count=e - b, offset=8 + n + b)
    return data.view(_FP8).reshape(meta["shape"])


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
