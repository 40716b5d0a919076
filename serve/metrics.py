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

    GAUGES = (("num_requests_running", "requests_running", "Requests holding a decode slot."),
              ("num_requests_waiting", "requests_waiting", "Requests queued in the engine for a slot."),
              ("slots_total", "slots_total", "Decode slots (--max-num-seqs)."),
              ("slots_used", "slots_used", "Decode slots in use."),
              ("encoder_cache_entries", "encoder_cache_entries", "Images in the encoder cache."),
              ("encoder_cache_bytes", "encoder_cache_bytes", "Bytes held by the encoder cache."),
              ("compile_seconds", "compile_seconds", "Seconds spent compiling."),
              ("kv_pages_total", "kv_pages_total", "KV-cache pages (paged cache)."),
              ("kv_pages_used", "kv_pages_used", "KV-cache pages held by requests."),
              ("kv_pages_free", "kv_pages_free", "KV-cache pages free (including evictable cached ones)."),
              ("kv_pages_cached", "kv_pages_cached", "KV-cache pages kept under a prefix hash (shareable)."),
              ("prefix_cache_hit_rate", "prefix_hit_rate", "Prompt pages found in the prefix cache / pages asked."),
              ("grammar_cache_entries", "grammar_cache_entries", "Compiled structured-output matchers cached."),
              ("grammar_cache_bytes", "grammar_cache_bytes",
               "Heap bytes held by the cached structured-output matchers (measured as each was built)."),
              ("grammar_cache_bytes_bound", "grammar_cache_max_bytes",
               "Bound on grammar_cache_bytes (--grammar-cache-mib): least recently used matchers go first."))
    COUNTERS = (("engine_requests_finished", "requests_finished", "Requests finished by the engine."),
                ("engine_requests_aborted", "requests_aborted", "Requests aborted (client gone, drain)."),
                ("engine_prefill_tokens", "tokens_prefilled", "Prompt tokens prefilled."),
                ("engine_decode_tokens", "tokens_decoded", "Tokens generated."),
                ("engine_cached_tokens", "tokens_cached", "Prompt tokens served from the prefix cache."),
                ("engine_preemptions", "preemptions", "Requests preempted for KV-cache pages (recomputed later)."),
                ("engine_decode_steps", "decode_steps", "Compiled decode steps run."),
                ("engine_prefill_calls", "prefill_calls", "Compiled prefill calls (each packs chunks)."),
                ("engine_prefill_chunks", "prefill_chunks", "Prompt chunks prefilled (packed into prefill calls)."),
                ("engine_encoder_calls", "encoder_calls", "Compiled encoder calls."),
                ("engine_images_encoded", "images_encoded", "Images run through the vision tower."),
                ("engine_videos_encoded", "videos_encoded", "Videos run through the vision tower."),
                ("encoder_cache_hits", "encoder_cache_hits", "Encoder-cache hits (image already encoded)."),
                ("encoder_cache_misses", "encoder_cache_misses", "Encoder-cache misses."),
                ("grammar_cache_hits", "grammar_cache_hits", "Structured-output specs found compiled in the cache."),
                ("grammar_cache_misses", "grammar_cache_misses", "Structured-output specs compiled."))

    def collect(self):
        s = self.stats_fn()
        # Keys the engine does not (or no longer) report are skipped, never a scrape failure.
        for name, key, doc in self.GAUGES:
            if isinstance(s.get(key), (int, float)):
                yield GaugeMetricFamily(f"mmjax_{name}", doc, value=s[key])
        if s.get("slots_total"):
            yield GaugeMetricFamily("mmjax_slot_utilization", "slots_used / slots_total.",
                                    value=s.get("slots_used", 0) / s["slots_total"])
        for name, key, doc in self.COUNTERS:
            if isinstance(s.get(key), (int, float)):
                yield CounterMetricFamily(f"mmjax_{name}", doc, value=s[key])
        shapes = GaugeMetricFamily("mmjax_compiled_shapes", "Distinct compiled shapes per step kind.",
                                   labels=["kind"])
        for k, v in sorted((s.get("compiled_shapes") or {}).items()):
            shapes.add_metric([k], v)
        yield shapes
        bound = GaugeMetricFamily("mmjax_compiled_shapes_bound", "Upper bound on compiled shapes per kind.",
                                  labels=["kind"])
        for k, v in sorted((s.get("compiled_shapes_bound") or {}).items()):
            bound.add_metric([k], v)
        yield bound
        # where the model lives: the mesh and every device's share of weights and KV cache
        mesh = s.get("mesh") or {}
        if mesh:
            m = GaugeMetricFamily("mmjax_mesh_axis_size", "Devices along each mesh axis (data, model).",
                                  labels=["axis"])
            for k, v in sorted((mesh.get("axes") or {"devices": mesh.get("devices", 1)}).items()):
                m.add_metric([k], v)
            yield m
        if s.get("kv_cache_dtype"):   # the KV cache's element type (--kv-cache-dtype), as a label
            g = GaugeMetricFamily("mmjax_kv_cache_dtype_info", "KV cache element type (1 for the one in use).",
                                  labels=["dtype"])
            g.add_metric([s["kv_cache_dtype"]], 1)
            yield g
        if "cross_attention_cache_bytes" in s:   # cross-attention families (Mllama)
            for key, doc in (("cross_attention_cache_bytes", "Bytes of the per-slot cross-attention K/V cache."),
                             ("cross_attention_slots", "Slots holding a request's image K/V.")):
                g = GaugeMetricFamily(f"mmjax_{key}", doc)
                g.add_metric([], s[key])
                yield g
        for key, name, doc in (("weight_bytes_per_device", "weight_bytes", "Bytes of weights held by each device."),
                               ("kv_cache_bytes_per_device", "kv_cache_bytes", "Bytes of KV cache held by each device.")):
            per = s.get(key) or {}
            g = GaugeMetricFamily(f"mmjax_{name}", doc, labels=["device"])
            for dev, v in sorted(per.items()):
                g.add_metric([dev], v)
            yield g
        plan = s.get("memory_plan")
        if plan:   # computed at startup (runner.memory_plan): bytes per device by part, and the peak
            g = GaugeMetricFamily("mmjax_memory_plan_bytes", "Device memory plan, bytes per device: weights "
                                  "(text, vision), KV cache, decode state, each step kind's temporaries, peak.",
                                  labels=["part"])
            for k, v in sorted(plan.items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "slots":
                    g.add_metric([k], v)
            yield g


class ServerMetrics:
    def __init__(self, stats_fn, queue_depth_fn):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mmjax_http_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("mmjax_request_latency_seconds", "End-to-end request latency.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mmjax_time_to_first_token_seconds", "Time from request arrival to first token.",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mmjax_prompt_tokens", "Prompt tokens (image and video tokens included).",
                                     registry=r)
        self.image_tokens = Counter("mmjax_image_tokens", "Image tokens in prompts.", registry=r)
        self.cached_tokens = Counter("mmjax_cached_prompt_tokens", "Prompt tokens from the prefix cache.",
                                     registry=r)
        self.completion_tokens = Counter("mmjax_completion_tokens", "Generated tokens.", registry=r)
        self.images = Counter("mmjax_images", "Images received.", registry=r)
        self.videos = Counter("mmjax_videos", "Videos received.", registry=r)
        self.video_tokens = Counter("mmjax_video_tokens", "Video tokens in prompts.", registry=r)
        self.video_decode_seconds = Histogram(
            "mmjax_video_decode_seconds", "Seconds to probe, decode and preprocess one video (a video "
            "cache hit takes ~0).", buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("mmjax_http_requests_in_flight", "Generation requests being served.",
                               registry=r)
        self.disconnects = Counter("mmjax_client_disconnects", "Requests aborted because the client left.",
                                   registry=r)
        self.timeouts = Counter("mmjax_http_timeouts", "Connections answered 408 and closed because a request "
                                "head or body did not arrive in time.", ["phase"], registry=r)
        self.protocol_errors = Counter("mmjax_http_protocol_errors", "Malformed HTTP requests answered before "
                                       "reaching a route (bad request line, headers, Content-Length).",
                                       ["status"], registry=r)
        qd = Gauge("mmjax_queue_depth", "Requests waiting for a slot (engine queue + inbox).", registry=r)
        qd.set_function(queue_depth_fn)
        r.register(EngineCollector(stats_fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)
