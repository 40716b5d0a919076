"""Train mmjax-shapes from scratch on CPU (JAX + optax) and write it as a HF LLaVA checkpoint.

    python -m mmjax.demo.train --out DIR     # the defaults: the 30-minute from-scratch recipe

One source of truth: the model is mmjax's own serving module, `models.llava.LlavaModel`
(vision_tower, multi_modal_projector, language_model), built and filled by mmjax's loader
(`models.load_family`) from a random HF state (`export.random_state`) written as a checkpoint,
or from a checkpoint to continue (`grow`n to a larger config on the module tree). The forward is
its `encode` and the decoder's `__call__` / `logits`; the intermediates the aux losses read (the
residual stream entering the last layer, its attention weights and per-head outputs) are what
the decoder sows, collected with `nnx.capture` (`nn.capture.captured`). The steps are jitted
pure functions of the Param State (`nnx.state` of a `Trainee`: the model and its aux heads),
merged into the modules inside the trace; the optimizer is optax over that State. So what is
trained is exactly what is served. At the end the model is written by
`export.write_hf_checkpoint` under HF names / shapes (`export.hf_state`: the loader's inverse).

Data: a pool of scenes is drawn once (`make_pool`: client-like PNG/JPEG round trip, then the
CLIP processor's bicubic squash to image_size, kept as uint8 [N, R, R, 3]; /255 and mean/std run
inside the jitted step, so pixels equal `shapes.preprocess` / mmjax's ClipImagePolicy). Every
step draws fresh (scene, question) pairs from the pool: the question type first (weights in
`QTYPE_WEIGHTS`), then a scene it applies to, then the question and exact answer from the
scene's metadata. Loss: cross entropy on the answer tokens and the closing </s> only, plus
(weight `--aux`) training-only auxiliary losses whose linear heads are NOT part of the exported
model (`AuxHeads`, `make_steps`): on the image token embeddings, per patch which (color, shape)
covers it and its shape's place left to right, per image the shapes left to right (3 slots);
for "exists", a patch-match head on the decoder's image tokens; for "describe", where the last
layer's head 0 looks and what it reads. Without the first ones the answer loss sat on the
language-prior plateau (chance accuracy on everything but color) for 600+ steps.

Schedule: AdamW with a time-based warmup + cosine decay (`--minutes` is the budget; the LR is a
function of elapsed wall time, so a busy machine only costs steps, not the decay shape). With
`--vision-frac f`, the first f of the budget trains only the ViT + projector on the image aux
losses (cheaper steps than full ones; its own warmup + cosine), the rest the whole model
(again warmup + cosine): within the same budget that raises describe accuracy
(mmjax/demo/README.md, "Training").

Matmuls: with `bf16` (the CLI default; `--no-bf16` for plain f32) every matmul of the training
steps, forward and backward, runs with bf16 operands and f32 accumulation
(`mixed_precision.bf16_matmuls`; weights, optimizer, norms, softmax and losses stay f32): on an
AMX CPU a step costs about half, so the time budget holds more steps and the model ends more
accurate (figures: mmjax/demo/README.md, "Training").
Evaluation and export are f32.

Held-out accuracy during training is teacher-forced greedy exact match (an answer counts when
the argmax at every answer position, </s> included, is the gold token, which is exactly when
greedy decoding reproduces the gold answer), per question type, on freshly drawn scenes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.demo import config as C
from mmjax.demo import export as E
from mmjax.demo import shapes as S
from mmjax.demo import tokenizer as T

QTYPE_WEIGHTS = {"shape": 0.15, "color": 0.15, "count": 0.2, "exists": 0.25, "describe": 0.25}
# "describe" mistakes are order mistakes, half of them in scenes where one color is shared by
# shapes of different kinds (there the order is a coin toss), the rest between shapes whose
# centers are close in x. --hard-describe draws that share of describe questions from those
# scenes: a shared color, or two centers closer than this fraction of the width.
CLOSE_CENTERS = 0.15


def is_hard_describe(scene) -> bool:
    """Two shapes of one color and different kinds, or two centers < CLOSE_CENTERS * width apart."""
    sh = scene.shapes
    if len(sh) < 2:
        return False
    shared_color = any(a.color == b.color and a.kind != b.kind
                       for i, a in enumerate(sh) for b in sh[i + 1:])
    xs = sorted(s.cx for s in sh)
    return shared_color or min(b - a for a, b in zip(xs, xs[1:])) < CLOSE_CENTERS * scene.width


# ----------------------------------------------------------------------------- data

def _pool_chunk(args):
    seed, n, image_size, client_roundtrip = args
    from PIL import Image

    rng = np.random.default_rng(seed)
    imgs = np.empty((n, image_size, image_size, 3), np.uint8)
    scenes = []
    for i in range(n):
        # a third of the pool is one-shape scenes (shape/color questions need them)
        n_shapes = 1 if rng.random() < 1 / 3 else None
        img, sc = S.draw_scene(rng, n_shapes=n_shapes)
        if client_roundtrip:
            img = S.encode_like_client(img, rng)
        imgs[i] = np.asarray(img.resize((image_size, image_size), Image.Resampling.BICUBIC))
        scenes.append(sc)
    return imgs, scenes


def make_pool(n: int, image_size: int, seed: int, workers: int = 2,
              client_roundtrip: bool = True, cache_dir: str | None = None,
              ) -> tuple[np.ndarray, list]:
    """n scenes -> (uint8 [n, R, R, 3] pixels after the squash resize, [Scene]).

    cache_dir: reuse a pool drawn before with the same (n, R, seed, roundtrip) (pickle)."""
    if cache_dir:
        import pickle
        path = Path(cache_dir) / f"pool_{n}_{image_size}_{seed}_{int(client_roundtrip)}.pkl"
        if path.is_file():
            with open(path, "rb") as f:
                return pickle.load(f)
        out = make_pool(n, image_size, seed, workers, client_roundtrip)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".tmp", "wb") as f:
            pickle.dump(out, f, protocol=4)
        os.replace(str(path) + ".tmp", path)
        return out
    chunk = 250
    jobs = [(seed * 1_000_003 + i, min(chunk, n - s), image_size, client_roundtrip)
            for i, s in enumerate(range(0, n, chunk))]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_pool_chunk, jobs)
    else:
        parts = [_pool_chunk(j) for j in jobs]
    return (np.concatenate([p[0] for p in parts]), [s for p in parts for s in p[1]])


class Encoder:
    """(question, answer) -> (token ids with the image placeholder expanded, index of the first
    answer token). Cached: there are only a few thousand distinct pairs."""

    def __init__(self, tok, n_image_tokens: int):
        self.tok, self.n_img, self.cache = tok, n_image_tokens, {}

    def expand(self, ids):
        out = []
        for t in ids:
            out.extend([T.IMAGE_ID] * self.n_img if t == T.IMAGE_ID else [t])
        return out

    def __call__(self, q, a: str):
        """q: the question, or (system prompt, question)."""
        key = (q, a)
        if key not in self.cache:
            system, q = q if isinstance(q, tuple) else (None, q)
            full = self.expand(T.encode_chat(self.tok, T.vqa_messages(q, a, system)))
            prompt = self.expand(T.encode_chat(self.tok, T.vqa_messages(q, None, system), True))
            assert full[:len(prompt)] == prompt, (q, a)
            self.cache[key] = (np.asarray(full, np.int32), len(prompt))
        return self.cache[key]

    def phrases(self, q: str, a: str) -> np.ndarray:
        """[len(full)] for a "Describe the image." answer: at each color / kind token, which
        phrase left to right (1-3) it belongs to; 0 elsewhere (prompt, "a", ", ", "and", </s>,
        and every token of other question types)."""
        full, p = self(q, a)
        out = np.zeros(len(full), np.int32)
        if q != S.Q_DESCRIBE:
            return out
        article, seps = self.tok.token_to_id("a\u0120"), {self.tok.token_to_id(",\u0120"),
                                                          self.tok.token_to_id("and\u0120"),
                                                          T.EOS_ID}
        k = 0
        for i in range(p, len(full)):
            if full[i] == article:
                k += 1
            elif full[i] not in seps:
                out[i] = k
        return out


def max_seq_len(enc: Encoder) -> int:
    """Longest training sequence (3-shape description with the longest words), rounded to 8."""
    longest = 0
    for q in [S.Q_SHAPE, S.Q_COLOR, S.Q_COUNT, S.Q_DESCRIBE, S.exists_question("yellow", "triangle"),
              (S.JSON_SYSTEM, S.Q_SHAPE)]:
        a = "a yellow triangle, a yellow triangle and a yellow triangle"
        longest = max(longest, len(enc(q, a)[0]))
    return int(math.ceil(longest / 8) * 8)


N_PATCH_CLASSES = 1 + len(S.COLORS) * len(S.SHAPES)


def shape_class(color: str, kind: str) -> int:
    """Aux class of a (color, shape) pair: 1 + color * 3 + kind (0 is background / empty)."""
    return 1 + S.COLORS.index(color) * len(S.SHAPES) + S.SHAPES.index(kind)


def image_token_index(ids, image_id: int, n_image_tokens: int):
    """[B, T] token ids -> (is-image mask [B, T], index of each position's image feature [B, T],
    clipped to [0, n_image_tokens))."""
    is_img = ids == image_id
    return is_img, jnp.clip(jnp.cumsum(is_img, axis=1) - 1, 0, n_image_tokens - 1)


def patch_labels(scene, grid: int, min_cover: float = 0.08) -> np.ndarray:
    """Auxiliary targets per ViT patch (row-major grid x grid over the squashed canvas), of the
    shape whose bounding box covers the most of the patch (at least `min_cover` of it):
    [grid^2] class, 0 = background, else 1 + color * 3 + kind; then [grid^2] rank, 0 =
    background, else 1 + the shape's place left to right (what "Describe the image." orders by)."""
    out = np.zeros((grid * grid,), np.int32)
    rank = np.zeros((grid * grid,), np.int32)
    order = {id(sh): r for r, sh in enumerate(scene.left_to_right())}
    pw, ph = scene.width / grid, scene.height / grid
    for i in range(grid):
        y0, y1 = i * ph, (i + 1) * ph
        for j in range(grid):
            x0, x1 = j * pw, (j + 1) * pw
            best, lab, r = min_cover * pw * ph, 0, 0
            for sh in scene.shapes:
                bx0, by0, bx1, by1 = sh.bbox
                a = max(0.0, min(x1, bx1) - max(x0, bx0)) * max(0.0, min(y1, by1) - max(y0, by0))
                if a > best:
                    best = a
                    lab = shape_class(sh.color, sh.kind)
                    r = 1 + order[id(sh)]
            out[i * grid + j] = lab
            rank[i * grid + j] = r
    return np.concatenate([out, rank])


def slot_labels(scene) -> np.ndarray:
    """Auxiliary per-image target: the shapes left to right as 3 slots of
    1 + color * 3 + kind, 0 for an empty slot (what "Describe the image." says)."""
    out = np.zeros((S.MAX_SHAPES,), np.int32)
    for i, sh in enumerate(scene.left_to_right()):
        out[i] = shape_class(sh.color, sh.kind)
    return out


def exists_class(question: str) -> int:
    """The patch class (1 + color * 3 + kind) an "Is there a <color> <shape>?" question asks for."""
    return shape_class(*S.exists_target(question))


class Sampler:
    """Draws training/eval batches from a scene pool."""

    def __init__(self, imgs, scenes, enc: Encoder, seq_len: int, weights=None, grid: int = 0,
                 hard_describe: float = 0.0):
        self.imgs, self.scenes, self.enc, self.T = imgs, scenes, enc, seq_len
        self.labels = (np.stack([np.concatenate([patch_labels(sc, grid), slot_labels(sc)])
                                 for sc in scenes]) if grid
                       else np.zeros((len(scenes), 1), np.int32))
        # count / exists / describe draw the shape count uniformly (as the contract's evaluation
        # does), not the pool's mix, which is 55% one-shape (a third of it is pinned to one)
        self.by_count = [np.asarray([i for i, s in enumerate(scenes) if s.count == n])
                         for n in range(1, S.MAX_SHAPES + 1)]
        self.one = self.by_count[0]
        self.hard_describe = hard_describe
        self.hard = np.asarray([i for i, s in enumerate(scenes) if is_hard_describe(s)])
        self.types = list(QUESTION_TYPES)
        w = weights or QTYPE_WEIGHTS
        if set(w) - set(self.types):
            raise ValueError(f"unknown question types {sorted(set(w) - set(self.types))}; expected {self.types}")
        self.p = np.asarray([w.get(t, 0.0) for t in self.types], np.float64)
        self.p /= self.p.sum()

    def example(self, rng, qtype=None):
        """-> (scene index, question, answer, qtype); a "<type>_json" question is (JSON_SYSTEM,
        question) with the answer's JSON form (`shapes.json_answer`)."""
        qtype = qtype or self.types[int(rng.choice(len(self.types), p=self.p))]
        base = qtype.removesuffix("_json")
        if base in ("shape", "color"):
            i = int(self.one[rng.integers(len(self.one))])
        elif base == "describe" and len(self.hard) and rng.random() < self.hard_describe:
            i = int(self.hard[rng.integers(len(self.hard))])
        else:
            group = self.by_count[int(rng.integers(len(self.by_count)))]
            i = int(group[rng.integers(len(group))])
        q, a = S.make_question(rng, self.scenes[i], base)
        if base != qtype:
            q, a = (S.JSON_SYSTEM, q), S.json_answer(base, a)
        return i, q, a, qtype

    def batch(self, rng, b: int, examples=None):
        examples = examples or [self.example(rng) for _ in range(b)]
        ids = np.full((b, self.T), T.PAD_ID, np.int32)
        mask = np.zeros((b, self.T), np.float32)      # 1 where the NEXT token is an answer token
        for r, (i, q, a, _) in enumerate(examples):
            full, p = self.enc(q, a)
            ids[r, :len(full)] = full
            mask[r, p - 1:len(full) - 1] = 1.0
        sel = [e[0] for e in examples]
        query = np.asarray([[exists_class(q) if t == "exists" else 0] for _, q, _, t in examples],
                           np.int32)
        # per position: the describe phrase (1-3) of the NEXT token if it is a color / kind.
        # Label columns: patch class [n] | patch rank [n] | slots [3] | exists query [1] | phrase [T]
        phrase = np.zeros((b, self.T), np.int32)
        for r, (i, q, a, _) in enumerate(examples):
            ph = self.enc.phrases(q, a)
            phrase[r, :len(ph) - 1] = ph[1:]
        return (self.imgs[sel], ids, mask,
                np.concatenate([self.labels[sel], query, phrase], axis=1), [e[3] for e in examples])


# the five question types, then the JSON forms of the single-value ones (`shapes.json_answer`)
QUESTION_TYPES = S.QUESTION_TYPES + tuple(f"{t}_json" for t in S.JSON_TYPES)


# ----------------------------------------------------------------------------- model

def _check_growth(old, new) -> None:
    """Can a checkpoint of LlavaConfig `old` start a model of `new` (`grow`)? ValueError if not."""
    o, n = old.text, new.text
    if n.num_kv_heads != o.num_kv_heads:
        r, rem = divmod(n.num_kv_heads, o.num_kv_heads)
        if rem or n.num_heads % n.num_kv_heads or n.num_heads != o.num_heads or n.head_dim != o.head_dim:
            raise ValueError(f"cannot grow {o.num_kv_heads} KV heads to {n.num_kv_heads} "
                             f"(must be a multiple that divides {n.num_heads} query heads, same "
                             f"query heads and head_dim)")
    ov, nv = old.vision, new.vision
    if nv.patch_size != ov.patch_size:
        f, rem = divmod(nv.patch_size, ov.patch_size)
        if rem or nv.image_size // nv.patch_size != ov.image_size // ov.patch_size:
            raise ValueError(f"cannot grow patch {ov.patch_size} to {nv.patch_size}: must be a "
                             f"multiple with the same patch grid")
    for what, a, b in (("decoder", o.num_layers, n.num_layers), ("vision", ov.num_layers, nv.num_layers)):
        if b < a:
            raise ValueError(f"the checkpoint has {a} {what} layers, the config {b}")


def _zero(linear) -> None:
    """A Linear's kernel and bias set to zeros (its output then adds nothing)."""
    for var in (linear.kernel, linear.bias):
        if var is not None:
            var.set_value(jnp.zeros_like(var.get_value()))


def _grow_layers(old, new, outputs: tuple[str, ...]) -> None:
    """new layers (an nnx.List as long as old or longer) <- old: the first len(old) copy it, the
    new top ones are copies of its last layer with zero output projections (`outputs`: the
    attention's and the MLP's, as attribute paths), so each new residual block adds nothing and
    the grown model starts as exactly the old function."""
    for i, layer in enumerate(new):
        nnx.update(layer, nnx.state(old[min(i, len(old) - 1)]))
        if i >= len(old):
            for path in outputs:
                mod = layer
                for name in path.split("."):
                    mod = getattr(mod, name)
                _zero(mod)


def _grow_kv_heads(attn, old, new) -> None:
    """More KV heads than the checkpoint (GQA -> fewer query heads per KV head): each old KV
    head's k / v columns of the fused `qkv_proj` (q | k | v, as `Attention` holds them) are
    repeated for the new heads its query heads now map to, so the grown model computes exactly
    the old function; training then lets the copies differ."""
    if new.num_kv_heads == old.num_kv_heads:
        return
    r = new.num_kv_heads // old.num_kv_heads
    q_out, kv_out, hd = old.num_heads * old.head_dim, old.num_kv_heads * old.head_dim, old.head_dim

    def repeat_heads(t):  # query head h reads KV head h // (heads / kv_heads): repeat, not tile
        return jnp.repeat(t.reshape(*t.shape[:-1], -1, hd), r, axis=-2).reshape(*t.shape[:-1], -1)

    for var in (attn.qkv_proj.kernel, attn.qkv_proj.bias):
        if var is not None:
            q, k, v = jnp.split(var.get_value(), [q_out, q_out + kv_out], axis=-1)
            var.set_value(jnp.concatenate([q, repeat_heads(k), repeat_heads(v)], axis=-1))


def _grow_patches(emb, old, new) -> None:
    """Same patch grid at a higher resolution (e.g. 64 px / patch 8 -> 128 px / patch 16):
    each old patch-embedding pixel weight is spread over the f x f new pixels it now covers
    (divided by f * f), so a new patch computes the old one on its f x f box average. The
    higher-resolution squash is not exactly the box-upsampled lower one, so this is a warm start,
    not the same function. The patch_embedding kernel is [p * p * c, d] over (row, col, channel)."""
    if new.patch_size == old.patch_size:
        return
    f, p = new.patch_size // old.patch_size, old.patch_size
    w = emb.patch_embedding.kernel.get_value()
    w = w.reshape(p, p, -1, w.shape[-1])
    w = jnp.repeat(jnp.repeat(w, f, axis=0), f, axis=1) / (f * f)
    emb.patch_embedding.kernel.set_value(w.reshape(-1, w.shape[-1]))


def grow(old, cfg):
    """A LlavaModel of config `cfg` that starts as the trained `old` (a LlavaModel): every
    Variable copied by its module path, then grown where the configs differ (more decoder or ViT
    layers, more KV heads, a larger patch over the same grid; `_check_growth` says what is
    possible)."""
    from mmjax.models.llava import LlavaModel
    from mmjax.models.nn.weights import build

    _check_growth(old.config, cfg)
    new = build(lambda: LlavaModel(cfg))
    nnx.update(new, nnx.state(old))
    _grow_layers(old.language_model.layers, new.language_model.layers, ("self_attn.o_proj", "mlp.down_proj"))
    for layer in new.language_model.layers:
        _grow_kv_heads(layer.self_attn, old.config.text, cfg.text)
    _grow_layers(old.vision_tower.encoder.layers, new.vision_tower.encoder.layers, ("self_attn.out_proj", "mlp.fc2"))
    _grow_patches(new.vision_tower.embeddings, old.config.vision, cfg.vision)
    return new


def init_model(cfg_dict: dict, tok, seed: int, init_from: str | None = None):
    """-> (LlavaConfig, the LlavaModel to train, float32): a random HF state written as a
    checkpoint and read by mmjax's own loader (`models.load_family`), so the model is built
    and laid out exactly as serving builds it. init_from: an HF checkpoint dir to continue from
    instead (its config may be smaller: `grow`)."""
    from mmjax.models import load_family
    from mmjax.models.llava import LlavaConfig

    cfg = LlavaConfig.from_hf(cfg_dict)
    if init_from:
        with open(os.path.join(init_from, "config.json")) as f:
            old_dict = json.load(f)
        _check_growth(LlavaConfig.from_hf(old_dict), cfg)
        _, old = load_family(Path(init_from), old_dict)
        return cfg, grow(old, cfg)
    state = E.random_state(cfg_dict, seed=seed)
    with tempfile.TemporaryDirectory() as d:
        E.write_hf_checkpoint(d, cfg_dict, tok, state)
        _, model = load_family(Path(d), cfg_dict)
    return cfg, model


class AuxHeads(nnx.Module):
    """Training-only linear heads (not exported). On the image token embeddings: per patch
    (`w`, `b`) and per image over all tokens flattened -> 3 left-to-right slots (`sw`, `sb`).
    Per patch, its shape's rank left to right (`rw`, `rb`).
    On the decoder's image-token states entering the last layer (RMS-normed, `match_norm`), for
    "exists" questions: does this patch show the asked (color, shape) (`mw`, `mb`). On the last
    layer's head-0 output at a description's color / kind positions: the described shape's
    (color, shape) (`hw`, `hb`)."""

    def __init__(self, cfg, seed: int):
        from mmjax.models.nn.norm import RMSNorm

        rng = np.random.default_rng(seed + 7)
        d, n = cfg.text.hidden_size, cfg.image_tokens_per_image
        k = N_PATCH_CLASSES

        def p(a):
            return nnx.Param(jnp.asarray(np.asarray(a, np.float32)))

        self.w, self.b = p(0.02 * rng.standard_normal((d, k))), p(np.zeros((k,)))
        self.sw = p(0.02 / np.sqrt(n) * rng.standard_normal((n * d, S.MAX_SHAPES * k)))
        self.sb = p(np.zeros((S.MAX_SHAPES * k,)))
        self.rw, self.rb = p(0.02 * rng.standard_normal((d, 1 + S.MAX_SHAPES))), p(np.zeros((1 + S.MAX_SHAPES,)))
        self.mw, self.mb = p(0.02 * rng.standard_normal((d,))), p(np.zeros(()))
        self.hw, self.hb = p(0.02 * rng.standard_normal((cfg.text.head_dim, k))), p(np.zeros((k,)))
        self.match_norm = RMSNorm(d, 1e-6, with_scale=False)

    def image_losses(self, feats, plabels):
        """The aux losses on the image token embeddings feats [B, n, D]: per patch its (color,
        kind) and its shape's place left to right, per image the shapes left to right."""
        import optax

        n = feats.shape[1]
        pl = feats @ self.w.get_value() + self.b.get_value()
        aux = optax.softmax_cross_entropy_with_integer_labels(pl, plabels[:, :n]).mean()
        sl = feats.reshape(feats.shape[0], -1) @ self.sw.get_value() + self.sb.get_value()
        sl = sl.reshape(feats.shape[0], S.MAX_SHAPES, N_PATCH_CLASSES)
        aux = aux + optax.softmax_cross_entropy_with_integer_labels(
            sl, plabels[:, 2 * n:2 * n + S.MAX_SHAPES]).mean()
        # per patch: its shape's place left to right (the ViT sees the whole image; the
        # causal decoder's image tokens cannot look right/down for themselves)
        rl = feats @ self.rw.get_value() + self.rb.get_value()
        return aux + optax.softmax_cross_entropy_with_integer_labels(rl, plabels[:, n:2 * n]).mean()


class Trainee(nnx.Module):
    """What the optimizer trains: `model` (the LlavaModel that is exported) and `aux` (its
    training-only heads). The steps take its Param State (`nnx.state(trainee)`)."""

    def __init__(self, model, aux: AuxHeads):
        self.model, self.aux = model, aux


def make_logits_fn(cfg):
    """-> logits_fn(model, uint8 pixels [B,R,R,3], ids [B,T]) -> (logits [B,T,V], image token
    embeddings [B,n,D], ...) with mmjax's serving modules (`model`: a LlavaModel), and
    logits_fn.encode(model, pixels) -> the image token embeddings."""
    import mmjax.attention as A
    from mmjax.models.nn.capture import Capture, captured
    from mmjax.models.nn.metadata import AttentionMetadata

    mean = jnp.asarray(C.CLIP_MEAN, jnp.float32)
    std = jnp.asarray(C.CLIP_STD, jnp.float32)
    last = cfg.text.num_layers - 1
    capture = Capture(hidden=True, attn_layers=(last,))
    image_id = cfg.image_token_id

    def encode(model, pix_u8):
        """uint8 pixels [B, R, R, 3] -> image token embeddings [B, n_img, D]."""
        pixels = (pix_u8.astype(jnp.float32) / 255.0 - mean) / std
        # Training traces the vision attention at batch sizes where "auto" would pick the
        # blockwise kernel; the plain one is the same math (the oracle) and cheaper to
        # differentiate here.
        with A.auto_reference_up_to(1 << 34):
            return model.encode(pixels)

    def logits_fn(model, pix_u8, ids):
        """-> (logits, image features [B, n, D], residual stream entering the last decoder
        layer [B, T, D] (what the last layer's attention reads), that layer's head-0 attention
        weights [B, T, T] and output [B, T, head_dim]), from what the decoder sows (captured by
        `nnx.capture`: HF's hidden_states, the captured layer's attention)."""
        lm = model.language_model
        b, t = ids.shape
        feats = encode(model, pix_u8)                                   # [B, n_img, D]
        is_img, idx = image_token_index(ids, image_id, feats.shape[1])
        embeds, extra = lm.inputs(ids, jnp.take_along_axis(feats, idx[..., None], axis=1), is_img)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, b, t))
        meta = AttentionMetadata(positions, jnp.zeros((b,), jnp.int32), t, capture=capture.attn_layers)
        cache = lm.init_cache(b, t, embeds.dtype, max_chunk=t)
        (hidden, _), inter = captured(lambda m, *a, **kw: m(*a, **kw), capture)(lm, embeds, meta, cache, **extra)
        return (lm.logits(hidden), feats, inter["hidden"][last],
                inter["attn"][last][:, 0], inter["attn_out"][last][:, :, 0])

    logits_fn.encode = encode
    return logits_fn


def make_steps(cfg, weight_decay: float = 0.05, clip: float = 1.0, b2: float = 0.98,
               aux_weight: float = 0.5, bf16: bool = False):
    """-> (tx, train_step, eval_step); train_step.vision is the image-only step.

    The steps are jitted pure functions of a `Trainee`'s Param State (`nnx.state(trainee)`:
    "model" the LlavaModel, "aux" its `AuxHeads`), merged into the modules inside the trace;
    the optimizer is plain optax over that State. train_step(params, opt_state, pix, ids, mask,
    plabels, lr) -> (params, opt_state, (answer loss, aux loss)). Loss: answer-token cross
    entropy + aux_weight * the aux losses (`AuxHeads`), first of all the per-patch cross
    entropy of the image token embeddings (which shape and color covers each patch): a dense
    signal that gets the from-scratch ViT + projector discriminative long before the answer
    loss alone would (without it the answer loss sat on the language-prior plateau for 600+
    steps). train_step.vision(params, opt_state, pix, plabels, lr) runs only the losses on the
    image token embeddings, at ~0.15 s per batch-32 step on 2 cores where a full step of the
    shipped shape takes 0.33 s (`--vision-frac`); with bf16 (`mixed_precision.bf16_matmuls`
    on both steps' losses) 0.08 s and 0.17 s. eval_step(model State, pix, ids, mask) -> [B]
    bool, always f32."""
    import optax

    from mmjax.demo.mixed_precision import bf16_matmuls
    from mmjax.models.llava import LlavaModel
    from mmjax.models.nn.weights import build

    logits_fn = make_logits_fn(cfg)
    graphdef = nnx.graphdef(build(lambda: Trainee(LlavaModel(cfg), AuxHeads(cfg, 0))))
    model_graphdef = nnx.graphdef(build(lambda: LlavaModel(cfg)))

    def loss_fn(params, pix, ids, mask, plabels):
        tr = nnx.merge(graphdef, params)
        logits, feats, last_in, attn0, out0 = logits_fn(tr.model, pix, ids)
        logits = logits[:, :-1]
        tgt = ids[:, 1:]
        m = mask[:, :-1]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
        loss = (nll * m).sum() / jnp.maximum(m.sum(), 1.0)
        aux = jnp.zeros(())
        if aux_weight:
            ah = tr.aux
            n = feats.shape[1]
            aux = ah.image_losses(feats, plabels)
            # "exists": every image token, one layer before the answer reads it, says whether
            # its patch shows the asked (color, shape); the answer then only ORs over them.
            query = plabels[:, 2 * n + S.MAX_SHAPES]
            is_img, idx = image_token_index(ids, cfg.image_token_id, n)
            target = jnp.take_along_axis(plabels[:, :n] == query[:, None], idx, axis=1)
            ml = ah.match_norm(last_in) @ ah.mw.get_value() + ah.mb.get_value()
            # positives are the few patches of one shape: weigh them up (x4)
            w = (is_img & (query[:, None] > 0)).astype(jnp.float32) * (1.0 + 3.0 * target)
            bce = optax.sigmoid_binary_cross_entropy(ml, target.astype(jnp.float32))
            aux = aux + (bce * w).sum() / jnp.maximum(w.sum(), 1.0)
            # "describe": while saying the color and kind of the k-th shape left to right, the
            # last layer's head 0 looks at the image tokens of that shape (by its place, not by
            # the color just said: that lookup is ambiguous when two shapes share a color, where
            # describe sat at chance). Loss: -log of its attention mass on those tokens.
            phrase = plabels[:, 2 * n + S.MAX_SHAPES + 1:]                         # [B, T]
            tok_rank = jnp.where(is_img, jnp.take_along_axis(plabels[:, n:2 * n], idx, axis=1), 0)
            on_shape = (tok_rank[:, None, :] == phrase[:, :, None]) & (phrase[:, :, None] > 0)
            mass = (attn0 * on_shape).sum(-1)                                        # [B, T]
            has = (phrase > 0) & on_shape.any(-1)
            att = -jnp.log(jnp.where(has, mass, 1.0) + 1e-6)
            aux = aux + (att * has).sum() / jnp.maximum(has.sum(), 1.0)
            # ... and what it reads there is that shape's (color, kind): looking at the right
            # tokens alone left the kind at a coin toss (a probe on its output read the kind
            # no better than chance), the answer kept the color-keyed lookup
            slots = plabels[:, 2 * n:2 * n + S.MAX_SHAPES]
            want = jnp.take_along_axis(slots, jnp.clip(phrase - 1, 0, S.MAX_SHAPES - 1), axis=1)
            hl = out0 @ ah.hw.get_value() + ah.hb.get_value()
            read = optax.softmax_cross_entropy_with_integer_labels(hl, want)
            aux = aux + (read * has).sum() / jnp.maximum(has.sum(), 1.0)
        return loss + aux_weight * aux, (loss, aux)

    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)     # noqa: E731 (matrices only)
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.scale_by_adam(b1=0.9, b2=b2, eps=1e-8),
                     optax.add_decayed_weights(weight_decay, decay_mask))

    @jax.jit
    def train_step(params, opt_state, pix, ids, mask, plabels, lr):
        lf = bf16_matmuls(loss_fn) if bf16 else loss_fn
        (_, loss), grads = jax.value_and_grad(lf, has_aux=True)(params, pix, ids, mask, plabels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss

    def image_loss(params, pix, plabels):
        tr = nnx.merge(graphdef, params)
        return tr.aux.image_losses(logits_fn.encode(tr.model, pix), plabels)

    @jax.jit
    def vision_step(params, opt_state, pix, plabels, lr):
        """A step of the image aux losses alone (ViT + projector + their heads): ~1/3 of a full
        step's cost. The decoder's update is zeroed (its gradient is zero, weight decay is not)."""
        aux, grads = jax.value_and_grad(bf16_matmuls(image_loss) if bf16 else image_loss)(params, pix, plabels)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates["model"]["language_model"] = jax.tree.map(jnp.zeros_like, updates["model"]["language_model"])
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, jnp.stack([jnp.zeros(()), aux])

    @jax.jit
    def eval_step(model_params, pix, ids, mask):
        logits = logits_fn(nnx.merge(model_graphdef, model_params), pix, ids)[0][:, :-1]
        pred = jnp.argmax(logits, -1)
        m = mask[:, :-1] > 0
        ok = jnp.all((pred == ids[:, 1:]) | ~m, axis=1)
        return ok

    train_step.vision = vision_step
    return tx, train_step, eval_step


def lr_at(frac: float, peak: float, warmup_frac: float, final_frac: float = 0.02) -> float:
    if frac < warmup_frac:
        return peak * frac / warmup_frac
    x = min(1.0, (frac - warmup_frac) / max(1e-9, 1 - warmup_frac))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * x)))


def evaluate(eval_step, params, sampler: Sampler, examples, batch: int = 64) -> dict:
    """Teacher-forced greedy exact match per question type over fixed examples."""
    hits, tot = defaultdict(int), defaultdict(int)
    for s in range(0, len(examples), batch):
        ex = examples[s:s + batch]
        n = len(ex)
        ex = ex + [ex[-1]] * (batch - n)
        pix, ids, mask, _, qt = sampler.batch(None, batch, ex)
        ok = np.asarray(eval_step(params, pix, ids, mask))[:n]
        for o, q in zip(ok, qt[:n]):
            hits[q] += int(o)
            tot[q] += 1
    out = {q: hits[q] / tot[q] for q in tot}
    out["all"] = sum(hits.values()) / max(1, sum(tot.values()))
    return out


def fixed_eval_examples(sampler: Sampler, n: int, seed: int, types=QUESTION_TYPES) -> list:
    """n examples cycling over `types`."""
    rng = np.random.default_rng(seed)
    types = list(types)
    return [sampler.example(rng, types[i % len(types)]) for i in range(n)]


# ----------------------------------------------------------------------------- driver

CONFIGS = {"shipped": C.shipped_config, "notebook": C.notebook_config,
           "proposal": C.proposal_config}


def train(cfg_dict: dict, *, minutes: float = 30.0, steps: int | None = None, batch: int = 64,
          lr: float = 2e-3, warmup_frac: float = 0.05, seed: int = 0, pool_size: int = 20000,
          eval_size: int = 500, eval_every: float = 120.0, log=print, pool=None,
          eval_pool=None, weight_decay: float = 0.05, pool_cache: str | None = None,
          aux_weight: float = 0.5, init_from: str | None = None,
          qtype_weights: dict | None = None, hard_describe: float = 0.0,
          vision_frac: float = 0.0, bf16: bool = False) -> tuple[object, dict]:
    """Train; returns (the trained LlavaModel, info). Stops at `steps` if given, else after
    `minutes`.
    bf16: the training steps' matmuls in bf16 with f32 accumulation (`make_steps`).
    vision_frac: the first share of the budget (time, or steps) trains only the ViT + projector
    on the image aux losses (`vision_step`, its own warmup + cosine), the rest the whole model
    (its own warmup + cosine)."""
    tok = T.train_tokenizer(cfg_dict["text_config"]["vocab_size"])
    cfg, model = init_model(cfg_dict, tok, seed, init_from)
    r = cfg_dict["vision_config"]["image_size"]
    enc = Encoder(tok, C.num_image_tokens(cfg_dict))
    seq = max_seq_len(enc)
    t0 = time.perf_counter()
    if pool is None:
        pool = make_pool(pool_size, r, seed, cache_dir=pool_cache)
    if eval_pool is None:
        eval_pool = make_pool(max(200, eval_size // 2), r, seed + 10_000, cache_dir=pool_cache)
    t_data = time.perf_counter() - t0
    log(f"data: {len(pool[1])} train scenes + {len(eval_pool[1])} held-out scenes at {r}px "
        f"in {t_data:.0f}s; seq_len {seq}; params {C.param_count(cfg_dict)['total']:,}")
    grid = r // cfg_dict["vision_config"]["patch_size"]
    sampler = Sampler(pool[0], pool[1], enc, seq, weights=qtype_weights,
                      grid=grid if aux_weight else 0, hard_describe=hard_describe)
    log(f"describe: {hard_describe:.0%} from the {len(sampler.hard)} scenes with a color shared "
        f"by two kinds or two centers < {CLOSE_CENTERS:.0%} of the width apart")
    ev_sampler = Sampler(eval_pool[0], eval_pool[1], enc, seq)
    # held out over the types trained on (the JSON forms only when the mix has them)
    ev_examples = fixed_eval_examples(ev_sampler, eval_size, seed + 20_000,
                                      [t for t, p in zip(sampler.types, sampler.p) if p > 0])

    tx, train_step, eval_step = make_steps(cfg, weight_decay=weight_decay,
                                           aux_weight=aux_weight, bf16=bf16)
    trainee = Trainee(model, AuxHeads(cfg, seed))
    params = nnx.state(trainee)        # the Param State the steps take and return
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed + 1)

    # batches are assembled on a background thread (numpy gather + python tokens)
    import queue
    q: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def producer():
        r2 = np.random.default_rng([seed + 2, int(bool(init_from))])
        while not stop.is_set():
            item = sampler.batch(r2, batch)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.5)
                    break
                except queue.Full:
                    pass

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    budget = minutes * 60.0
    step, vision_steps, t_start, t_last_eval = 0, 0, None, 0.0
    losses, history = [], []
    compile_s = 0.0
    try:
        while True:
            pix, ids, mask, plab, _ = q.get()
            if t_start is None:
                tc = time.perf_counter()
                step_fn = train_step.lower(params, opt_state, pix, ids, mask, plab,
                                           np.float32(0.0)).compile()
                if vision_frac:
                    vision_fn = train_step.vision.lower(params, opt_state, pix, plab,
                                                        np.float32(0.0)).compile()
                compile_s = time.perf_counter() - tc
                t_start = time.perf_counter()
                log(f"compiled train step in {compile_s:.1f}s")
            elapsed = time.perf_counter() - t_start
            frac = step / steps if steps else elapsed / budget
            if frac >= 1.0:
                break
            if frac < vision_frac:
                cur_lr = lr_at(frac / vision_frac, lr, warmup_frac)
                params, opt_state, loss = vision_fn(params, opt_state, pix, plab,
                                                    np.float32(cur_lr))
                vision_steps += 1
            else:
                cur_lr = lr_at((frac - vision_frac) / (1 - vision_frac), lr, warmup_frac)
                params, opt_state, loss = step_fn(params, opt_state, pix, ids, mask, plab,
                                                  np.float32(cur_lr))
            step += 1
            losses.append([float(x) for x in loss])
            if step % 25 == 0:
                la, lx = np.mean(losses[-25:], axis=0)
                log(f"step {step:5d}  t {elapsed:6.0f}s  lr {cur_lr:.2e}  "
                    f"answer loss {la:.4f}  patch loss {lx:.4f}")
            if eval_every and elapsed - t_last_eval >= eval_every and frac >= vision_frac:
                t_last_eval = elapsed
                acc = evaluate(eval_step, params["model"], ev_sampler, ev_examples[:200])
                history.append({"step": step, "t": elapsed, **acc})
                log("  eval " + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    finally:
        stop.set()
    train_s = time.perf_counter() - t_start
    nnx.update(trainee, params)
    acc = evaluate(eval_step, params["model"], ev_sampler, ev_examples)
    log(f"done: {step} steps in {train_s:.0f}s ({train_s / max(step, 1):.3f}s/step), "
        f"final held-out (teacher-forced greedy, {len(ev_examples)}): "
        + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    info = {"steps": step, "vision_steps": vision_steps, "train_seconds": round(train_s, 1),
            "data_seconds": round(t_data, 1),
            "compile_seconds": round(compile_s, 1), "batch": batch, "peak_lr": lr,
            "pool_size": len(pool[1]), "aux_weight": aux_weight, "init_from": init_from,
            "hard_describe": hard_describe, "vision_frac": vision_frac, "bf16": bf16,
            "qtype_weights": qtype_weights or QTYPE_WEIGHTS, "seq_len": seq, "final_loss": float(np.mean(losses[-50:], axis=0)[0]),
            "heldout": acc, "history": history}
    return trainee.model, info


def export(out_dir, cfg_dict: dict, model, info: dict | None = None) -> list[str]:
    """Write the LlavaModel `model` as the HF checkpoint of `cfg_dict` (`export.hf_state`)."""
    tok = T.train_tokenizer(cfg_dict["text_config"]["vocab_size"])
    return E.write_hf_checkpoint(str(out_dir), cfg_dict, tok, E.hf_state(model, cfg_dict))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmjax.demo.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write (HF layout)")
    ap.add_argument("--config", default="shipped", choices=sorted(CONFIGS))
    ap.add_argument("--minutes", type=float, default=26.0,
                    help="training-loop budget (the default leaves ~4 min of the 30 for drawing "
                         "the pool, compiling, the final eval and the export on 2 cores)")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead of --minutes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak LR (at 3e-3 shape questions stayed near chance in 30-min budgets)")
    ap.add_argument("--pool", type=int, default=64000, help="training scenes drawn up front")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qtypes", default="shape=.08,color=.04,count=.13,exists=.25,describe=.5",
                    help="question-type sampling weights, e.g. shape=.25,color=.05,count=.2,"
                         "exists=.25,describe=.25 ('' = QTYPE_WEIGHTS)")
    ap.add_argument("--init", default=None, help="continue from this HF checkpoint dir")
    ap.add_argument("--aux", type=float, default=1.0,
                    help="weight of the training-only per-patch loss (0 = answer loss only)")
    ap.add_argument("--pool-cache", default=os.path.join(tempfile.gettempdir(), "mmjax_shapes_pool"),
                    help="directory caching drawn scene pools ('' = off)")
    ap.add_argument("--eval-every", type=float, default=180.0, help="seconds between evals")
    ap.add_argument("--hard-describe", type=float, default=0.7,
                    help=f"share of describe questions drawn from scenes with a color shared by "
                         f"two kinds or two centers < {CLOSE_CENTERS:.0%}% of the width apart "
                         f"(where the order mistakes are)")
    ap.add_argument("--vision-frac", type=float, default=0.25,
                    help="share of the budget that trains only the ViT + projector on the "
                         "image aux losses before the whole model")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="training matmuls with bf16 operands and f32 accumulation (2x faster "
                         "steps on CPUs with AMX / AVX512-BF16; elsewhere try --no-bf16)")
    ap.add_argument("--cfg-override", default=None,
                    help="JSON merged into vision_config/text_config, e.g. "
                         "'{\"text_config\": {\"num_hidden_layers\": 3}}'")
    args = ap.parse_args(argv)
    cfg_dict = CONFIGS[args.config]()
    if args.cfg_override:
        for k, v in json.loads(args.cfg_override).items():
            if isinstance(v, dict):
                cfg_dict[k].update(v)
            else:
                cfg_dict[k] = v
    t0 = time.perf_counter()
    model, info = train(cfg_dict, minutes=args.minutes, steps=args.steps, batch=args.batch,
                         lr=args.lr, seed=args.seed, pool_size=args.pool,
                         eval_every=args.eval_every, aux_weight=args.aux, init_from=args.init,
                         qtype_weights=({k: float(v) for k, v in
                                         (kv.split("=") for kv in args.qtypes.split(","))}
                                        if args.qtypes else None), pool_cache=args.pool_cache or None,
                         hard_describe=args.hard_describe, vision_frac=args.vision_frac,
                         bf16=args.bf16,
                         log=lambda s: print(s, flush=True))
    files = export(args.out, cfg_dict, model)
    info["total_seconds"] = round(time.perf_counter() - t0, 1)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    info["checkpoint_bytes"] = size
    print(f"wrote {args.out}: {len(files)} files, {size / 1e6:.2f} MB; total {info['total_seconds']:.0f}s",
          flush=True)
    print("INFO " + json.dumps({k: v for k, v in info.items() if k != "history"}), flush=True)
    with open(os.path.join(tempfile.gettempdir(), "mmjax_shapes_train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
