"""The serving core: request types, scheduler, caches, the step loop (Engine), the async face
(AsyncEngine, the server's only entry point), the runner (compiled steps) and sampling."""
from mmjax.serving.async_engine import AsyncEngine  # noqa: F401
from mmjax.serving.engine import Engine  # noqa: F401
from mmjax.serving.request import Delta, Request, RequestOutput  # noqa: F401
from mmjax.serving.sampling import SamplingParams  # noqa: F401
