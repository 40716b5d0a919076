"""Data-parallel serving: M engine replicas, each over its own tensor-parallel sub-mesh, behind
the one Engine interface the server and `AsyncEngine` use.

`make_engine(model, mesh=...)` returns a plain `Engine` when the mesh's "data" axis has size 1
and a `DataParallelEngine` otherwise. The replicas share nothing on the device: each has its own
params copy (laid out for its TP group), KV cache, prefix cache and encoder cache. Admission
routes each request to one replica:

- affinity first: a request whose first image (by content key), or else whose prompt prefix,
  was last routed to replica r goes to r again, where its encoder features and its KV prefix
  live (vLLM/SGLang "cache-aware" routing);
- unless r is loaded more than `affinity_slack` requests above the least loaded replica (a hot
  key must not pin all traffic to one replica); then, and for new keys, the least loaded
  replica (running + waiting requests) wins.

`step()` steps every replica that has work, each in its own thread (JAX releases the GIL while
a compiled step runs, so the replicas' devices work at the same time), and returns all deltas.
"""
from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmjax.errors import InvalidRequestError, MMJaxError
from mmjax.serving.engine import Engine
from mmjax.serving.request import Delta, Request, RequestOutput
from mmjax.sharding import DATA, axis_size, sub_meshes

log = logging.getLogger("mmjax.engine")

PREFIX_AFFINITY_TOKENS = 32   # prompt tokens that name a text-only request's prefix for routing


def make_engine(model, *, mesh=None, **engine_kw) -> "Engine | DataParallelEngine":
    """An Engine over `mesh` (None: one device), or M replicas when its data axis is M > 1."""
    if axis_size(mesh, DATA) > 1:
        return DataParallelEngine(model, mesh=mesh, **engine_kw)
    return Engine(model, mesh=mesh, **engine_kw)


def affinity_key(req: Request) -> Any:
    """What ties a request to a replica's caches: its first image's content key, else its first
    prompt tokens (a shared system prompt / conversation prefix)."""
    if req.images:
        return ("image", req.images[0].key)
    return ("prefix", tuple(int(t) for t in req.prompt_ids[:PREFIX_AFFINITY_TOKENS]))


class DataParallelEngine:
    """M `Engine` replicas (one per index of the mesh's "data" axis) with the Engine API."""

    def __init__(self, model, *, mesh, affinity_slack: int | None = None, max_affinity_keys: int = 65536,
                 **engine_kw):
        self.model = model
        self.tokenizer = model.tokenizer
        self.family = model.family
        self.mesh = mesh
        meshes = sub_meshes(mesh)
        import jax
        if jax.process_count() > 1 and any(all(d.process_index != jax.process_index() for d in m.devices.flat)
                                           for m in meshes):
            # the leader reads every step's sampled tokens from its own devices
            raise ValueError("multi-host data parallel: every replica must include devices of this process; "
                             "run one server per host instead (docs/scaling.md)")
        if engine_kw.get("max_loras"):
            from mmjax.errors import UnsupportedModelError
            raise UnsupportedModelError("LoRA adapters are not supported with data parallelism", param="max_loras")
        self.replicas = [Engine(model, mesh=m, primary=i == 0, **engine_kw) for i, m in enumerate(meshes)]
        first = self.replicas[0]
        self.grammars = first.grammars          # make_request (structured output) runs on replica 0
        self.max_model_len = first.max_model_len
        self.prefill_chunk = first.prefill_chunk
        self.max_images_per_request = first.max_images_per_request
        self.affinity_slack = affinity_slack if affinity_slack is not None else len(first.slots)
        self._affinity: collections.OrderedDict = collections.OrderedDict()   # key -> replica (LRU)
        self._max_keys = max_affinity_keys
        self._owner: dict[str, int] = {}                                      # request id -> replica
        self.requests = collections.ChainMap(*(e.requests for e in self.replicas))
        self.routed = {"affinity": 0, "least_loaded": 0}
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="mmjax-replica")

    # ---- the Engine interface ------------------------------------------------------------------
    @property
    def runner(self):
        """Replica 0's runner (offline encode / logits use one replica)."""
        return self.replicas[0].runner

    @property
    def max_prompt_bytes(self) -> int:
        return self.replicas[0].max_prompt_bytes

    @property
    def waiting(self) -> list[Request]:
        return [r for e in self.replicas for r in e.waiting]

    @property
    def slots(self) -> list[Request | None]:
        return [s for e in self.replicas for s in e.slots]

    adapters = None         # no LoRA adapters (refused above)
    lora_names: list[str] = []

    def load_lora(self, name: str, path, adapter=None) -> int:
        return self.replicas[0].load_lora(name, path, adapter)      # LoRAError: this engine serves none

    def unload_lora(self, name: str) -> None:
        self.replicas[0].unload_lora(name)

    def make_request(self, *args, **kw) -> Request:
        return self.replicas[0].make_request(*args, **kw)

    def siblings(self, req: Request, n: int) -> list[Request]:
        return self.replicas[0].siblings(req, n)

    def add_request(self, prompt, images=(), sampling=None, request_id=None) -> str:
        return self.submit(self.make_request(prompt, images, sampling, request_id))

    def load(self, i: int) -> int:
        e = self.replicas[i]
        return len(e.scheduler.active()) + len(e.waiting)

    def route(self, req: Request) -> int:
        """The replica for `req` (see the module docstring)."""
        loads = [self.load(i) for i in range(len(self.replicas))]
        least = min(range(len(loads)), key=loads.__getitem__)
        key = affinity_key(req)
        r = self._affinity.get(key)
        if r is not None and loads[r] <= loads[least] + self.affinity_slack:
            self.routed["affinity"] += 1
        else:
            r = least
            self.routed["least_loaded"] += 1
        self._affinity[key] = r
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._max_keys:
            self._affinity.popitem(last=False)
        return r

    def submit(self, req: Request) -> str:
        if req.id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
        r = self.route(req)
        self.replicas[r].submit(req)
        self._owner[req.id] = r
        return req.id

    def abort(self, request_id: str) -> bool:
        r = self._owner.get(request_id)
        return False if r is None else self.replicas[r].abort(request_id)

    def release(self, request_id: str) -> None:
        r = self._owner.get(request_id)
        if r is None:
            return
        self.replicas[r].release(request_id)
        if request_id not in self.replicas[r].requests:
            del self._owner[request_id]

    def output(self, request_id: str) -> RequestOutput:
        return self.replicas[self._owner[request_id]].output(request_id)

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.replicas)

    def step(self) -> list[Delta]:
        busy = [e for e in self.replicas if e.has_work()]
        if len(busy) <= 1:
            return busy[0].step() if busy else []
        return [d for ds in self._pool.map(Engine.step, busy) for d in ds]

    def fail_active(self, err: MMJaxError) -> list[Delta]:
        return [d for e in self.replicas for d in e.fail_active(err)]

    def reset_device_state(self) -> None:
        for e in self.replicas:
            e.reset_device_state()

    def refresh(self) -> set[str]:
        """Every replica serves the edited live model (the first places it, the others copy)."""
        changed = set()
        for e in self.replicas:
            changed |= e.refresh()
        return changed

    def warmup(self, progress=None) -> dict[str, int]:
        """Every replica's warmup at once; each reports its own shapes (`Engine.warmup`)."""
        if self.has_work():
            raise RuntimeError("warmup() needs an idle engine")
        counts = list(self._pool.map(lambda e: e.warmup(progress), self.replicas))
        return counts[0]

    # the same loop over this class's requests / step / output / release
    run_until_done = Engine.run_until_done

    def stats(self) -> dict[str, Any]:
        """Counters summed over replicas; per-replica figures under "replicas"; the whole mesh
        and every device's weight / KV bytes."""
        per = [e.stats() for e in self.replicas]
        out: dict[str, Any] = {}
        for s in per:
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        out["compile_seconds"] = round(out.get("compile_seconds", 0.0), 3)
        out.update(self.grammars.stats())       # one grammar cache (replica 0's), not one per replica
        out["compiled_shapes"] = per[0]["compiled_shapes"]            # every replica compiles the same set
        out["compiled_shapes_bound"] = per[0]["compiled_shapes_bound"]
        out["step_seconds"] = {k: round(sum(s["step_seconds"][k] for s in per), 3) for k in per[0]["step_seconds"]}
        out["mesh"] = {"devices": int(self.mesh.devices.size),
                       "axes": {k: int(v) for k, v in self.mesh.shape.items()},
                       "platform": self.mesh.devices.flat[0].platform}
        for k in ("weight_bytes_per_device", "kv_cache_bytes_per_device"):
            out[k] = {d: b for s in per for d, b in s[k].items()}
        for k in ("weight_bytes_max_device", "kv_cache_bytes_max_device"):
            out[k] = max(s[k] for s in per)
        out["data_parallel"] = len(self.replicas)
        out["routed"] = dict(self.routed)
        out["replicas"] = [{"requests_running": s["requests_running"], "requests_waiting": s["requests_waiting"],
                            "tokens_decoded": s["tokens_decoded"], "tokens_cached": s["tokens_cached"],
                            "encoder_cache_hits": s["encoder_cache_hits"]} for s in per]
        return out
