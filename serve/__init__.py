"""serve/: the OpenAI-compatible aiohttp server around the mmjax engine (see serve/README.md).

    mmjax serve --model DIR            # or: python -m serve --model DIR
    serve.main(argv) / serve.add_arguments(parser) + serve.run(args)   (wired into mmjax.cli)
    serve.app.create_app(vlm_or_engine, ServerConfig(...)) -> aiohttp.web.Application
"""
from serve.cli import add_arguments, build_parser, main, run  # noqa: F401


def create_app(vlm_or_engine, config=None):
    from serve.app import create_app as _create
    return _create(vlm_or_engine, config)
