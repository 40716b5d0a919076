"""`mmjax serve` / `python -m serve`: argument parsing, model loading, serving, SIGTERM drain."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass, replace

from mmjax.engine_args import EngineArgs
from mmjax.options import Options, memory_budget, option, positive_int
from serve.config import ServerConfig

log = logging.getLogger("mmjax.serve")


@dataclass
class ServeArgs(Options):
    """`mmjax serve`'s own options: where to listen, startup, logging, multi-host."""
    host: str = option("127.0.0.1", help="bind address (default 127.0.0.1)")
    port: int = option(8000, type=int, help="port (default 8000; 0 = any free port)")
    coordinator_address: str | None = option(
        None, env="MMJAX_COORDINATOR_ADDRESS",
        help="multi-host: host:port of process 0 (jax.distributed; env MMJAX_COORDINATOR_ADDRESS)")
    num_processes: int = option(1, type=positive_int, env="MMJAX_NUM_PROCESSES",
                                help="multi-host: processes (hosts) sharing the mesh (env MMJAX_NUM_PROCESSES)")
    process_id: int = option(0, type=int, env="MMJAX_PROCESS_ID",
                             help="multi-host: this process's index; 0 serves HTTP, the others follow "
                                  "(env MMJAX_PROCESS_ID)")
    warmup: bool = option(False, help="compile every bucket of every step (encode, prefill, decode) before listening")
    log_level: str = option("info")


OPTION_GROUPS = (("model and engine", EngineArgs), ("server", ServerConfig), ("process", ServeArgs))


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag of `mmjax serve`, generated from the fields of EngineArgs, ServerConfig, ServeArgs."""
    for title, cls in OPTION_GROUPS:
        cls.add_cli_args(p.add_argument_group(title))
    return p


_memory_budget = memory_budget     # the --memory-budget value type (tests import it from here)


def log_memory_plan(engine) -> None:
    """The device memory plan of each engine replica, on the startup log."""
    for i, e in enumerate(engine.replicas):
        plan = e.runner.memory_plan()
        mib = {k: f"{v / 2**20:,.1f} MiB" for k, v in plan.items()
               if isinstance(v, int) and not isinstance(v, bool) and k != "slots"}
        log.info("memory plan (replica %d, %d slots, per device, vision offloaded: %s, KV cache %s): %s", i,
                 plan["slots"], plan["vision_offloaded"], plan["kv_cache_dtype"],
                 ", ".join(f"{k} {v}" for k, v in mib.items()))


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="mmjax serve", description="OpenAI-compatible server for an mmjax vision-language model"))


def config_from_args(args: argparse.Namespace, model_path: str | None = None) -> ServerConfig:
    """The ServerConfig a parsed `mmjax serve` command line describes."""
    return ServerConfig.from_cli_args(args)


def warmup(vlm) -> float:
    """Compile every bucket of every step before listening (`Engine.warmup`); returns seconds."""
    import time

    t = time.monotonic()
    counts = vlm.engine.warmup()
    log.info("compiled shapes after warmup: %s", counts)
    return time.monotonic() - t


async def serve_forever(vlm, cfg, host: str, port: int) -> int:
    from serve.app import create_app, drain, start_server

    app = create_app(vlm, cfg)
    runner, site, bound = await start_server(app, host, port)
    print(f"mmjax serve: model {cfg.served_model_name!r} listening on http://{host}:{bound} "
          f"(OpenAI API at http://{host}:{bound}/v1)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining running requests (up to %.0fs)", cfg.drain_timeout)
    await drain(app, site)
    await runner.cleanup()
    log.info("stopped")
    return 0


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mmjax import distributed
    from serve.app import configure_family
    proc, cfg = ServeArgs.from_cli_args(args), ServerConfig.from_cli_args(args)
    multihost = distributed.initialize(proc.coordinator_address, proc.num_processes, proc.process_id)
    engine_args = replace(EngineArgs.from_cli_args(args),   # request-level image/video limits size the engine
                          max_images_per_request=max(cfg.limit_images, 1) + max(cfg.limit_videos, 0))
    if cfg.lora_modules and not engine_args.max_loras:      # adapter slots for --lora-modules
        engine_args = replace(engine_args, max_loras=max(4, len(cfg.lora_modules)))
    vlm = engine_args.load(image_limits=cfg.media_config().limits)
    configure_family(vlm, cfg)
    if multihost and not distributed.is_leader():
        # a follower: same model, same engine, no server; runs the leader's steps until it stops
        vlm.engine
        log.info("process %d following the leader's steps", proc.process_id)
        log.info("followed %d steps; the leader stopped", distributed.follow())
        return 0
    if proc.warmup:
        log.info("warmup done in %.1fs", warmup(vlm))
        log_memory_plan(vlm.engine)
    try:
        return asyncio.run(serve_forever(vlm, cfg, proc.host, proc.port))
    finally:
        distributed.stop_followers()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
