"""Partitioning rules: every public op runs one kernel per shard under `jax.sharding`.

`_core` holds the mechanism (custom_partitioning in automatic mode, shard_map in explicit mode,
a custom_vjp joining the partitioned forward and backward, custom_vmap for jax.vmap); `rows`,
`attention`, `ring`, `linear_cross_entropy` and `blocks` (add_norm, add_norm_linear, swiglu,
swiglu_linear, rope, the dropout family, embedding, beam_top_k, reorder_beams) hold the per-op
rules. `jaxfuse.<op>`
(impl="pallas") goes through them; `jaxfuse.pallas.<op>` is the bare kernel.

A rule for a new op is a few lines: name each dimension of each operand and result by a factor
(`lead(n)` for leading row axes), say which factors may split, and write the per-shard passes,
which receive `plan` (factor -> mesh axes) for the collectives they need. A row-wise op, e.g.:

    def _fwd(plan, x, w):                 # per shard: the kernel on the local rows
        y, stats = kernel_fwd(x, w)
        return y, stats
    def _bwd(plan, x, w, y, stats, dy):   # operands: args + outputs + cotangents
        dx, dw = kernel_bwd(x, w, stats, dy)
        return dx, rows.psum_over(dw, plan, lead(x.ndim - 1))   # dW sums over split rows
    rows_ = lead(x.ndim - 1)
    op = vjp_op(_fwd, _bwd,
                Layout(((*rows_, "d"), ("d",)), ((*rows_, "d"), rows_), rows_),
                Layout(((*rows_, "d"), ("d",), (*rows_, "d"), rows_, (*rows_, "d")),
                       ((*rows_, "d"), ("d",)), rows_),
                n_out=1, diff=(True, True), name="my_norm")
    y = op(x, w)[0]

The op's outputs are tagged "jaxfuse.my_norm" (`residual_name`), for `jax.checkpoint` policies.

An op without a gradient calls `partitioned(local, layout, args)` instead of `vjp_op`.
"""
