"""End to end on the GPU: the jaxfuse model against the same model in plain JAX + cuDNN and
against `impl="reference"`, in one run (issue 16's targets).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/model.py --out benchmarks/results/model
    PYTHONPATH=. python benchmarks/model.py --tiny --out /tmp/model   # CPU smoke run, tiny shapes

Sections (all by default, or name some): train157 (157M preset, B=8, T=2048), train1b (1B preset,
B=2, T=8192, the preset's remat="block+attention" for both peers; the reference is not run
there), decode (157M, greedy B=32 and beam B=8 K=4, prompts of 512, 256 new tokens, bf16
cache). `--swap-attention` adds a 157M row of jaxfuse with cuDNN attention swapped in (how much
of the gap is attention).

Train rows: loss + grads under one `jax.jit` (float32 master weights, bfloat16 compute), tokens/s,
MFU (model FLOPs: 6 x matmul parameters x tokens + 6 x B x T^2 x d_model x layers for causal
attention, over 989 TFLOP/s dense bf16 on H100/H200), compiled temporary memory
(`.compile().memory_analysis()`), and the loss / gradient agreement with the plain model.
Decode rows: generated tokens/s (batch x new tokens; beams count once per sequence), the time
per decoding step (from runs of 256 and 1 new tokens) against the bytes it must read (bf16
weights + the KV cache present) at the copy rate measured in the same run.

The plain-JAX model below is written the way a JAX user would without jaxfuse: jnp norms,
RoPE and SwiGLU, `jax.nn.dot_product_attention(implementation="cudnn")`, logits + optax loss,
the same stacked parameters, the same `lax.scan` and the same remat policy.
Writes model.json and model.png (ratios against each peer) into --out. Target: about 3-4 minutes
on an H200, most of it compiling.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import functools
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import _timing  # noqa: E402
from benchmarks._timing import bench, guarded, record  # noqa: E402
import jaxfuse  # noqa: E402
from jaxfuse import model as M  # noqa: E402
from jaxfuse.model import transformer as T  # noqa: E402
from jaxfuse.model.config import remat_policy  # noqa: E402
from jaxfuse import residual_name  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


# ---------------------------------------------------------------- the plain JAX + cuDNN model
def _plain_norm(x, p, cfg):
    xf = x.astype(jnp.float32)
    if cfg.norm == "rms":
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    else:
        mu = jnp.mean(xf, -1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(jnp.var(xf, -1, keepdims=True) + 1e-5)
    y = y * p["weight"].astype(jnp.float32)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def _plain_rope(x, positions, base):
    d = x.shape[-1]
    freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = positions[..., None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return out.reshape(x.shape).astype(x.dtype)


def plain_loss(params, tokens, targets, cfg, attn_impl="cudnn", cast_in_loop=False):
    """The same model in plain JAX: XLA norms, RoPE, SwiGLU and loss; cuDNN attention.
    `cast_in_loop`: the layers' weights cast one layer at a time inside the scan, as jaxfuse's
    model does since s34 (a diagnostic row: what the same change gives this model)."""
    p = (T.cast_outer if cast_in_loop else T.cast)(params, cfg)
    stack = params["blocks"] if cast_in_loop else p["blocks"]
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = p["embed"][tokens]

    def body(x, blk):
        blk = T.cast(blk, cfg)           # a no-op unless cast_in_loop
        y = _plain_norm(x, blk["attn_norm"], cfg)
        q = _plain_rope((y @ blk["wq"]).reshape(b, t, cfg.n_heads, -1), pos, cfg.rope_base)
        k = _plain_rope((y @ blk["wk"]).reshape(b, t, cfg.n_kv_heads, -1), pos, cfg.rope_base)
        v = (y @ blk["wv"]).reshape(b, t, cfg.n_kv_heads, -1)
        # Named like jaxfuse's attention residuals, so that remat="...+attention" keeps the
        # same arrays here (cuDNN's softmax statistics cannot be named: its forward reruns).
        q, k, v = (checkpoint_name(a, residual_name("attention")) for a in (q, k, v))
        o = checkpoint_name(jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation=attn_impl),
                            residual_name("attention"))
        x = x + o.reshape(b, t, -1) @ blk["wo"]
        y = _plain_norm(x, blk["mlp_norm"], cfg)
        # Named like jaxfuse's SwiGLU inputs, so that remat="...+swiglu" keeps them here too.
        gate, up = (checkpoint_name(y @ blk[w], residual_name("swiglu")) for w in ("w1", "w3"))
        x = x + (jax.nn.silu(gate) * up) @ blk["w2"]
        return x, None

    enabled, policy = remat_policy(cfg.remat)
    if enabled:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    if cfg.scan_layers:
        x, _ = jax.lax.scan(body, x, stack)
    else:
        for i in range(cfg.n_layers):
            x, _ = body(x, jax.tree.map(lambda a: a[i], stack))
    logits = _plain_norm(x, p["final_norm"], cfg) @ T.unembedding(p, cfg)
    valid = targets != -100
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         jnp.where(valid, targets, 0))
    return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)


# ---------------------------------------------------------------- accounting
def model_flops(cfg, b, t) -> float:
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff
    matmul_params = cfg.n_layers * per_layer + d * cfg.vocab_size
    return 6.0 * matmul_params * b * t + 6.0 * b * t * t * d * cfg.n_layers


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def _tree_rel_err(a, b) -> float:
    num = sum(float(jnp.sum((x.astype(jnp.float32) - y.astype(jnp.float32)) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(jnp.sum(y.astype(jnp.float32) ** 2)) for y in jax.tree.leaves(b))
    return (num / max(den, 1e-30)) ** 0.5


# ---------------------------------------------------------------- training
def _with_cudnn_attention(fn):
    """fn with the model's attention swapped for cuDNN's while it is traced (a diagnostic row:
    how much of the gap to the plain model is attention)."""
    from jaxfuse.model import _block_ops

    cudnn = lambda q, k, v, *, causal=True, **_: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal,
        implementation="cudnn" if jax.default_backend() == "gpu" else None)

    def swapped(*args, **kwargs):
        with mock.patch.object(_block_ops, "attention", cudnn):
            return fn(*args, **kwargs)
    return swapped


def _with_kept_projections(fn):
    """fn with the block's fused projections unfused while it is traced (a diagnostic row, the
    model before session s11): add_norm then the q/k/v and gate/up matmuls, swiglu then the
    down projection, so the backward keeps y and the SwiGLU product instead of rebuilding them."""
    from jaxfuse.model import _block_ops

    def add_norm_linear(x, residual, weight, bias=None, *, projections, **kw):
        h, y = _block_ops.add_norm(x, residual, weight, bias, **kw)
        return h, tuple(y @ p for p in projections)

    def swiglu_linear(gate, up, weight, *, impl="pallas"):
        return jaxfuse.swiglu(gate, up, impl=impl) @ weight

    def swapped(*args, **kwargs):
        with mock.patch.multiple(_block_ops, add_norm_linear=add_norm_linear,
                                 swiglu_linear=swiglu_linear):
            return fn(*args, **kwargs)
    return swapped


def _three_qkv_matmuls():
    """A context in which the model forms q, k and v with three matmuls (before session s11)
    instead of one on `qkv_weight`'s grouped matrix (a diagnostic row)."""
    def qkv(outs, positions, cfg, impl):
        b, t, _ = outs[0].shape
        q, k, v = (o.reshape(b, t, -1, cfg.head_dim) for o in outs)
        rope = functools.partial(T.ops.rope, positions=positions, base=cfg.rope_base, impl=impl)
        return rope(q), rope(k), v

    return mock.patch.multiple(T, qkv=qkv,
                               qkv_weights=lambda blk, cfg: (blk["wq"], blk["wk"], blk["wv"]))


def _sliced_qkv():
    """A context in which the model slices q, k and v out of the grouped projection and turns q
    and k by `jaxfuse.rope` (before s36) instead of `jaxfuse.rope_qkv`'s one pass each way (a
    diagnostic row; on one device: the sharding constraints of the model's q, k and v are left
    out)."""
    from jaxfuse.reference import rope_qkv

    def qkv(outs, positions, cfg, impl):
        b, t, _ = outs[0].shape
        hkv, g, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        q, k, v = rope_qkv.split(outs[0].reshape(b, t, hkv, g + 2, hd))
        rope = functools.partial(T.ops.rope, positions=positions, base=cfg.rope_base, impl=impl)
        return rope(q), rope(k), v

    return mock.patch.object(T, "qkv", qkv)


def _ce_pair():
    """A context in which the token-slab loss forms each slab's loss and dz by the cross-entropy
    kernels' pair (forward for lse, backward for dz: the logits read twice from memory, as
    before s37) instead of `cross_entropy.loss_and_grad`'s one kernel."""
    from jaxfuse.pallas import cross_entropy as pce

    def pair(z, labels, st):
        loss, pull = jax.vjp(lambda z: pce.token_loss(z, labels, st), z)
        return loss, pull(jnp.ones_like(loss))[0]

    return mock.patch.object(pce, "loss_and_grad", pair)


def _triton_swiglu():
    """A context in which SwiGLU takes its Triton kernels where the Hopper ones would run (a
    diagnostic row: the Hopper kernels read the scan's stacked gate and up in place, Triton's
    get copies). Held over the whole lowering: a custom_vjp's backward is traced after the
    forward returns."""
    from jaxfuse.pallas import swiglu_hopper
    return mock.patch.object(swiglu_hopper, "fits", lambda *a, **k: False)


# Diagnostic train rows: jaxfuse's preset lowered inside a context that puts back an earlier
# or a stripped-down piece of the model. `--FLAG` (dashes for underscores) adds the row named
# here; the context is held over the whole lowering (a custom_vjp's backward is traced after
# its forward returns).
def _forced_tiles(**forced):
    """A context in which the Hopper attention backward's rules (`HopperBwdTiles.fixes`,
    `dkv_overlaps`) are asked of tiles with the fields `forced`, whatever tiles the model
    passes: `fixed_dq=True` runs the deterministic fused dQ in int32 fixed point wherever it
    can (opt-in since s38: D = 64, no segment ids) instead of the kernel pair;
    `dkv_overlap=False` the dK/dV kernel's plain steps (overlapped by default); `one_launch`
    the kernel pair in one launch or two."""
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    stack = contextlib.ExitStack()
    for name in ("fixes", "dkv_overlaps", "launches_once"):   # asked of forced tiles
        rule = getattr(HopperBwdTiles, name)
        stack.enter_context(mock.patch.object(HopperBwdTiles, name, lambda self, *a, rule=rule: (
            rule(dataclasses.replace(self, **forced), *a))))
    return stack


def _sum_mma():
    """A context in which the Hopper attention forward's default tiles
    (`HopperAttnTiles.for_head_dim`) take `sum_mma=True` wherever they can (not with the
    overlap, D = 256's default): the row sums by the tensor cores, opt-in since s53."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    rule = HopperAttnTiles.for_head_dim.__func__

    def for_head_dim(cls, d):
        tiles = rule(cls, d)
        return tiles if tiles.overlap else dataclasses.replace(tiles, sum_mma=True)
    return mock.patch.object(HopperAttnTiles, "for_head_dim", classmethod(for_head_dim))


def _no_issue():
    """A context in which the Hopper attention forward's `overlap=None` resolves as before s55
    (False at head_dim 64 past 4096 keys, where "issue" is the default since): the 1B
    preset's forward with its two waits a step."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    rule = HopperAttnTiles.overlap_for

    def overlap_for(self, spec):
        got = rule(self, spec)
        return False if self.overlap is None and got == "issue" else got
    return mock.patch.object(HopperAttnTiles, "overlap_for", overlap_for)


# The context rows that time the model with deterministic_attention=False.
NONDET_ROWS = ("nondet_plain",)
CONTEXT_ROWS = {
    "triton_swiglu": ("jaxfuse, Triton SwiGLU", _triton_swiglu,
                      "also time jaxfuse with SwiGLU's Triton kernels instead of the Hopper ones "
                      "(which read the scan's stacked residuals in place)"),
    "three_qkv": ("jaxfuse, three q/k/v matmuls", _three_qkv_matmuls,
                  "also time jaxfuse with q, k and v formed by three matmuls (before s11) "
                  "instead of one on the grouped [d, Hkv (G + 2) hd] matrix"),
    "sliced_qkv": ("jaxfuse, q/k/v sliced, then rope", _sliced_qkv,
                   "also time jaxfuse with q, k and v sliced out of the grouped projection and "
                   "turned by jaxfuse.rope (before s36) instead of jaxfuse.rope_qkv"),
    "ce_pair": ("jaxfuse, slab loss and dz by two kernels", _ce_pair,
                "also time jaxfuse with each loss slab's loss and dz formed by the "
                "cross-entropy forward and backward kernels (before s37) instead of one kernel"),
    "fixed_dq": ("jaxfuse, fixed-point dQ", functools.partial(_forced_tiles, fixed_dq=True),
                 "also time jaxfuse with the attention backward's fused dQ added in int32 fixed "
                 "point (deterministic, 5 products) instead of the kernel pair"),
    "fixed_plain": ("jaxfuse, fixed-point dQ, plain steps",
                    functools.partial(_forced_tiles, fixed_dq=True, dkv_overlap=False),
                    "also time jaxfuse with the fixed-point dQ on the dK/dV kernel's plain "
                    "steps (HopperBwdTiles(fixed_dq=True, dkv_overlap=False); overlapped "
                    "is the default since s41)"),
    "nondet_plain": ("jaxfuse, nondeterministic attention, plain steps",
                     functools.partial(_forced_tiles, dkv_overlap=False),
                     "also time jaxfuse with nondeterministic attention whose fused dQ runs "
                     "on the dK/dV kernel's plain steps (HopperBwdTiles(dkv_overlap=False))"),
    "two_launches": ("jaxfuse, attention backward pair in two launches",
                     functools.partial(_forced_tiles, one_launch=False),
                     "also time jaxfuse with the attention backward's kernel pair in two "
                     "launches (HopperBwdTiles(one_launch=False); one with GQA, as both "
                     "presets have, is the default since s48)"),
    "sum_mma": ("jaxfuse, attention row sums by the tensor cores", _sum_mma,
                "also time jaxfuse with the Hopper attention forward's row sums formed by the "
                "tensor cores (HopperAttnTiles(sum_mma=True), opt-in since s53) at D <= 128"),
    "no_issue": ("jaxfuse, attention forward waiting twice a step", _no_issue,
                 "also time jaxfuse with the Hopper attention forward's plain steps at head_dim "
                 "64 past 4096 keys (the default before s55) instead of overlap='issue'"),
    "unguarded": ("jaxfuse, attention without the garbage guard", _timing.unguarded_attention,
                  "also time jaxfuse without the guard against masked keys' garbage in the "
                  "Hopper attention kernels (forward: the producer cleans edge tiles; "
                  "backward: an XLA pass over K)"),
}


def profile_attention(cfg, b, t):
    """The model's attention alone (forward, and forward + backward), kernel by kernel: how many
    launches one call makes, to set against the train step's profile."""
    from benchmarks._profile import report
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (b, t, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, t, cfg.n_kv_heads, cfg.head_dim), jnp.bfloat16)
            for kk in ks[1:3])
    import jaxfuse
    fwd = jax.jit(lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True))
    step = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True), q, k, v)[1](q))
    report("attention", f"forward alone B{b} T{t} H{cfg.n_heads}/{cfg.n_kv_heads}", fwd,
           (q, k, v), top=6)
    report("attention", "forward + backward alone", step, (q, k, v), top=6)
    if jax.default_backend() == "gpu":     # the same calls through cuDNN, the plain model's
        cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                  implementation="cudnn")
        report("attention", "cuDNN forward alone", jax.jit(cudnn), (q, k, v), top=6)
        report("attention", "cuDNN forward + backward alone",
               jax.jit(lambda q, k, v: jax.vjp(cudnn, q, k, v)[1](q)), (q, k, v), top=6)


def train(name, cfg, b, t, impls, bar, reps, profile=False, profile_dir=None, token_slab=None):
    key = jax.random.key(0)
    params = M.init(key, cfg)
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-100)
    flops, peak = model_flops(cfg, b, t), peak_flops()
    attn = "cudnn" if jax.default_backend() == "gpu" else None
    fns = {"jaxfuse": functools.partial(M.loss, cfg=cfg, impl="pallas"),
           # cuDNN's attention backward is non-deterministic unless XLA is told otherwise
           # (xla_gpu_deterministic_ops): this row is jaxfuse on the same terms.
           "jaxfuse, nondeterministic attention": functools.partial(
               M.loss, cfg=dataclasses.replace(cfg, deterministic_attention=False),
               impl="pallas"),
           # the preset with another loss_token_slab (None: the fused loss)
           f"jaxfuse, loss_token_slab={token_slab}": functools.partial(
               M.loss, cfg=dataclasses.replace(cfg, loss_token_slab=token_slab), impl="pallas"),
           "jaxfuse, y and SwiGLU product kept": _with_kept_projections(
               functools.partial(M.loss, cfg=cfg, impl="pallas")),
           # the context rows of NONDET_ROWS run the model's nondeterministic attention
           **{row: functools.partial(M.loss, cfg=dataclasses.replace(
               cfg, deterministic_attention=cfg.deterministic_attention
               and flag not in NONDET_ROWS), impl="pallas")
              for flag, (row, _, _) in CONTEXT_ROWS.items()},
           "jaxfuse, cuDNN attention": _with_cudnn_attention(
               functools.partial(M.loss, cfg=cfg, impl="pallas")),
           # the model before s34: the stacked weights cast to bf16 before the layer loop
           "jaxfuse, weights cast before the loop": lambda p, x, y: M.loss(
               {**p, "blocks": T.cast(p["blocks"], cfg)}, x, y, cfg=cfg, impl="pallas"),
           f"plain JAX + {attn or 'xla'}": functools.partial(plain_loss, cfg=cfg, attn_impl=attn),
           f"plain JAX + {attn or 'xla'}, weights cast in the loop": functools.partial(
               plain_loss, cfg=cfg, attn_impl=attn, cast_in_loop=True),
           "reference": functools.partial(M.loss, cfg=cfg, impl="reference")}
    results = {}
    for impl in impls:
        impl = next(k for k in fns if fnmatch.fnmatch(k, impl + "*"))
        bar.set_description(f"{name}: {impl}")

        def run(impl=impl):
            step = jax.jit(jax.value_and_grad(lambda p, x, y: fns[impl](p, x, y)))
            context = {row: ctx for row, ctx, _ in CONTEXT_ROWS.values()}.get(
                impl, contextlib.nullcontext)
            with context():
                compiled = step.lower(params, tokens, targets).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            (loss, grads) = compiled(params, tokens, targets)
            sec = bench(compiled, [(params, tokens, targets)], reps=reps, repeats=3, warmup=1)
            results[impl] = (sec, loss, grads)
            extra = dict(tokens_per_s=b * t / sec, temp_GB=temp / 1e9, loss=float(loss))
            if peak:
                extra["MFU"] = flops / sec / peak
            record(name, f"{name} B{b} T{t} loss+grads", impl, sec, **extra)
            if profile and impl != "reference":
                from benchmarks._profile import report
                bar.clear()
                if profile_dir:   # the optimized HLO, to see which kernels sit where
                    import gzip
                    slug = impl.replace(" ", "_").replace(",", "").replace("+", "")
                    with gzip.open(os.path.join(profile_dir, f"{name}_{slug}.hlo.txt.gz"),
                                   "wt") as fh:
                        fh.write(compiled.as_text())
                report(name, f"{impl} kernels", compiled, (params, tokens, targets), top=40,
                       explain=("memcpy",))
        guarded(name, f"{name} B{b} T{t} loss+grads", impl, run)
        bar.update()
    base = next((k for k in results if k.startswith("plain")), None)
    if base:
        for impl, (sec, loss, grads) in results.items():
            if impl != base:
                record(name, f"{name} train: {impl} vs {base}", impl, None,
                       speedup=results[base][0] / sec,
                       loss_rel_diff=abs(float(loss) - float(results[base][1]))
                       / abs(float(results[base][1])),
                       grad_rel_err=_tree_rel_err(grads, results[base][2]))


# ---------------------------------------------------------------- decoding
def decode(cfg, b_greedy, b_beam, k, prompt, new, impls, bar, copy_bw, profile=False,
           profile_dir=None):
    params = M.init(jax.random.key(0), cfg)
    # bf16 weights read per step: all but the embedding table (a gather of B rows), which is
    # read whole only as a tied unembedding.
    weights_bytes = 2 * sum(x.size for x in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        weights_bytes -= 2 * cfg.vocab_size * cfg.d_model
    kv_bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    for mode, b in (("greedy", b_greedy), ("beam", b_beam)):
        rows = b * (k if mode == "beam" else 1)
        prompts = jax.random.randint(jax.random.key(2), (b, prompt), 0, cfg.vocab_size)
        lengths = jnp.full((b,), prompt, jnp.int32)
        for impl in impls:
            bar.set_description(f"decode {mode}: {impl}")

            def run(mode=mode, impl=impl):
                # eos_id=-1 is never generated, so every run takes all `n` steps.
                if mode == "greedy":
                    f = lambda p, x, l, n: M.greedy(p, cfg, x, l, max_new_tokens=n, eos_id=-1,
                                                    impl=impl)
                else:
                    f = lambda p, x, l, n: M.beam_search(p, cfg, x, l, beam_size=k,
                                                         max_new_tokens=n, eos_id=-1, impl=impl)
                t_full = bench(lambda: f(params, prompts, lengths, new), [()], reps=1, repeats=3,
                               warmup=1)
                extra = {}
                if impl == "pallas":   # the step time against its floor (one more compile)
                    t_one = bench(lambda: f(params, prompts, lengths, 1), [()], reps=1,
                                  repeats=3, warmup=1)
                    step = (t_full - t_one) / (new - 1)
                    present = rows * (prompt + new / 2) * kv_bytes_per_token
                    floor = (weights_bytes + present) / copy_bw
                    extra = dict(step_ms=step * 1e3, floor_ms=floor * 1e3,
                                 step_over_floor=step / floor)
                record("decode", f"{mode} B{b}{f' K{k}' if mode == 'beam' else ''} P{prompt} "
                       f"new{new}", impl, t_full, tokens_per_s=b * new / t_full, **extra)
                if profile:   # kernels of a 32-token call: prefill + 31 steps
                    from benchmarks._profile import gaps, report
                    bar.clear()
                    g = lambda: f(params, prompts, lengths, 32)
                    report("decode", f"{mode} {impl} kernels (prefill + 31 steps)", g, (),
                           top=16)
                    gaps(g, ())
                    if profile_dir and impl == "pallas":   # which fusions a step holds
                        import gzip
                        text = jax.jit(lambda p, x, l: f(p, x, l, 32)).lower(
                            params, prompts, lengths).compile().as_text()
                        with gzip.open(os.path.join(profile_dir, f"decode_{mode}.hlo.txt.gz"),
                                       "wt") as fh:
                            fh.write(text)
            guarded("decode", f"{mode} B{b}", impl, run)
            bar.update()
    by = {(r["workload"], r["impl"]): r for r in _timing.ROWS
          if r["section"] == "decode" and "tokens_per_s" in r}
    for (w, impl), r in list(by.items()):
        if impl == "pallas" and (w, "reference") in by:
            record("decode", f"{w}: jaxfuse vs reference", "pallas", None,
                   speedup=r["tokens_per_s"] / by[(w, "reference")]["tokens_per_s"])


# ---------------------------------------------------------------- chart
def chart(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return
    rows = [r for r in _timing.ROWS if "speedup" in r]
    mem = [r for r in _timing.ROWS if "temp_GB" in r]
    if not rows:
        return
    widths = [max(len(rows), 1), max(len(mem), 1)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(rows) + 4), 5),
                                  gridspec_kw={"width_ratios": widths})
    vals = [r["speedup"] for r in rows]
    ax.bar(range(len(rows)), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["workload"].replace(": ", "\n") for r in rows],
                  fontsize=7, rotation=15, ha="right")
    ax.set_ylabel("speed ratio (tokens/s of the first named over the second)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.bar(range(len(mem)), [r["temp_GB"] for r in mem], color="tab:blue")
    ax2.set_xticks(range(len(mem)), [f"{r['section']}\n{r['impl']}" for r in mem], fontsize=7,
                   rotation=15, ha="right")
    ax2.set_ylabel("compiled temporary memory of loss + grads (GB)")
    fig.suptitle(f"jaxfuse model end to end, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


SECTIONS = ("train157", "train1b", "decode")


def _token_slab(text: str):
    """--loss-token-slab: "none" (the fused loss) or a positive number of tokens."""
    if text.lower() == "none":
        return "none"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of tokens or "
                                         "\"none\"")
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sections", nargs="*", default=list(SECTIONS))
    ap.add_argument("--out", default="benchmarks/results/model")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--swap-attention", action="store_true",
                    help="also time jaxfuse with cuDNN attention swapped in (157M)")
    ap.add_argument("--kept-projections", action="store_true",
                    help="also time jaxfuse with add_norm_linear and swiglu_linear unfused "
                         "(y and the SwiGLU product kept for the backward, as before s11)")
    for flag, (_, _, help_) in CONTEXT_ROWS.items():
        ap.add_argument("--" + flag.replace("_", "-"), action="store_true", help=help_)
    ap.add_argument("--cast-ab", action="store_true",
                    help="also time both models with the other placement of the weights' cast "
                         "to bf16 (jaxfuse before the layer loop, as before s34; plain JAX "
                         "inside it, as jaxfuse since s34)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the impl=\"reference\" train row (slow; a diagnostic run)")
    ap.add_argument("--no-scan", action="store_true",
                    help="run the layers as a Python loop (Config.scan_layers=False) in every "
                         "train row, jaxfuse and plain alike")
    ap.add_argument("--remat", default=None,
                    help="Config.remat of the 157M rows, jaxfuse and plain alike (\"block\", "
                         "a jax.checkpoint_policies name, either + \"+op\"...; the plain model "
                         "names only attention's arrays, so only \"+attention\" reaches it; "
                         "the preset's is \"none\")")
    ap.add_argument("--loss-token-slab", default=None, type=_token_slab,
                    help="adds a jaxfuse train row with Config.loss_token_slab=N (the loss's "
                         "gradient formed in the forward, N tokens at a time; the presets' is "
                         "2048) or \"none\" (the fused loss)")
    ap.add_argument("--remat-1b", default=None,
                    help="Config.remat of the 1B rows (the preset's is \"block+attention\")")
    ap.add_argument("--profile", action="store_true",
                    help="print each train row's largest GPU kernels (jax.profiler trace)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    t0 = time.time()
    copy_bw = _timing.copy_ceiling() if not args.tiny else 1e10
    record("ceiling", "copy 1 GiB f32 (read+write)", "xla", None, TBps=copy_bw / 1e12)
    if args.tiny:
        small = dict(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                     max_len=40)
        c157, c1b = M.Config(**small, dtype="bfloat16"), M.Config(**small, dtype="bfloat16",
                                                                   remat="block")
        shapes = dict(t157=(2, 16), t1b=(1, 32), dec=(3, 2, 2, 8, 6), reps=2)
    else:
        c157, c1b = M.preset("157m"), M.preset("1b")
        shapes = dict(t157=(8, 2048), t1b=(2, 8192), dec=(32, 8, 4, 512, 256), reps=10)
    if args.remat:
        c157 = dataclasses.replace(c157, remat=args.remat)
    if args.remat_1b:
        c1b = dataclasses.replace(c1b, remat=args.remat_1b)
    if args.no_scan:
        c157, c1b = (dataclasses.replace(c, scan_layers=False) for c in (c157, c1b))
    impls157 = ("jaxfuse", "jaxfuse, nondet", "plain") + (() if args.no_reference else ("reference",)) + (
        ("jaxfuse, cuDNN",) if args.swap_attention else ())
    slab = () if args.loss_token_slab is None else ("jaxfuse, loss_token_slab",)
    token_slab = None if args.loss_token_slab in (None, "none") else args.loss_token_slab
    kept = (("jaxfuse, y and SwiGLU",) if args.kept_projections else ()) + tuple(
        row for flag, (row, _, _) in CONTEXT_ROWS.items() if getattr(args, flag)) + (
        ("jaxfuse, weights cast before", "plain JAX + *, weights") if args.cast_ab else ())
    impls157 += slab + kept
    impls1b = ("jaxfuse", "jaxfuse, nondet", "plain") + slab + kept
    tasks = {"train157": len(impls157), "train1b": len(impls1b), "decode": 4}
    bar = tqdm(total=sum(tasks[s] for s in args.sections), unit="run")
    if "train157" in args.sections:
        if args.profile:
            profile_attention(c157, *shapes["t157"])
        train("157M", c157, *shapes["t157"], impls157, bar, shapes["reps"], args.profile,
              args.out, token_slab)
    if "train1b" in args.sections:
        if args.profile:
            profile_attention(c1b, *shapes["t1b"])
        train("1B", c1b, *shapes["t1b"], impls1b, bar, max(2, shapes["reps"] // 4),
              args.profile, args.out, token_slab)
    if "decode" in args.sections:
        dec = shapes["dec"]
        cfg = dataclasses.replace(c157, max_len=max(c157.max_len, dec[3] + dec[4]))
        decode(cfg, dec[0], dec[1], dec[2], dec[3], dec[4], ("pallas", "reference"), bar, copy_bw,
               args.profile, args.out)
    bar.close()
    _timing.save(os.path.join(args.out, "model.json"))
    chart(os.path.join(args.out, "model.png"))
    print(f"total {time.time() - t0:.0f}s; results in {args.out}/model.json")


if __name__ == "__main__":
    main()
