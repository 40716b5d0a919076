"""Prometheus metrics (prometheus-client), one registry per app so tests can run several servers.

Server-side series are updated by the handlers; engine series are read from `engine.stats()` at
scrape time by a custom collector (no polling thread).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineCollector:
    def __init__(self, stats_fn):
        self.stats_fn = stats_fn

    def describe(self):
        return []

    def collect(self):
        s = self.stats_fn()
        g = lambda name, doc, v: GaugeMetricFamily(f"mmjax_{name}", doc, value=v)  # noqa: E731
        c = lambda name, doc, v: CounterMetricFamily(f"mmjax_{name}", doc, value=v)  # noqa: E731
        yield g("num_requests_running", "Requests holding a decode slot.", s["requests_running"])
        yield g("num_requests_waiting", "Requests queued in the engine for a slot.", s["requests_waiting"])
        yield g("slots_total", "Decode slots (--max-num-seqs).", s["slots_total"])
        yield g("slots_used", "Decode slots in use.", s["slots_used"])
        yield g("slot_utilization", "slots_used / slots_total.", s["slots_used"] / max(s["slots_total"], 1))
        yield c("engine_requests_finished", "Requests finished by the engine.", s["requests_finished"])
        yield c("engine_requests_aborted", "Requests aborted (client gone, drain).", s["requests_aborted"])
        yield c("engine_prefill_tokens", "Prompt tokens prefilled.", s["tokens_prefilled"])
        yield c("engine_decode_tokens", "Tokens generated.", s["tokens_decoded"])
        yield c("engine_cached_tokens", "Prompt tokens served from the prefix cache.", s["tokens_cached"])
        yield c("engine_decode_steps", "Compiled decode steps run.", s["decode_steps"])
        yield c("engine_prefill_calls", "Compiled prefill chunks run.", s["prefill_calls"])
        yield c("engine_encoder_calls", "Compiled encoder calls.", s["encoder_calls"])
        yield c("engine_images_encoded", "Images run through the vision tower.", s["images_encoded"])
        yield c("encoder_cache_hits", "Encoder-cache hits (image already encoded).", s["encoder_cache_hits"])
        yield c("encoder_cache_misses", "Encoder-cache misses.", s["encoder_cache_misses"])
        yield g("encoder_cache_entries", "Images in the encoder cache.", s["encoder_cache_entries"])
        yield g("encoder_cache_bytes", "Bytes held by the encoder cache.", s["encoder_cache_bytes"])
        shapes = GaugeMetricFamily("mmjax_compiled_shapes", "Distinct compiled shapes per step kind.",
                                   labels=["kind"])
        for k, v in sorted(s["compiled_shapes"].items()):
            shapes.add_metric([k], v)
        yield shapes
        bound = GaugeMetricFamily("mmjax_compiled_shapes_bound", "Upper bound on compiled shapes per kind.",
                                  labels=["kind"])
        for k, v in sorted(s["compiled_shapes_bound"].items()):
            bound.add_metric([k], v)
        yield bound
        yield g("compile_seconds", "Seconds spent compiling.", s["compile_seconds"])


class ServerMetrics:
    def __init__(self, stats_fn, queue_depth_fn):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mmjax_http_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("mmjax_request_latency_seconds", "End-to-end request latency.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mmjax_time_to_first_token_seconds", "Time from request arrival to first token.",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mmjax_prompt_tokens", "Prompt tokens (image tokens included).",
                                     registry=r)
        self.image_tokens = Counter("mmjax_image_tokens", "Image tokens in prompts.", registry=r)
        self.cached_tokens = Counter("mmjax_cached_prompt_tokens", "Prompt tokens from the prefix cache.",
                                     registry=r)
        self.completion_tokens = Counter("mmjax_completion_tokens", "Generated tokens.", registry=r)
        self.images = Counter("mmjax_images", "Images received.", registry=r)
        self.in_flight = Gauge("mmjax_http_requests_in_flight", "Generation requests being served.",
                               registry=r)
        self.disconnects = Counter("mmjax_client_disconnects", "Requests aborted because the client left.",
                                   registry=r)
        qd = Gauge("mmjax_queue_depth", "Requests waiting for a slot (engine queue + inbox).", registry=r)
        qd.set_function(queue_depth_fn)
        r.register(EngineCollector(stats_fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)
