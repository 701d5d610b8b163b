"""Partitioning rules: every public op runs one kernel per shard under `jax.sharding`.

`_core` holds the mechanism (custom_partitioning in automatic mode, shard_map in explicit mode,
a custom_vjp joining the partitioned forward and backward); `rows` and `attention` hold the
per-op rules. `jaxfuse.<op>` (impl="pallas") goes through them; `jaxfuse.pallas.<op>` is the
bare kernel.
"""
