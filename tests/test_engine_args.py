"""One config (mmjax.options, mmjax.engine_args, serve.config): the generated `mmjax serve` parser
accepts every flag the hand-written one did, with the same defaults, choices, help and env
defaults, and a command line reaches `mmjax.load` and `ServerConfig` / `MediaConfig` as before."""
from __future__ import annotations

import inspect
import zlib

import pytest

import mmjax.api
from mmjax import distributed
from mmjax.engine_args import EngineArgs
from serve import cli
from serve.config import ServerConfig

ENV = ("MMJAX_API_KEY", "MMJAX_COORDINATOR_ADDRESS", "MMJAX_NUM_PROCESSES", "MMJAX_PROCESS_ID")

# The hand-written parser's flags (main before issue 62): option strings, default, choices, nargs,
# crc32 of the help text.
OLD_FLAGS = [
    (('--model',), 'mmjax-shapes', None, None, 2821651853),
    (('--host',), '127.0.0.1', None, None, 731652005),
    (('--port',), 8000, None, None, 2510526079),
    (('--api-key',), None, None, None, 2851286552),
    (('--served-model-name',), None, None, None, 3927114353),
    (('--dtype',), 'float32', ('float32', 'bfloat16'), None, 0),
    (('--kv-cache-dtype',), 'auto', ('auto', 'bfloat16', 'int8', 'fp8'), None, 3885632824),
    (('--quantize',), None, ('int8', 'fp8'), None, 1624853268),
    (('--quantize-group-size',), None, None, None, 2879349227),
    (('--max-num-seqs',), 8, None, None, 3758878921),
    (('--tensor-parallel-size', '-tp'), 1, None, None, 511567593),
    (('--data-parallel-size', '-dp'), 1, None, None, 2326188647),
    (('--vision-tensor-parallel',), False, None, 0, 1240677358),
    (('--vision-offload',), False, None, 0, 3084853296),
    (('--no-overlap',), False, None, 0, 212580900),
    (('--decode-steps',), 1, None, None, 3542288027),
    (('--memory-budget',), None, None, None, 3296823601),
    (('--coordinator-address',), None, None, None, 4241480994),
    (('--num-processes',), 1, None, None, 3269341961),
    (('--process-id',), 0, None, None, 3509150532),
    (('--max-model-len',), None, None, None, 1603605491),
    (('--prefill-chunk',), 256, None, None, 1584012853),
    (('--max-queue',), 256, None, None, 4091404943),
    (('--encoder-cache-mib',), 512, None, None, 1106405390),
    (('--limit-images',), 8, None, None, 148624342),
    (('--max-image-bytes',), 20971520, None, None, 3777245231),
    (('--limit-videos',), 2, None, None, 1377522371),
    (('--max-video-bytes',), 104857600, None, None, 1491005020),
    (('--max-video-duration',), 3600.0, None, None, 2885622198),
    (('--max-video-frames',), 768, None, None, 2797374255),
    (('--max-video-pixels',), 9437184, None, None, 229687678),
    (('--video-decode-timeout',), 60.0, None, None, 1528150127),
    (('--video-max-tokens',), None, None, None, 2086885862),
    (('--video-workers',), 2, None, None, 3402526849),
    (('--max-body-bytes',), None, None, None, 790306626),
    (('--max-messages',), 4096, None, None, 2834686648),
    (('--max-content-parts',), 512, None, None, 1504200507),
    (('--max-image-pixels',), 40000000, None, None, 1437781790),
    (('--image-max-tokens',), None, None, None, 3116738798),
    (('--low-detail-image-tokens',), 256, None, None, 3093212146),
    (('--pan-and-scan', '--no-pan-and-scan'), None, None, 0, 2019772777),
    (('--max-image-tiles',), None, None, None, 2587490391),
    (('--allowed-local-media-path',), None, None, None, 3604692889),
    (('--allowed-media-domains',), [], None, '*', 835895400),
    (('--enable-image-embeds',), False, None, 0, 946903658),
    (('--allow-private-media-urls',), False, None, 0, 2848238900),
    (('--media-fetch-timeout',), 10.0, None, None, 184307019),
    (('--media-max-redirects',), 3, None, None, 0),
    (('--decode-workers',), 4, None, None, 1496051372),
    (('--decode-threads',), False, None, 0, 1592873167),
    (('--decode-workers-per-request',), 2, None, None, 1613707733),
    (('--max-decode-queue',), 64, None, None, 2688811606),
    (('--max-request-image-pixels',), None, None, None, 2392457551),
    (('--max-request-decode-seconds',), 30.0, None, None, 3604803705),
    (('--grammar-cache-mib',), 128, None, None, 3374818452),
    (('--embed-batch-tokens',), 4096, None, None, 641632696),
    (('--max-embed-queue',), 64, None, None, 1816615085),
    (('--chat-template',), None, None, None, 2155449796),
    (('--tool-call-parser',), None, ('hermes', 'llama3_json', 'mistral'), None, 3516133844),
    (('--warmup',), False, None, 0, 4087138357),
    (('--header-timeout',), 30.0, None, None, 1299780188),
    (('--body-timeout',), 30.0, None, None, 461609114),
    (('--keepalive-timeout',), 75.0, None, None, 2637705022),
    (('--keepalive-max-requests',), 1000, None, None, 3779421611),
    (('--lingering-time',), 10.0, None, None, 1768655094),
    (('--max-request-line',), 8190, None, None, 3740345979),
    (('--max-header-size',), 8190, None, None, 2832090990),
    (('--max-headers',), 128, None, None, 2711851305),
    (('--drain-timeout',), 30.0, None, None, 1807190954),
    (('--log-stats-interval',), 1.0, None, None, 2617436332),
    (('--log-level',), 'info', None, None, 0),
]
# flags whose dest now is the keyword it feeds: old default -> new default
CONVERTED = {"--encoder-cache-mib": lambda mib: mib * 2**20, "--no-overlap": lambda off: not off,
             "--decode-threads": lambda threads: not threads}


@pytest.fixture
def no_env(monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)


def test_generated_parser_has_every_old_flag_unchanged(no_env):
    actions = {s: a for a in cli.build_parser()._actions for s in a.option_strings}
    assert {s for flags, *_ in OLD_FLAGS for s in flags} <= set(actions)     # new flags may join them
    for flags, default, choices, nargs, help_crc in OLD_FLAGS:
        a = actions[flags[0]]
        assert tuple(a.option_strings) == flags
        assert a.default == CONVERTED.get(flags[0], lambda d: d)(default), flags
        assert (a.choices and tuple(a.choices)) == choices and a.nargs == nargs, flags
        assert zlib.crc32((a.help or "").encode()) == help_crc, f"{flags[0]}: help text changed"


def test_env_defaults(monkeypatch):
    for k, v in zip(ENV, ("sekret", "10.0.0.1:1234", "4", "2")):
        monkeypatch.setenv(k, v)
    args = cli.build_parser().parse_args([])
    assert cli.config_from_args(args).api_key == "sekret"
    proc = cli.ServeArgs.from_cli_args(args)
    assert (proc.coordinator_address, proc.num_processes, proc.process_id) == ("10.0.0.1:1234", 4, 2)
    monkeypatch.setenv("MMJAX_API_KEY", "")
    assert cli.config_from_args(cli.build_parser().parse_args([])).api_key is None


@pytest.mark.parametrize("bad", [["-tp", "0"], ["--max-image-tiles", "-1"], ["--header-timeout", "0"],
                                 ["--memory-budget", "lots"], ["--dtype", "float16"], ["--quantize-group-size", "0"],
                                 ["--num-processes", "0"], ["--max-messages", "0"], ["--tool-call-parser", "x"]])
def test_bad_values_are_refused(no_env, bad):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(bad)


def test_engine_args_defaults_are_the_keywords_defaults():
    """Each EngineArgs field is a keyword of mmjax.load or Engine with the same default, and
    every Engine option has a field (a new one: one field in mmjax/engine_args.py)."""
    from mmjax.serving.engine import Engine
    sig = {**{k: p.default for k, p in inspect.signature(Engine.__init__).parameters.items()},
           **{k: p.default for k, p in inspect.signature(mmjax.api.load).parameters.items()}}
    sig.update(tensor_parallel=1, data_parallel=1)   # load: None = 1
    fields = EngineArgs()
    for k, v in fields.load_kwargs().items():
        assert sig[k] == v, k
    engine_kw = set(inspect.signature(Engine.__init__).parameters) - {"self", "model", "mesh", "primary"}
    assert engine_kw <= set(fields.load_kwargs())


ARGV = ["--model", "m", "--host", "0.0.0.0", "--port", "9", "--api-key", "k", "--served-model-name", "s",
        "--dtype", "bfloat16", "--kv-cache-dtype", "int8", "--quantize", "int8", "--quantize-group-size", "32",
        "--max-num-seqs", "5", "-tp", "2", "-dp", "3", "--vision-tensor-parallel", "--vision-offload", "--no-overlap",
        "--decode-steps", "4", "--memory-budget", "2GiB", "--max-model-len", "999", "--prefill-chunk", "64",
        "--max-queue", "7", "--encoder-cache-mib", "3", "--limit-images", "3", "--max-image-bytes", "1000",
        "--limit-videos", "1", "--max-video-bytes", "2000", "--max-video-duration", "5.5", "--max-video-frames", "9",
        "--max-video-pixels", "100", "--video-decode-timeout", "1.5", "--video-max-tokens", "77",
        "--video-workers", "1", "--max-body-bytes", "12345", "--max-messages", "3", "--max-content-parts", "4",
        "--max-image-pixels", "5000", "--image-max-tokens", "99", "--low-detail-image-tokens", "11",
        "--no-pan-and-scan", "--max-image-tiles", "0", "--allowed-local-media-path", "/tmp",
        "--allowed-media-domains", "A.com", "*.b.org", "--enable-image-embeds", "--allow-private-media-urls",
        "--media-fetch-timeout", "2.5", "--media-max-redirects", "1", "--decode-workers", "2", "--decode-threads",
        "--decode-workers-per-request", "1", "--max-decode-queue", "6", "--max-request-image-pixels", "777",
        "--max-request-decode-seconds", "0", "--grammar-cache-mib", "0", "--embed-batch-tokens", "8",
        "--max-embed-queue", "2", "--tool-call-parser", "hermes", "--warmup", "--header-timeout", "1",
        "--body-timeout", "2", "--keepalive-timeout", "3", "--keepalive-max-requests", "0", "--lingering-time", "0.5",
        "--max-request-line", "100", "--max-header-size", "101", "--max-headers", "5", "--drain-timeout", "1",
        "--log-stats-interval", "0", "--log-level", "warning"]
# what the hand-written serve/cli.py passed to mmjax.load for [] and ARGV (with Engine's defaults
# filled in for keywords it left out)
DEFAULT_LOAD = dict(model="mmjax-shapes", dtype="float32", params_dir=None, kv_cache_dtype="auto", quantize=None,
                    quantize_group_size=None, max_num_seqs=8, tensor_parallel=1, data_parallel=1,
                    vision_tensor_parallel=False, vision_offload=False, overlap=True, decode_steps=1,
                    memory_budget=None, max_model_len=None, prefill_chunk=256, encoder_cache_bytes=512 * 2**20,
                    max_encode_batch=8, max_encode_tokens=4096, max_images_per_request=10,
                    enable_prefix_cache=True, pack_prefill=True, image_limits=(20 * 2**20, 40_000_000))
ARGV_LOAD = {**DEFAULT_LOAD, **dict(
    model="m", dtype="bfloat16", kv_cache_dtype="int8", quantize="int8", quantize_group_size=32, max_num_seqs=5,
    tensor_parallel=2, data_parallel=3, vision_tensor_parallel=True, vision_offload=True, overlap=False,
    decode_steps=4, memory_budget=2 * 2**30, max_model_len=999, prefill_chunk=64, encoder_cache_bytes=3 * 2**20,
    max_images_per_request=4, image_limits=(1000, 5000))}


@pytest.mark.parametrize("argv, expected", [([], DEFAULT_LOAD), (ARGV, ARGV_LOAD)], ids=["defaults", "all-flags"])
def test_command_line_reaches_mmjax_load(no_env, monkeypatch, argv, expected):
    got = {}

    class Loaded(Exception):
        pass

    def fake_load(model, **kw):
        got.update(model=model, **kw)
        raise Loaded

    monkeypatch.setattr(mmjax.api, "load", fake_load)
    monkeypatch.setattr(distributed, "initialize", lambda *a: False)
    with pytest.raises(Loaded):
        cli.run(cli.build_parser().parse_args(argv))
    lim = got.pop("image_limits")
    got["image_limits"] = (lim.max_bytes, lim.max_pixels)
    assert {k: got.get(k) for k in expected} == expected      # options added later may join them


def test_command_line_reaches_server_and_media_config(no_env, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages }}")
    cfg = cli.config_from_args(cli.build_parser().parse_args(ARGV + ["--chat-template", str(tpl)]), "m")
    assert cfg == ServerConfig(
        served_model_name="s", api_key="k", limit_images=3, limit_videos=1, max_video_bytes=2000,
        max_video_duration=5.5, max_video_frames=9, max_video_pixels=100, video_decode_timeout=1.5,
        video_max_tokens=77, video_workers=1, max_image_bytes=1000, max_image_pixels=5000, image_max_tokens=99,
        low_detail_image_tokens=11, pan_and_scan=False, max_image_tiles=0, allowed_local_media_path="/tmp",
        allowed_media_domains=("A.com", "*.b.org"), allow_private_media_urls=True, enable_image_embeds=True,
        media_fetch_timeout=2.5, media_max_redirects=1, max_queue=7, max_embed_queue=2, embed_batch_tokens=8,
        grammar_cache_mib=0, decode_workers=2, decode_workers_per_request=1, max_decode_queue=6,
        max_request_image_pixels=777, max_request_decode_seconds=0.0, decode_processes=False,
        log_stats_interval=0.0, drain_timeout=1.0, chat_template="{{ messages }}", tool_call_parser="hermes",
        max_body_bytes=12345, max_messages=3, max_content_parts=4, header_timeout=1.0, body_timeout=2.0,
        keepalive_timeout=3.0, keepalive_max_requests=0, lingering_time=0.5, max_request_line=100,
        max_header_size=101, max_headers=5)
    m = cfg.media_config()
    assert (m.limits.max_bytes, m.limits.max_pixels, m.allowed_local_path, m.allowed_domains, m.allow_private_urls,
            m.fetch_timeout, m.max_redirects, m.image_max_tokens, m.low_detail_tokens, m.pan_and_scan, m.max_tiles,
            m.decode_workers, m.decode_workers_per_request, m.max_decode_queue, m.max_request_pixels,
            m.max_request_decode_seconds, m.decode_processes, m.video_workers) == (
        1000, 5000, "/tmp", ("a.com", "*.b.org"), True, 2.5, 1, 99, 11, False, 0, 2, 1, 6, 777, 0.0, False, 1)
    v = m.video_limits
    assert (v.max_bytes, v.max_duration_s, v.max_frames, v.max_pixels, v.decode_timeout_s) == (2000, 5.5, 9, 100, 1.5)
    assert ServerConfig().media_config() == type(m)()     # the defaults agree too


def test_an_option_is_one_field():
    """A dataclass of option() fields gives flags, env defaults, conversions and Python keywords."""
    import argparse
    from dataclasses import dataclass, field

    from mmjax.options import Options, key_value, option, positive_int

    @dataclass
    class Toy(Options):
        max_loras: int = option(1, type=positive_int, help="adapters in one batch")
        lora_modules: dict = option(default_factory=dict, type=key_value, nargs="+", convert=dict,
                                    help="NAME=PATH adapters")
        overlap: bool = option(True, flag="--no-overlap")
        python_only: list = field(default_factory=list)

    p = Toy.add_cli_args(argparse.ArgumentParser())
    assert Toy.from_cli_args(p.parse_args([])) == Toy()
    t = Toy.from_cli_args(p.parse_args(["--max-loras", "3", "--lora-modules", "a=/x", "b=/y=z", "--no-overlap"]))
    assert t == Toy(max_loras=3, lora_modules={"a": "/x", "b": "/y=z"}, overlap=False)
    for bad in (["--lora-modules", "nopath"], ["--max-loras", "0"], ["--python-only", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
