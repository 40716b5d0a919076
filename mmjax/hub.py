"""Model id -> local directory: a local path, the local HF cache, or a hub download when online."""
from __future__ import annotations

import os
from pathlib import Path

from mmjax.errors import CheckpointError

# Everything a VLM checkpoint needs; weights in other formats (.bin, .pt) are never fetched.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def resolve(model: str | os.PathLike, *, revision: str | None = None) -> Path:
    """Return a local directory holding config.json for `model` (path or hub id).

    With HF_HUB_OFFLINE=1 huggingface_hub answers from the local cache only, so this works
    offline for anything downloaded before.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json (not a Hugging Face model directory)", param="model")
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"model {text!r} is neither a local model directory nor a hub id 'org/name'",
                              param="model")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id=text, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # offline with an empty cache, unknown repo, gated repo, ...
        raise CheckpointError(f"could not resolve model {text!r}: {type(e).__name__}: {e}", param="model") from e
