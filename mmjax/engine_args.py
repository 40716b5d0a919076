"""The model and engine options, each defined once: `mmjax.load`'s keywords and `mmjax serve`'s flags.

    args = EngineArgs(model="path/or/hub-id", max_num_seqs=16, kv_cache_dtype="int8")
    vlm = args.load()            # = mmjax.load(args.model, **args.load_kwargs())

A field's name is its `mmjax.load` keyword (the engine's keywords travel load -> VLM -> Engine ->
ModelRunner unchanged); `flag=` gives the CLI flag where its name differs, `cli=False` keeps a
Python-only keyword off the command line. Adding an engine option: one field here (and the
keyword on Engine).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from mmjax.options import Options, memory_budget, mib_to_bytes, non_negative_int, option, positive_int
from mmjax.options import memory_budget as bytes_or_fraction

SHIPPED_MODEL = "mmjax-shapes"


@dataclass
class EngineArgs(Options):
    model: str = option(SHIPPED_MODEL, help=f"model directory or hub id (default: {SHIPPED_MODEL}, the trained "
                                            "model shipped with mmjax)")
    # ---- weights (mmjax.load) ------------------------------------------------------------------
    dtype: str = option("float32", choices=["float32", "bfloat16"])
    params_dir: str | None = option(None, cli=False, help="orbax params written by `mmjax convert` / "
                                                          "VLM.save_params, restored instead of converting")
    kv_cache_dtype: str = option(
        "auto", choices=["auto", "bfloat16", "int8", "fp8"],
        help="KV cache element type: auto (--dtype), bfloat16, or int8 / fp8 (e4m3) with one scale per "
             "token and KV head: about half the bytes of bfloat16, so twice the concurrent context")
    quantize: str | None = option(
        None, choices=["int8", "fp8"],
        help="8-bit linear-layer weights (LM + ViT): int8 = int8 weights with per-channel scales and "
             "per-token int8 activations (s8 dots; CPU and GPU), fp8 = e4m3 weights and activations "
             "(GPUs; CPUs upcast)")
    quantize_group_size: int | None = option(
        None, type=positive_int,
        help="with --quantize int8: one scale per group of N input rows instead of per output channel")
    # ---- engine (Engine / ModelRunner) ---------------------------------------------------------
    max_num_seqs: int = option(8, type=int, help="decode slots = max concurrently running requests")
    tensor_parallel: int = option(
        1, flag="--tensor-parallel-size", aliases=("-tp",), type=positive_int,
        help="devices each engine replica's decoder is split over (Megatron-style tensor parallel)")
    data_parallel: int = option(
        1, flag="--data-parallel-size", aliases=("-dp",), type=positive_int,
        help="engine replicas behind this server, each over --tensor-parallel-size devices")
    vision_tensor_parallel: bool = option(
        False, help="split the vision tower over the tensor-parallel devices too (default: replicated ViT "
                    "weights, the images of an encode call split over the devices)")
    vision_offload: bool = option(
        False, help="keep the vision tower and projector weights in host memory (pinned where the "
                    "backend has it) and bring them to the device only inside encode steps")
    overlap: bool = option(
        True, flag="--no-overlap",
        help="wait for every engine step before queuing the next (default: step N + 1 is queued "
             "before the host reads step N's tokens; A/B and debugging)")
    decode_steps: int = option(
        1, type=positive_int,
        help="decode steps per engine call (vLLM's --num-scheduler-steps): the host's per-call "
             "cost paid once for that many tokens of each running request (an H200 ran a 16-row "
             "step in 1.7 ms of kernels and 4-5 ms of wall); new requests and stops wait for "
             "the call")
    memory_budget: int | float | None = option(
        None, type=memory_budget,
        help="device memory per device for weights + KV cache + step temporaries: bytes (e.g. "
             "20000000000, 20GiB, 512MiB) or a fraction of the device's memory (e.g. 0.9); "
             "sizes the decode slots (at most --max-num-seqs) from the compiled steps' memory analysis")
    page_size: int | None = option(
        None, type=int,
        help="positions per KV-cache page (default: the backend's, 64 on the CPU, 0 on GPUs for now; 0: a "
             "cache row of --max-model-len per slot). Paged, requests hold pages for the tokens they have, "
             "share prompt prefixes by page, and are preempted (recomputed) when pages run out")
    kv_cache_bytes: int | float | None = option(
        None, type=bytes_or_fraction,       # (the field above shadows the name memory_budget)
        help="bytes of the paged KV cache per device (e.g. 8GiB; default: from --memory-budget, else as many "
             "pages as --max-num-seqs full-length sequences take)")
    max_model_len: int | None = option(None, type=int, help="context length (prompt + completion)")
    prefill_chunk: int = option(256, type=int, help="prompt tokens prefilled per engine step")
    encoder_cache_bytes: int = option(
        512 * 2**20, flag="--encoder-cache-mib", type=mib_to_bytes,
        help="image features kept by content hash (LRU; a repeated image skips the vision tower)")
    max_encode_batch: int = option(8, cli=False, help="images per encode call")
    max_encode_tokens: int = option(4096, cli=False, help="vision tokens per encode call")
    max_images_per_request: int = option(16, cli=False,
                                         help="images + videos per request (`mmjax serve`: --limit-images + "
                                              "--limit-videos)")
    enable_prefix_cache: bool = option(True, cli=False, help="keep each slot's KV for a later request "
                                                             "sharing its prefix")
    pack_prefill: bool = option(True, cli=False, help="the prefill chunks of several requests in one packed "
                                                      "call (False: one call per request)")
    # ---- LoRA adapters (mmjax.lora) ------------------------------------------------------------
    max_loras: int = option(0, type=non_negative_int,
                            help="LoRA adapters served at once, in one batch (0: none; `mmjax serve` with "
                                 "--lora-modules: 4, or one per adapter if more)")
    max_lora_rank: int = option(16, type=positive_int, help="largest LoRA adapter rank served")

    def load_kwargs(self) -> dict:
        """`mmjax.load`'s keywords (all but `model`)."""
        kw = asdict(self)
        del kw["model"]
        return kw

    def load(self, **extra):
        """`mmjax.load(self.model, ...)` with these options; extra: load's other keywords
        (image_limits, mesh, verbose)."""
        import mmjax
        kw = self.load_kwargs()
        if extra.get("mesh") is not None and kw["tensor_parallel"] == kw["data_parallel"] == 1:
            del kw["tensor_parallel"], kw["data_parallel"]    # the mesh gives the layout
        return mmjax.load(self.model, **kw, **extra)
