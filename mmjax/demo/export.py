"""Write a Hugging Face LLaVA-layout checkpoint directory without torch or transformers.

Files (what transformers 5 itself writes for LlavaForConditionalGeneration + LlavaProcessor,
plus the v4-style preprocessor_config.json so older loaders find the image processor):

  config.json               LlavaConfig (CLIPVisionConfig + LlamaConfig)
  generation_config.json    greedy, eos </s>, max_new_tokens
  model.safetensors         float32 tensors under HF names (see config.state_shapes)
  tokenizer.json            the byte-level BPE (tokenizers)
  tokenizer_config.json     bos/eos/pad/unk, image_token, chat_template
  special_tokens_map.json
  chat_template.jinja       same template (transformers 5 reads it from here first)
  preprocessor_config.json  CLIPImageProcessor (squash to image_size, no crop)
  processor_config.json     LlavaProcessor (patch_size, strategy, num_additional_image_tokens)
"""
from __future__ import annotations

import json
import os

import numpy as np

from mmjax.demo import config as C
from mmjax.demo import tokenizer as T


def _dump(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def check_state(config_dict: dict, state: dict) -> None:
    """Names and shapes must be exactly those transformers expects (no missing/extra)."""
    want = C.state_shapes(config_dict)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = sorted(k for k in set(want) & set(state) if tuple(np.shape(state[k])) != want[k])
    if missing or extra or bad:
        raise ValueError(
            f"checkpoint state does not match the config: missing={missing[:5]} "
            f"(+{max(0, len(missing) - 5)}), extra={extra[:5]}, "
            f"bad shapes={[(k, np.shape(state[k]), want[k]) for k in bad[:5]]}")


def write_hf_checkpoint(out_dir: str, config_dict: dict, tokenizer,
                        safetensors_state: dict, *, max_new_tokens: int = 32) -> list[str]:
    """Write every file of the checkpoint into out_dir; returns the file names written.

    tokenizer: a `tokenizers.Tokenizer` (e.g. `mmjax.demo.tokenizer.train_tokenizer()`).
    safetensors_state: {hf_name: array}; saved as contiguous float32 (the shipped format).
    """
    from safetensors.numpy import save_file

    check_state(config_dict, safetensors_state)
    vocab = config_dict["text_config"]["vocab_size"]
    if tokenizer.get_vocab_size() != vocab:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, "
                         f"config vocab_size is {vocab}")
    if tokenizer.token_to_id(T.IMAGE) != config_dict["image_token_index"]:
        raise ValueError("image_token_index must be the id of <image>")
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(config_dict)
    cfg.setdefault("transformers_version", "5.23.0")
    _dump(os.path.join(out_dir, "config.json"), cfg)
    _dump(os.path.join(out_dir, "generation_config.json"),
          C.generation_config(config_dict, max_new_tokens))
    state = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32))
             for k, v in sorted(safetensors_state.items())}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    max_len = config_dict["text_config"]["max_position_embeddings"]
    T.save_tokenizer(tokenizer, out_dir, model_max_length=max_len)
    tc_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["processor_class"] = "LlavaProcessor"
    _dump(tc_path, tc)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(T.CHAT_TEMPLATE)
    _dump(os.path.join(out_dir, "preprocessor_config.json"), C.preprocessor_config(config_dict))
    _dump(os.path.join(out_dir, "processor_config.json"), C.processor_config(config_dict))
    return sorted(os.listdir(out_dir))


def random_state(config_dict: dict, seed: int = 0, std: float = 0.02) -> dict:
    """Random float32 weights under the HF names (norm scales 1, biases 0): for tests and the
    export smoke check, not a trained model."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in C.state_shapes(config_dict).items():
        if "norm" in name and name.endswith(".weight"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def hf_state(model, config_dict: dict) -> dict:
    """A LlavaModel (mmjax.models.llava, the module tree the loader fills) -> {hf_name: float32
    array} under the names and shapes of `config.state_shapes`: the inverse of mmjax's loader,
    computed rather than written out. The loader (`LlavaModel.hf_weights`) only moves elements
    (transposes [out, in] linears, fuses q|k|v and gate|up, lays the patch conv out as a matmul),
    so running it once on a checkpoint whose every element holds its own index (int32, read as
    is, kept on the host) tells, for each Variable element, which HF element it came from; the
    model's values are scattered back there. CLIP's post_layernorm (LLaVA reads an inner layer,
    the loader skips it) is written as the identity; anything else the model does not hold (ViT
    layers past the feature layer, never built) is an error."""
    import tempfile

    from flax import nnx
    from safetensors.numpy import save_file

    from mmjax.checkpoint import TensorSource
    from mmjax.models.llava import LlavaModel, normalize_name
    from mmjax.models.nn.weights import Weights, build

    shapes = C.state_shapes(config_dict)
    index, start = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        index[name] = np.arange(start, start + size, dtype=np.int32).reshape(shape)
        start += size
    layout = build(lambda: LlavaModel(model.config))
    with tempfile.TemporaryDirectory() as d:
        save_file(index, os.path.join(d, "model.safetensors"))
        w = Weights(TensorSource(d, normalize_name), on_device=False)
        layout.hf_weights(w)
        w.finish(layout)
    flat = np.zeros((start,), np.float32)
    filled = np.zeros((start,), bool)
    values = dict(nnx.to_flat_state(nnx.state(model)))
    for path, var in nnx.to_flat_state(nnx.state(layout)):
        at = np.asarray(var.get_value()).ravel()
        flat[at] = np.asarray(values[path].get_value(), np.float32).ravel()
        filled[at] = True
    out = {}
    for name, shape in shapes.items():
        at = index[name]
        if not filled[at].all():
            if name.startswith("vision_tower.post_layernorm."):
                out[name] = np.full(shape, 1.0 if name.endswith(".weight") else 0.0, np.float32)
                continue
            raise ValueError(f"the model holds no value for {name} (export needs every layer: "
                             f"vision_feature_layer -1)")
        out[name] = flat[at]
    return out
