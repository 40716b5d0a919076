"""`mmjax bench tiling` / `python -m benchmarks.tiling`: encode cost of tiled (anyres) images.

LLaVA-NeXT-style families encode every tile with the same vision tower, and the engine packs the
tiles of all waiting images into the fixed-shape encode ladder, so encode cost should follow the
number of tiles (views), not the number of images. On one random-weight LLaVA-NeXT checkpoint
(default: CLIP ViT-B/16 at 224 px tiles, grid pinpoints 1x1, 1x2, 2x1 and 2x2 tiles, a 1-layer
decoder: only encode is timed; `--smoke`: a toy one), through the engine's runner
(`runner.encode_images`: the family's encode plan, the compiled encode calls and the host layout:
unpad, image_newline), it times:

  - one 4-tile image                (a 2x2 grid: overview + 4 tiles = 5 views)
  - four 1-tile images              (1x1 grid each: 4 x (overview + 1 tile) = 8 views)
  - five overview-only images       (detail "low": 5 views, the same views as the 4-tile image)

and reports the median seconds per case, views/s, encode calls and LLM image tokens. The 4-tile
image and the five overview-only images run the same calls (same buckets) and should cost the
same; four 1-tile images cost their 8 views. Compile time is apart (warmup). Prints a table, then
one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SIZES = {
    "default": {"vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               image_size=224, patch_size=16, projection_dim=512, hidden_act="quick_gelu"),
                "text": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2)},
    "smoke": {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=16, hidden_act="quick_gelu"),
              "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2)},
}


def build_checkpoint(out: Path, size: str) -> Path:
    """A random-weight LlavaNextForConditionalGeneration checkpoint + processor, offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextProcessor, PreTrainedTokenizerFast)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from mmjax.models.llava import LLAVA_CHAT_TEMPLATE
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["describe the image please what is shown"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<image>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=["<image>"])
    s = SIZES[size]
    t = s["vision"]["image_size"]
    pins = [[t, t], [t, 2 * t], [2 * t, t], [2 * t, 2 * t]]
    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**s["vision"]),
                          text_config=LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, **s["text"]),
                          image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pins)
    LlavaNextForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": t}, crop_size={"height": t, "width": t},
                                    image_grid_pinpoints=pins)
    LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=s["vision"]["patch_size"],
                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                       chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(out)
    return out


def noise(seed: int, w: int, h: int):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench tiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy checkpoint, 2 repeats (CI)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 7; smoke 2)")
    ap.add_argument("--max-encode-batch", type=int, default=8, help="views per compiled encode call")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    import mmjax
    from mmjax.models.family import ImageOptions

    size = "smoke" if a.smoke else "default"
    root = Path(os.environ.get("MMJAX_BENCH_DIR") or Path.home() / ".cache" / "mmjax" / "bench")
    path = build_checkpoint(root / f"llava-next-tiling-{size}", size)
    vlm = mmjax.load(path, a.dtype, max_num_seqs=1, max_model_len=4096, max_encode_batch=a.max_encode_batch)
    fam, runner = vlm.family, vlm.engine.runner
    t = fam.cfg.vision.image_size
    cases = {
        "one 4-tile image": ([noise(1, 3 * t, 3 * t)], ImageOptions()),
        "four 1-tile images": ([noise(2 + i, t - 7 - i, t - 9 - i) for i in range(4)], ImageOptions()),
        "five overview-only images": ([noise(10 + i, 3 * t, 3 * t - i) for i in range(5)], ImageOptions(max_tiles=0)),
    }
    t0 = time.perf_counter()
    runner.encode(fam.warmup_plan(runner.max_encode_batch))
    compile_s = time.perf_counter() - t0
    repeats = a.repeats or (2 if a.smoke else 7)
    rows = []
    for name, (imgs, opts) in cases.items():
        prepared = [fam.prepare_image(im, opts) for im in imgs]
        plan = fam.encode_plan(prepared, runner.max_encode_batch)
        runner.encode_images(prepared)                      # warm (host paths)
        ts = []
        for _ in range(repeats):
            t1 = time.perf_counter()
            runner.encode_images(prepared)
            ts.append(time.perf_counter() - t1)
        views = sum(len(p.pixels) for p in prepared)
        med = statistics.median(ts)
        rows.append({"case": name, "images": len(imgs), "views": views, "calls": len(plan),
                     "buckets": [c.bucket[0] for c in plan], "image_tokens": sum(p.num_tokens for p in prepared),
                     "median_s": med, "views_per_s": views / med})
    print(f"{'case':28s} {'images':>6s} {'views':>5s} {'calls':>5s} {'buckets':>10s} {'tokens':>6s} "
          f"{'median s':>9s} {'views/s':>8s}")
    for r in rows:
        print(f"{r['case']:28s} {r['images']:6d} {r['views']:5d} {r['calls']:5d} {str(r['buckets']):>10s} "
              f"{r['image_tokens']:6d} {r['median_s']:9.4f} {r['views_per_s']:8.2f}")
    ratio = rows[0]["median_s"] / rows[2]["median_s"]
    print(f"4-tile image / five overview-only images (same views): {ratio:.2f}x; compile {compile_s:.2f}s; "
          f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    line = json.dumps({"bench": "tiling", "size": size, "dtype": a.dtype, "max_encode_batch": a.max_encode_batch,
                       "tile_px": t, "rows": rows, "same_views_ratio": ratio, "compile_s": compile_s,
                       "loadavg": os.getloadavg()[0]})
    print(line)
    if a.json_out:
        Path(a.json_out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
