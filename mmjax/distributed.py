"""Multi-host serving: one mesh over the devices of several processes (JetStream / MaxText
pattern).

Every process runs `initialize()` (jax.distributed over a coordinator), loads the same model with
the same mesh flags, and builds the same engine, so each has the same runners in the same order.
Process 0 (the leader) runs the HTTP server and the scheduler; before each compiled call a
runner on a mesh that spans processes sends the call's host inputs to the others
(`StepChannel.send`: a pickled payload padded to a power-of-two size, broadcast with
`jax.experimental.multihost_utils.broadcast_one_to_all`), and the followers (`follow`) run the
same runner method with the same inputs, so all processes launch the same compiled steps in the
same order, as SPMD needs. Only the leader reads results.

What is announced: the runner's `encode`, `prefill`, `decode`, `fill_cross`, `park` and `reset_device_state` (all the
engine and the server use). `VLM.logits` (a research call with its own jit) is not: use it in
single-process runs only.

Flags / environment (serve/cli.py): --coordinator-address (MMJAX_COORDINATOR_ADDRESS, host:port
of process 0), --num-processes (MMJAX_NUM_PROCESSES), --process-id (MMJAX_PROCESS_ID). On CPU
the cross-process collectives use gloo.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading

import numpy as np

log = logging.getLogger("mmjax.distributed")

ENV = {"coordinator_address": "MMJAX_COORDINATOR_ADDRESS", "num_processes": "MMJAX_NUM_PROCESSES",
       "process_id": "MMJAX_PROCESS_ID"}
_MIN_PAYLOAD = 1024        # payload buckets: 1 KiB, 2 KiB, ... (one broadcast compile per bucket)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """jax.distributed.initialize from arguments, else the MMJAX_* environment; False (and
    nothing done) for a single process."""
    coordinator_address = coordinator_address or os.environ.get(ENV["coordinator_address"])
    num_processes = int(num_processes or os.environ.get(ENV["num_processes"]) or 1)
    pid = process_id if process_id is not None else os.environ.get(ENV["process_id"])
    if num_processes <= 1:
        return False
    if coordinator_address is None or pid is None:
        raise ValueError(f"{num_processes} processes need a coordinator address and a process id "
                         f"(flags, or {ENV['coordinator_address']} / {ENV['process_id']})")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU meshes across processes
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=int(pid))
    log.info("process %d of %d: %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True


def is_leader() -> bool:
    import jax
    return jax.process_index() == 0


def spans_processes(mesh) -> bool:
    """Does this mesh hold devices of other processes?"""
    if mesh is None:
        return False
    import jax
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


class StepChannel:
    """Leader -> followers host messages over the devices' collectives (all processes call
    send / recv in the same order)."""

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        size = _bucket(len(data))
        self._bcast(np.asarray([len(data), size], np.int64))
        buf = np.zeros(size, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        self._bcast(buf)

    def recv(self):
        n, size = (int(v) for v in self._bcast(np.zeros(2, np.int64)))
        buf = self._bcast(np.zeros(size, np.uint8))
        return pickle.loads(np.asarray(buf)[:n].tobytes())

    @staticmethod
    def _bcast(x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.broadcast_one_to_all(x))


def _bucket(n: int) -> int:
    size = _MIN_PAYLOAD
    while size < n:
        size *= 2
    return size


# Runners on meshes that span processes, in construction order: the same in every process
# (same flags, same code), so an index names the same runner everywhere.
_RUNNERS: list = []
_LOCK = threading.Lock()
_CHANNEL = StepChannel()


def register(runner) -> int | None:
    """Called by ModelRunner: its index when its mesh spans processes, else None."""
    if not spans_processes(runner.placement.mesh):
        return None
    _RUNNERS.append(runner)
    return len(_RUNNERS) - 1


class Leader:
    """The leader's side of one runner: announce each call before making it. The lock keeps
    announce + launch of one call together (DP replicas step from threads)."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, op: str, args, run):
        with _LOCK:
            _CHANNEL.send((self.index, op, args))
            return run()


def stop_followers() -> None:
    """Leader: end every follower's `follow` loop (at shutdown)."""
    import jax
    if jax.process_count() > 1 and is_leader() and _RUNNERS:
        _CHANNEL.send((-1, "stop", None))


def follow() -> int:
    """Follower main loop: run every call the leader announces on the same runner, until the
    leader stops. Returns the number of calls run."""
    from mmjax.models.family import EncodeCall

    n = 0
    while True:
        index, op, args = _CHANNEL.recv()
        if op == "stop":
            return n
        runner = _RUNNERS[index]
        if op == "encode":
            runner.encode([EncodeCall(bucket, inputs, list) for bucket, inputs in args])
        elif op == "prefill":
            runner.prefill(*args)
        elif op == "decode":
            runner.decode(*args)
        elif op == "reset":
            runner.reset_device_state()
        elif op == "park":
            runner.park(*args)
        elif op == "fill_cross":
            runner.fill_cross(*args)
        elif op == "copy_slot":
            runner.copy_slot(*args)
        elif op == "set_pages":
            runner.set_pages(*args)
        elif op == "restore_row":
            runner.restore_row(*args)
        elif op == "save_state":
            runner.save_state(*args)
        elif op == "load_state":
            runner.load_state(*args)
        else:
            raise RuntimeError(f"unknown step {op!r} from the leader")
        n += 1
