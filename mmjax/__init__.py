"""mmjax: a JAX serving kernel for vision-language models."""
from mmjax.errors import (  # noqa: F401
    CheckpointError, ContextLengthError, ImageError, ImageTooLargeError, InvalidRequestError,
    MMJaxError, PromptError, QueueFullError, UnsupportedModelError,
)

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so `import mmjax` stays cheap for the CLI and for tests that only need errors.
    if name in ("load", "VLM"):
        from mmjax import api
        return getattr(api, name)
    if name == "EngineArgs":
        from mmjax.engine_args import EngineArgs
        return EngineArgs
    if name in ("SamplingParams",):
        from mmjax.serving.sampling import SamplingParams
        return SamplingParams
    if name in ("Capture", "MaskSpec"):
        from mmjax.models import nn
        return getattr(nn, name)
    raise AttributeError(name)
