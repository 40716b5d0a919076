"""The placement seam: where params, KV cache and decode state live, and the shardings every
compiled step takes from there.

`Placement(mesh=None)` is one device (JAX's default device, no sharding annotations: the
compiled steps are exactly the single-device ones). With a `jax.sharding.Mesh`, arrays are
placed with `NamedSharding`s from `spec_for` (today: replicated; the partitioning rules from
logical axes to mesh axes come with tensor/data parallel serving) and every step gets them as
its out_shardings, so XLA keeps the cache and state where they are between steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclass(frozen=True)
class Placement:
    mesh: Mesh | None = None

    def sharding(self, kind: str) -> NamedSharding | None:
        """The sharding of one kind of state ("params", "cache", "state", "outputs"); None on
        one device (JAX's default placement)."""
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec_for(kind))

    def spec_for(self, kind: str) -> PartitionSpec:
        return PartitionSpec()  # replicated: the multi-device issue adds the axis rules

    def place(self, tree: Any, kind: str) -> Any:
        """Put a pytree (numpy or jax arrays) on its devices."""
        s = self.sharding(kind)
        return jax.device_put(tree) if s is None else jax.device_put(tree, s)

    def step_shardings(self, *kinds: str):
        """out_shardings for a step returning one pytree per kind (None: let XLA/JAX decide,
        i.e. the default device)."""
        if self.mesh is None:
            return None
        return tuple(self.sharding(k) for k in kinds)
