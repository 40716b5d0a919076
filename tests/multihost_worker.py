"""One process of the 2-process multi-host test (tests/test_sharding.py): 2 fake CPU devices per
process, jax.distributed over 127.0.0.1, one TP=4 mesh over both processes' devices.

    python tests/multihost_worker.py <process id> <port> <checkpoint dir>

Process 0 (leader) first generates on its own first device alone (the single-device reference,
no other process involved), then serves the same mixed batch through a TP=4 engine whose
follower half runs in process 1 (`mmjax.distributed.follow`), and prints one RESULT JSON line.
Process 1 builds the same engine, follows, and prints how many calls it ran.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import mmjax  # noqa: E402
from mmjax import distributed  # noqa: E402

pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(f"127.0.0.1:{port}", 2, pid)

import jax  # noqa: E402
from sharding_worker import generate  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_model_len=128, prefill_chunk=128, max_encode_batch=2)

if distributed.is_leader():
    want = generate(mmjax.load(path, **ENGINE))          # one local device: process 0 alone
    vlm = mmjax.load(path, tensor_parallel=4, **ENGINE)  # 2 devices here + 2 in process 1
    got = generate(vlm)
    st = vlm.engine.stats()
    distributed.stop_followers()
    print("RESULT " + json.dumps({"ids_equal": got == want, "ids": got, "processes": jax.process_count(),
                                  "devices": jax.device_count(), "mesh": st["mesh"],
                                  "weight_bytes_per_device": st["weight_bytes_per_device"]}), flush=True)
else:
    vlm = mmjax.load(path, tensor_parallel=4, **ENGINE)
    vlm.engine                                          # build the runner (same order as the leader)
    print("FOLLOWED " + json.dumps({"calls": distributed.follow()}), flush=True)
