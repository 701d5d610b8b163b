"""Every kernel lowers to Triton for an NVIDIA GPU, checked on a CPU.

`jax.export` with platforms=["cuda"] runs the Pallas -> Triton lowering without a GPU, so bugs
that only the GPU path has (Triton's power-of-two tiles, one indexer per load, scalar types)
fail here, in CI, instead of on the benchmark machine. Compiling and running stay GPU-only
(benchmarks/gpu_check.py).
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jaxfuse


# The GPU the kernels are lowered for. jax < 0.11 lowers Triton for sm90 when no GPU is
# attached; jax >= 0.11 reads the GPU from the abstract mesh in context and, on a host without
# one, raises ("please specify an abstract GPU device"). An H100 is named for both.
_SM90 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


def _lower(f, *args):
    try:
        with jax.sharding.use_abstract_mesh(_SM90):
            return export.export(
                jax.jit(f), platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(*args)
    except (ImportError, ModuleNotFoundError) as e:  # a jaxlib built without Triton lowering
        pytest.skip(f"Triton lowering unavailable in this jaxlib: {e}")


def _fwd_bwd(f, *args):
    def g(*a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(jax.tree.map(jnp.ones_like, y))
    return _lower(g, *args)


@pytest.mark.parametrize("shape", [(33, 1000), (4, 70000)])
def test_row_kernels_lower(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    w = jnp.zeros(shape[-1:], jnp.bfloat16)
    labels = jnp.zeros(shape[:1], jnp.int32)
    kw = dict(interpret=False)
    _fwd_bwd(lambda x: jaxfuse.softmax(x, causal=True, mask=x > 0, **kw), x)
    _fwd_bwd(lambda x, w: jaxfuse.layer_norm(x, w, w, **kw), x, w)
    _fwd_bwd(lambda x, w: jaxfuse.rms_norm(x, w, **kw), x, w)
    _fwd_bwd(lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=0.1, **kw), x)
    _fwd_bwd(lambda x: jaxfuse.cross_entropy(x, labels, **kw), x)   # no sum of logits formed


@pytest.mark.parametrize("opts", [
    dict(causal=True), dict(causal=True, sliding_window=16), dict(logits_soft_cap=5.0),
    dict(causal=True, segments=True),
])
@pytest.mark.parametrize("d,hkv", [(64, 2), (80, 1)])
def test_flash_attention_lowers(opts, d, hkv):
    opts = dict(opts)
    q = jnp.zeros((1, 100, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 100, hkv, d), jnp.bfloat16)
    if opts.pop("segments", False):
        seg = jnp.zeros((1, 100), jnp.int32)
        opts.update(q_segment_ids=seg, kv_segment_ids=seg)
    _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(q, k, v, interpret=False, **opts), q, k, k)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("splits", [1, 3])   # 1: the kernel writes the final o in q's dtype
def test_decode_attention_lowers(hq, hkv, splits):
    q = jnp.zeros((3, hq, 128), jnp.bfloat16)
    kc = jnp.zeros((3, 1000, hkv, 128), jnp.bfloat16)
    lens = jnp.array([0, 10, 1000], jnp.int32)
    _lower(lambda q, kc, lens: jaxfuse.decode_attention(q, kc, kc, lens, interpret=False,
                                                        num_splits=splits), q, kc, lens)
    # The appended token and the packed array add the same ops to the kernel with 1 split as
    # with 3 (checked; what they add depends on the grouping of heads: with each): with 3.
    if splits == 3:
        new = jnp.zeros((3, hkv, 128), jnp.bfloat16)   # the new token appended in place
        _lower(lambda q, kc, lens, new: jaxfuse.decode_attention(
            q, kc, kc, lens, k_new=new, v_new=new, interpret=False, num_splits=splits),
            q, kc, lens, new)
        qkv = jnp.zeros((3, hq + 2 * hkv, 128), jnp.bfloat16)   # read from one packed array
        _lower(lambda qkv, kc, lens: jaxfuse.decode_attention(
            qkv, kc, kc, lens, packed_qkv=True, interpret=False, num_splits=splits),
            qkv, kc, lens)


@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-4, logits_soft_cap=30.0)])
def test_linear_cross_entropy_lowers(opts):
    x = jnp.zeros((300, 256), jnp.bfloat16)
    w = jnp.zeros((256, 5000), jnp.bfloat16)
    labels = jnp.zeros((300,), jnp.int32)
    _fwd_bwd(lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, interpret=False, **opts), x, w)


@pytest.mark.parametrize("shape,k", [((2, 4, 1000), 4), ((2, 8, 50257), 5)])
def test_beam_top_k_lowers(shape, k):
    # 2 groups of 2048 columns; 50 groups of 8192 with k padded to a power of two in the tile.
    lp = jnp.zeros(shape, jnp.bfloat16)
    _lower(lambda lp, s: jaxfuse.beam_top_k(lp, s, k, interpret=False), lp,
           jnp.zeros(shape[:2]))


@pytest.mark.parametrize("shape,lp", [((2, 4, 1000), 0.0), ((2, 8, 50257), 0.6),
                                      ((2, 5, 1000), 0.0), ((1, 64, 131072), 0.0)])
def test_beam_step_lowers(shape, lp):
    # 1 group of 1024 columns a beam; 7 groups of 8192 with a ragged last one, and the penalty;
    # K = 5 in lists of 8 slots; 32768 survivors, re-ranked by XLA's top_k (over a program's).
    b, k, _ = shape
    _lower(lambda x, r, n, d: jaxfuse.beam_step(x, r, n, d, eos_id=2, length_penalty=lp,
                                                interpret=False),
           jnp.zeros(shape, jnp.bfloat16), jnp.zeros((b, k)), jnp.zeros((b, k), jnp.int32),
           jnp.zeros((b, k), bool))


@pytest.mark.parametrize("vmapped", [False, True])
def test_hopper_linear_cross_entropy_lowers(vmapped):
    """The Hopper GEMMs of the LCE (the forward's, and with D = 256 the backward's dz, dx and
    dW, whose operands are transposed in the kernel and whose slab offset is read by it) lower
    through Mosaic GPU for sm90, also under vmap: their rules (TMA tiling, layouts, transposed
    wgmma operands, reducing TMA stores) are checked here, which Mosaic GPU's interpreter does
    not do."""
    x = jnp.zeros((2, 256, 256), jnp.bfloat16)
    w = jnp.zeros((256, 1088), jnp.bfloat16)
    labels = jnp.zeros((2, 256), jnp.int32)

    def f(x, w, labels):
        return jaxfuse.linear_cross_entropy(
            x, w, labels, label_smoothing=0.1, logits_soft_cap=30.0, interpret=False,
            block_sizes=jaxfuse.LCEBlocks(slab=256, hopper=True))
    if vmapped:
        f = jax.vmap(f, in_axes=(0, None, 0))
    else:
        x, labels = x[0], labels[0]
    # The backward under vmap lowers the very kernels of the plain backward (the same modules,
    # checked; the forward's differ), so the plain case lowers the forward alone.
    names = ("jaxfuse_linear_cross_entropy_fwd_hopper", "jaxfuse_lce_bwd_dz",
             "jaxfuse_lce_bwd_dx", "jaxfuse_lce_bwd_dw")
    module = (_fwd_bwd if vmapped else _lower)(lambda x, w: f(x, w, labels), x, w).mlir_module()
    for name in names if vmapped else names[:1]:
        assert name in module


# The deterministic backward is the kernel pair: two launches (_TWO), or one whose CTAs run
# either body (_ONE: `HopperBwdTiles.one_launch`, the default with GQA, which the tests here
# lower with 4 query heads over 2 KV heads, unless they say otherwise).
_TWO = ("jaxfuse_flash_bwd_dkv_hopper", "jaxfuse_flash_bwd_dq_hopper")
_ONE = ("jaxfuse_flash_bwd_hopper",)
_HOPPER_BWD = {True: _ONE, False: ("jaxfuse_flash_bwd_dkv_dq_hopper",)}
_FIXED = ("jaxfuse_flash_bwd_dkv_dq_fixed_hopper",)


@pytest.mark.parametrize("d,opts,persistent", [
    (64, dict(causal=True, sliding_window=100), False), (64, dict(causal=True), True),
    (128, dict(logits_soft_cap=30.0), True)])
def test_hopper_forward_row_sums_on_tensor_cores_lower(d, opts, persistent):
    """`HopperAttnTiles(sum_mma=True)`: the second wgmma of a step (P from registers times a
    [block_k, 16] ones tile in 32-byte swizzled shared memory, wgmma's smallest N there) and
    the ones tile's TMA load lower for sm90, a CTA a work tile (the ones the first input after
    V) and persistent (after the schedule)."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(sum_mma=True, backward=False, persistent=persistent)
    module = _lower(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module


# `deterministic` picks the kernels only at D = 64 (False fuses dQ into the dK/dV kernel); at
# D = 128 and 256 both values lower the same module, kernel for kernel (checked), so there each
# mask set takes one of them (the assertions below still see no fused dQ with False at D = 128
# and 256; True at 256: test_hopper_d256_variants_lower). D = 256 takes causal alone: the
# window with the cap is lowered by test_hopper_d256_variants_lower, whose forward is this one
# and whose dK/dV and dQ kernels differ from these by the same ops, of the same types, with
# either mask set (checked), so those ops are lowered there.
@pytest.mark.parametrize("d,opts,det", [
    (64, dict(causal=True), True), (64, dict(causal=True), False),
    (128, dict(causal=True, sliding_window=200), True),
    (64, dict(sliding_window=100, logits_soft_cap=20.0), False),
    (128, dict(logits_soft_cap=30.0), False),
    (256, dict(causal=True), False),
])
def test_hopper_flash_attention_lowers(d, opts, det):
    """The Hopper forward (TMA ring, wgmma with P from registers, ping-pong barriers) and
    backward (dK/dV kernel with GQA inside the CTA, S^T and dP^T from shared memory, P^T and
    dS^T as register operands, dS^T read transposed for the fused dQ; the dQ kernel, or the
    fused dQ's reducing TMA stores; the dQ kernel's producer cleaning masked keys' garbage
    on its edge tiles, a warpgroup reduction's scratch beside the ring) lower through Mosaic
    GPU for sm90 with every mask variant and GQA; the wgmma forms and reducing stores are
    not run by Mosaic GPU's interpreter, so this is where their layout rules are checked on
    a CPU. At D = 256 the dK/dV kernel's
    consumers split dK's and dV's columns (column slices of swizzled tiles as wgmma operands
    and as stores) and there is no fused dQ. A pass here is not a compile on the GPU: jax
    0.10.2's lowering accepted constant indices into Mosaic GPU refs that 0.11.2 refused
    there (benchmarks/NOTES.md, s18 item 2)."""
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, deterministic=det,
        block_sizes=jaxfuse.AttnBlocks(hopper=True), **opts), q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    # deterministic=False fuses dQ into the dK/dV kernel at D = 64 only (faster there).
    for name in _HOPPER_BWD[det or d > 64]:
        assert name in module, name
    assert '"jaxfuse_flash_bwd_dkv"' not in module


@pytest.mark.parametrize("d,opts", [(64, dict(causal=True, segments=True)),
                                    (128, dict(causal=True, sliding_window=200)),
                                    (256, dict(logits_soft_cap=20.0))])
def test_hopper_backward_one_launch_lowers(d, opts):
    """`HopperBwdTiles(one_launch=True)`: the kernel pair as one kernel whose CTAs branch on
    their index into the dK/dV body or the dQ body, each allocating its own shared memory
    and barriers, lowers for sm90 (the interpreter of jax 0.10 cannot run it: tests/
    test_attention_hopper_bwd.py), and replaces both launches."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    opts = dict(opts)
    if opts.pop("segments", False):
        opts.update(q_segment_ids=jnp.zeros((1, 256), jnp.int32),
                    kv_segment_ids=jnp.zeros((1, 384), jnp.int32))
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(d),
                                backward=HopperBwdTiles(one_launch=True))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    assert "jaxfuse_flash_bwd_hopper" in module
    for name in _TWO:
        assert name not in module, name


# Lengths that are not whole tiles: compiled, q, k, v and dO reach the kernels unpadded where
# their lengths are whole 8-row TMA tiles, and TMA's bounds take the last tiles
# (`_attn.pad_rows`), so the kernels see arrays of other lengths than in the tests above: Tq =
# 184 leaves the last 128-row dQ CTA's second consumer wholly past the end and the last
# 192-row forward CTA (D = 64) a partial one; Tk = 296 a partial last key block. Tk = 300 is
# no whole number of 8-row tiles: padded, as before. The fused dQ at D = 64
# (deterministic=False) takes Tk = 360 unpadded; at 296 its last CTA's second consumer would
# have no key (it waits for the other's K: a hang), so there k and v stay padded. The pair at
# 128, segment ids with the pair at D = 64.
@pytest.mark.parametrize("d,det,segments,tk", [(64, False, False, 360), (64, False, False, 296),
                                               (128, True, False, 296), (64, True, True, 296),
                                               (128, True, False, 300)])
def test_hopper_ragged_lengths_lower(d, det, segments, tk):
    """The Hopper forward and backward on ragged lengths lower for sm90 with the operands
    unpadded (the interpreter runs them padded: it drops a store past an array's end, where
    TMA clips it; benchmarks/tma_oob_probe.py), and nothing pads them on the way in."""
    tq = 184
    q = jnp.zeros((2, tq, 4, d), jnp.bfloat16)
    k = jnp.zeros((2, tk, 2, d), jnp.bfloat16)
    seg = dict(q_segment_ids=jnp.zeros((2, tq), jnp.int32),
               kv_segment_ids=jnp.zeros((2, tk), jnp.int32)) if segments else {}
    f = lambda q, k, v: jaxfuse.flash_attention(                      # noqa: E731
        q, k, v, causal=True, interpret=False, deterministic=det,
        block_sizes=jaxfuse.AttnBlocks(hopper=True), **seg)
    module = _fwd_bwd(f, q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    for name in _HOPPER_BWD[det or d > 64]:
        assert name in module, name
    # Pads of [B, T, H, D] operands: none where T is whole 8-row tiles (the small per-row
    # arrays, lse, delta and segment ids, [2, 4, T] or [2, T], are padded always); k and v's
    # where it is not, or where the fused dQ's last CTA would leave a consumer keyless.
    big = [line for line in module.splitlines()
           if "stablehlo.pad" in line and f"x{d}xbf16" in line]
    fused = d == 64 and not det
    assert (len(big) > 0) == (tk % 8 != 0 or (fused and 0 < tk % 128 <= 64)), big


# The two ragged cases s34's plan named beside the checks s35 ran on the GPU (benchmarks/NOTES.md
# s34 item 7): three 64-key dK/dV consumers on an unpadded Tk (296: the last CTA's third
# consumer wholly past the end), and the fused dQ under vmap on unpadded lengths (its float32
# buffer is batched outside the kernel).
@pytest.mark.parametrize("case", ["three dK/dV consumers", "fused dQ under vmap"])
def test_hopper_ragged_lengths_lower_more(case):
    """As test_hopper_ragged_lengths_lower, for these two schedules: they lower for sm90 with
    q, k, v and dO unpadded."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    vmapped = case == "fused dQ under vmap"
    tq, tk, d = 184, (360 if vmapped else 296), 64
    lead = (2,) if vmapped else ()
    q = jnp.zeros(lead + (2, tq, 4, d), jnp.bfloat16)
    k = jnp.zeros(lead + (2, tk, 2, d), jnp.bfloat16)
    tiles = True if vmapped else HopperAttnTiles(backward=HopperBwdTiles(consumers=3))
    f = lambda q, k, v: jaxfuse.flash_attention(                      # noqa: E731
        q, k, v, causal=True, interpret=False, deterministic=not vmapped,
        block_sizes=jaxfuse.AttnBlocks(hopper=tiles))
    module = _fwd_bwd(jax.vmap(f) if vmapped else f, q, k, k).mlir_module()
    # Three dK/dV consumers do not share the dQ kernel's warpgroups: two launches.
    for name in ("jaxfuse_flash_fwd_hopper",) + (_HOPPER_BWD[False] if vmapped else _TWO):
        assert name in module, name
    big = [line for line in module.splitlines()
           if "stablehlo.pad" in line and f"x{d}xbf16" in line]
    assert not big, big


# Both kernels take the count that is not their default (the forward's and the dK/dV kernel's
# consumers are set apart), with each mask; the defaults with causal are lowered by
# test_hopper_flash_attention_lowers (the same kernels but for T). The window adds the same ops,
# of the same types, to each kernel with 2 consumers as with 3 (checked), so the defaults are not
# lowered with it again.
@pytest.mark.parametrize("opts", [dict(causal=True), dict(sliding_window=100)])
def test_hopper_consumers_lower(opts):
    """`HopperAttnTiles(consumers=)` and `HopperBwdTiles(consumers=)` at D = 64 (the forward
    runs 3 by default there, the dK/dV kernel 2): 192-row (forward) and 192-key (dK/dV) CTAs,
    the last one partly past T = 256, or 128-row CTAs; each consumer's own masked and
    passed-over blocks, 160 or 232 registers a consumer thread."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    tiles = HopperAttnTiles(consumers=2, backward=HopperBwdTiles(consumers=3))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    for name in ("jaxfuse_flash_fwd_hopper",) + _TWO:      # three dK/dV consumers
        assert name in module, name


# Segment ids at each head dim's default schedules (forward: D = 64 three consumers, D = 128
# two taking turns, persistent, D = 256 64-key tiles, the consumers free and overlapped;
# backward: D = 64 the fused dQ with deterministic=False, and without GQA the kernel pair in
# two launches whose dK/dV kernel reads K and V from shared memory (`regs_fault`), D = 128 the
# kernel pair with the overlapped dK/dV steps, D = 256 the exchange and 32-key dQ steps) and on
# the overlapped D = 128 forward.
@pytest.mark.parametrize("d,tiles,det,hkv", [
    (64, {}, False, 2), (64, {}, True, 4), (128, {}, True, 2), (256, {}, True, 2),
    (128, dict(overlap=True, pingpong=False), True, 2)])
def test_hopper_attention_with_segment_ids_lowers(d, tiles, det, hkv):
    """The Hopper kernels with segment ids: the rows' ids copied with Q (the dK/dV kernel's
    with each step's Q) and loaded as a vector of the wgmma layout, the keys' copied into a
    ring slot of their own beside K and V (the dK/dV kernel's once, with its K), both
    broadcast to the score tile and compared, causal."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    q = jnp.zeros((2, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((2, 384, hkv, d), jnp.bfloat16)
    qs, ks = jnp.zeros((2, 256), jnp.int32), jnp.zeros((2, 384), jnp.int32)
    hopper = dataclasses.replace(HopperAttnTiles.for_head_dim(d), **tiles)
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, q_segment_ids=qs, kv_segment_ids=ks, causal=True, interpret=False,
        deterministic=det, block_sizes=jaxfuse.AttnBlocks(hopper=hopper)), q, k, k
    ).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    for name in _TWO if hkv == q.shape[2] else _HOPPER_BWD[det or d > 64]:   # MHA: two
        assert name in module, name


_CAUSAL = dict(causal=True)
_WINDOW_CAP = dict(sliding_window=100, logits_soft_cap=20.0)


# The fixed-point dQ (`HopperBwdTiles(fixed_dq=True)`, `_fixed_sum`; deterministic): causal
# and the window with the cap at D = 64, with GQA; the fused dQ forced at D = 128 (each
# consumer its half of the columns, causal); under vmap on ragged lengths (the rows' scales
# padded beside lse and delta, the int32 buffer folded into the batch); at D = 64, causal, its
# plain steps (`dkv_overlap=False`; the others run the default, overlapped ones).
@pytest.mark.parametrize("d,opts,vmapped,extra", [
    (64, _CAUSAL, False, {}), (64, _WINDOW_CAP, False, {}), (128, _CAUSAL, False, {}),
    (64, _CAUSAL, True, {}), (64, _CAUSAL, False, dict(dkv_overlap=False))])
def test_hopper_fixed_point_dq_lowers(d, opts, vmapped, extra):
    """The dK/dV kernel with the fused dQ added as int32 (reducing TMA stores of int32 tiles,
    each step's rows' scales streamed with delta) lowers for sm90, with the backward's other
    kernels absent."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    tq, tk = (184, 360) if vmapped else (256, 384)
    lead = (2,) if vmapped else ()
    q = jnp.zeros(lead + (1, tq, 4, d), jnp.bfloat16)
    k = jnp.zeros(lead + (1, tk, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(backward=HopperBwdTiles(fused_dq=True if d > 64 else None,
                                                    fixed_dq=True, **extra))
    f = lambda q, k, v: jaxfuse.flash_attention(                      # noqa: E731
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts)
    module = _fwd_bwd(jax.vmap(f) if vmapped else f, q, k, k).mlir_module()
    assert _FIXED[0] in module
    assert not any(n in module for n in _ONE + _TWO + _HOPPER_BWD[False])


# Each variant of the schedule once, and each D with both mask sets: the masks act in the
# softmax and the producer's cleaning of edge tiles, code every variant shares (each mask set
# adds the same ops, of the same types, to every variant at a D: checked); the variants differ
# in the ring, the turns and the consumers. Lowered elsewhere: D = 128 taking turns, with the
# window and the cap (test_hopper_named_pingpong_lowers, the same kernel); D = 64 on a 2-slot
# ring taking turns, with causal (the forward of test_hopper_fused_dq_lowers' D = 64 case);
# D = 256, whose default forward is this schedule (2 consumers running free, 64-key tiles),
# with causal (test_hopper_flash_attention_lowers, the same kernel) and with the window and the
# cap (test_hopper_d256_variants_lower, the same kernel but for their values).
# `overlap="issue"` differs from True only in the wait before the softmax (`wgmma_wait(0)`):
# lowered at the schedule it is for, D = 64 with three consumers, causal, asked for and as
# the default resolves it past 4096 keys (None); the waits the S loads ask are recorded.
@pytest.mark.parametrize("d,consumers,stages,pingpong,opts,overlap,tk", [
    (128, 2, None, False, _CAUSAL, True, 384), (64, 3, None, False, _WINDOW_CAP, True, 384),
    (64, 2, 2, False, _WINDOW_CAP, True, 384), (64, 3, None, False, _CAUSAL, "issue", 384),
    (64, None, None, True, _CAUSAL, None, 4224)])
def test_hopper_overlap_lowers(d, consumers, stages, pingpong, opts, overlap, tk):
    """`HopperAttnTiles(overlap=True)`: O in one wgmma accumulator across the key loop, S
    read after `wgmma_wait(1)` while P V runs, O rescaled by assignment, the held tile's last
    product in a loop of 0 or 1 steps; 2 and 3 consumers (three never take turns), taking
    turns or not, a 2-slot ring (cleaning without deferral) and D = 256 (64-key tiles: its
    default, lowered elsewhere, see above); `overlap="issue"`, S read after `wgmma_wait(0)`."""
    from unittest import mock
    from jaxfuse.pallas import attention_hopper as AH
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, tk, 2, d), jnp.bfloat16)
    tiles = dataclasses.replace(AH.HopperAttnTiles.for_head_dim(d), overlap=overlap,
                                consumers=consumers, stages=stages, pingpong=pingpong,
                                backward=False)
    load, waits = AH.plgpu.wgmma_accumulator_load, []

    def recorded(acc, wait_n=0, **kw):
        waits.append(wait_n)
        return load(acc, wait_n=wait_n, **kw)
    with mock.patch.object(AH.plgpu, "wgmma_accumulator_load", recorded):
        module = _lower(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
            q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    assert waits and set(waits) == ({1} if overlap is True else {0}), waits


# The default forward at D <= 128 is persistent too: at B = 1 the same kernel as here but for
# the batch's index arithmetic (checked). test_hopper_flash_attention_lowers lowers it with the
# soft cap at D = 128, which adds the same ops, of the same types, to both, and with causal at
# D = 64, which adds the same ops to both but for that arithmetic in the cleaning of edge tiles,
# lowered here by the masked walk at D = 128 (checked); a causal walk at D = 64 is also
# test_hopper_persistent_lowers_under_vmap's.
@pytest.mark.parametrize("d,overlap,opts", [
    (64, False, {}), (128, True, {}), (128, False, dict(causal=True, sliding_window=100))])
def test_hopper_persistent_lowers(d, overlap, opts):
    """`HopperAttnTiles(persistent=True)`: one CTA a multiprocessor walking the work tiles,
    ring slots and barrier phases running on across them, each consumer's next Q loaded after
    its last S, O through a buffer of its own, stores waited for only before that buffer is
    rewritten; three consumers (D = 64), the overlap, and masks (persistence forced)."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    q = jnp.zeros((2, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((2, 384, 2, d), jnp.bfloat16)
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(d), persistent=True,
                                overlap=overlap, backward=False)
    module = _lower(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module


@pytest.mark.parametrize("vmapped", [False, True])
def test_hopper_split_tail_lowers(vmapped, monkeypatch):
    """`HopperAttnTiles(split_tail=True)`: 134 work tiles of two 128-key blocks (67 heads)
    over the abstract H100's 132 CTAs: one round, then the last 2 tiles split in two parts
    each (item codes past the tiles, a parts table read in the kernel, the parts' (o, lse)
    as two more outputs, merged by XLA after it); under jax.vmap too."""
    from jaxfuse.pallas import _common
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    monkeypatch.setattr(_common, "num_multiprocessors", lambda: 132)   # a CPU host has 1
    q = jnp.zeros((3,) * vmapped + (1, 256, 67, 128), jnp.bfloat16)
    tiles = HopperAttnTiles(persistent=True, split_tail=True, backward=False)
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles))
    module = _lower(jax.vmap(f) if vmapped else f, q, q, q).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    assert "scatter" in module      # the parts' merge


def test_hopper_persistent_lowers_under_vmap():
    """The persistent forward's schedule operand (a table made under a nested jit,
    `_hopper.constant`) under jax.vmap, which batches the kernel and leaves the table whole."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    q = jnp.zeros((3, 1, 256, 4, 64), jnp.bfloat16)
    tiles = HopperAttnTiles(persistent=True, backward=False)
    module = _lower(jax.vmap(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, causal=True, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles))),
        q, q, q).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module


# Every pair of the three settings once (4 of the 8 combinations; the mask causal, or the window
# with the cap, the latter being test_hopper_overlap_lowers' D = 128 case of turns): a mask adds
# the same ops, of the same types, to the kernel with either kind of barrier (checked; not so
# with and without the overlap, so each of those with and without a mask), and named barriers
# without the overlap with causal is the default forward, lowered by test_hopper_fused_dq_lowers.
@pytest.mark.parametrize("opts,overlap,named", [
    ({}, False, True), (_WINDOW_CAP, True, True), (_CAUSAL, False, False), ({}, True, False)])
def test_hopper_named_pingpong_lowers(opts, overlap, named, monkeypatch):
    """The forward's consumers taking turns on hardware named barriers (the default,
    `attention_hopper._NAMED_PINGPONG`: `bar.sync` / `bar.arrive` inlined through
    `plgpu.inline_mgpu`), the ping-pong's rendezvous and the overlap's turn passing,
    persistent and not; and on mbarriers (the diagnostic), with no named barrier."""
    from jaxfuse.pallas import _hopper_ring as R
    from jaxfuse.pallas import attention_hopper as AH
    monkeypatch.setattr(AH, "_NAMED_PINGPONG", named)
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, 128), jnp.bfloat16)
    module = _lower(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(
            hopper=AH.HopperAttnTiles(overlap=overlap, backward=False)), **opts),
        q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    ids = (R._PINGPONG_BARRIER_ID,) + ((R._PINGPONG_BARRIER_ID + 1,) if overlap else ())
    for i in ids:
        assert (f"bar.sync {i}, 256" in module) == named, i
    assert ("bar.arrive" in module) == (overlap and named)


# The default (the dK/dV kernel's overlapped steps) is lowered with every mask set by
# test_hopper_flash_attention_lowers; here the plain steps, masked at D = 128 and capped at 64.
@pytest.mark.parametrize("d,opts", [(128, dict(causal=True, sliding_window=200)),
                                    (64, _WINDOW_CAP)])
def test_hopper_dkv_plain_steps_lower(d, opts):
    """`HopperBwdTiles(dkv_overlap=False)`: the dK/dV kernel's plain steps (each product
    waited for in turn) beside the default overlapped ones (S^T and dP^T issued together,
    S^T read with `wgmma_accumulator_load(wait_n=1)` while dP^T runs, P^T and dS^T as
    register operands issued between the reads); masked and unmasked steps, the soft
    cap."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(backward=HopperBwdTiles(dkv_overlap=False))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    for name in _HOPPER_BWD[True]:
        assert name in module, name


@pytest.mark.parametrize("d,det,extra", [(64, True, {}), (64, False, {}),
                                         (64, True, dict(fixed_dq=True))])
def test_hopper_kv_regs_lowers(d, det, extra):
    """`HopperBwdTiles(kv_regs=True)` (the default at D = 64): K and V loaded from their
    swizzled tiles into registers in the wgmma layout, then the A operands of S^T and dP^T
    (with B read transposed): the pair's dK/dV kernel, the float32 and fixed-point fused
    dQ."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(backward=HopperBwdTiles(kv_regs=True, **extra))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, causal=True, deterministic=det,
        block_sizes=jaxfuse.AttnBlocks(hopper=tiles)), q, k, k).mlir_module()
    # The pair's dK/dV body runs in the one launch of GQA; the fused dQ's kernels otherwise.
    want = _ONE if det and not extra else _FIXED if det else _HOPPER_BWD[False]
    assert want[0] in module


@pytest.mark.parametrize("shape", [(33, 1000), (4, 70000)])
def test_dropout_kernels_lower(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    b = jnp.zeros(shape[-1:], jnp.bfloat16)
    key = jax.random.key(0)
    kw = dict(interpret=False, rate=0.1, key=key)
    _fwd_bwd(lambda x: jaxfuse.dropout(x, 0.1, key, interpret=False), x)
    _fwd_bwd(lambda x, b, r: jaxfuse.bias_dropout_add(x, b, r, **kw), x, b, x)
    # Each activation adds the same ops (on tiles of their shape) to the kernels of one tile as
    # to those of column tiles (checked): all four on one tile, the default on the long rows.
    for act in ("gelu", "gelu_tanh", "relu", "silu") if shape == (33, 1000) else ("gelu",):
        _fwd_bwd(lambda x, b: jaxfuse.bias_act_dropout(x, b, activation=act, **kw), x, b)


@pytest.mark.parametrize("shape", [(33, 1000), (4, 70000)])
def test_add_norm_lowers(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    w = jnp.zeros(shape[-1:], jnp.bfloat16)
    key = jax.random.key(0)
    _fwd_bwd(lambda x, r, w: jaxfuse.add_norm(x, r, w, rate=0.1, key=key, interpret=False),
             x, x, w)
    _fwd_bwd(lambda x, r, w: jaxfuse.add_norm(x, r, w, w, norm="layer", interpret=False), x, x, w)


def test_cross_entropy_inner_tiles_lower():
    # Rows of 1024 columns in tiles of 256: three inner tiles loaded without column masks, the
    # 33 rows in blocks of 2 (the last block hangs over: the inner tiles mask rows only).
    x = jnp.zeros((33, 1024), jnp.bfloat16)
    labels = jnp.zeros((33,), jnp.int32)
    blocks = jaxfuse.RowBlocks(2, 256)
    _fwd_bwd(lambda x: jaxfuse.cross_entropy(x, labels, interpret=False, block_sizes=blocks), x)


@pytest.mark.parametrize("shape,blocks", [((33, 1024), (2, 256)), ((33, 1000), (2, 256)),
                                          ((5, 32768), None), ((3, 70000), None),
                                          ((33, 1000), None), ((5, 1024), None)])
def test_cross_entropy_loss_and_grad_lowers(shape, blocks):
    # The linear + cross-entropy slabs' one kernel: whole inner tiles walked twice (the second
    # walk backwards), a ragged last tile, and (default tiles up to 16384 columns) a row of one
    # tile, ragged or whole, emitted from its registers; dz asked to alias the logits.
    from jaxfuse.pallas import cross_entropy as pce
    st = pce.static(shape, label_smoothing=0.1, ignore_index=-100, interpret=False,
                    block_sizes=blocks and jaxfuse.RowBlocks(*blocks))
    labels = jnp.zeros(shape[:1], jnp.int32)
    exp = _lower(lambda x: pce.loss_and_grad(x, labels, st), jnp.zeros(shape, jnp.bfloat16))
    module = exp.mlir_module()
    assert "jaxfuse_cross_entropy_loss_grad" in module
    assert "output_operand_alias" in module


@pytest.mark.parametrize("interleaved", [True, False])
def test_swiglu_and_rope_lower(interleaved):
    x = jnp.zeros((33, 1000), jnp.bfloat16)
    if interleaved:   # swiglu has no such option: its kernels once
        _fwd_bwd(lambda g, u: jaxfuse.swiglu(g, u, interpret=False), x, x)
    # Tiles that fit exactly (no masks), a token tail, and 3 heads of D = 6 (masked pair tiles);
    # 16-bit interleaved pairs are loaded as 32-bit words, float32 ones at a stride.
    for shape, dtype in (((2, 64, 4, 128), jnp.bfloat16), ((2, 100, 4, 128), jnp.bfloat16),
                         ((1, 7, 3, 6), jnp.bfloat16), ((2, 100, 4, 128), jnp.float16),
                         ((1, 7, 3, 6), jnp.float32)):
        q = jnp.zeros(shape, dtype)
        pos = jnp.zeros(shape[:2], jnp.int32)
        _fwd_bwd(lambda q: jaxfuse.rope(q, pos, interleaved=interleaved, interpret=False), q)
    # positions wider than int32 reach the kernels as float32 (`rope.kernel_positions`)
    pos = jnp.zeros((2, 100), jnp.uint32)
    _fwd_bwd(lambda q: jaxfuse.rope(q, pos, interleaved=interleaved, interpret=False),
             jnp.zeros((2, 100, 4, 128), jnp.bfloat16))
    # rope_qkv: the models' grouped projection (G = 4, whole tiles) and G = 3 with a token tail
    # and D = 6 (masked slot, token and pair tiles), 16-bit words and float32 strides.
    for shape, dtype in (((2, 64, 8, 6, 64), jnp.bfloat16), ((1, 7, 3, 5, 6), jnp.bfloat16),
                         ((1, 7, 2, 5, 6), jnp.float32)):
        pos = jnp.zeros(shape[:2], jnp.int32)
        _fwd_bwd(lambda x: jaxfuse.rope_qkv(x, pos, interleaved=interleaved, interpret=False),
                 jnp.zeros(shape, dtype))


@pytest.mark.parametrize("shape", [(33, 1000), (4, 70000)])
def test_fused_projections_lower(shape):
    # The backward kernels that rebuild swiglu's product and add_norm's y (one tile and column
    # tiles), LayerNorm with bias and dropout.
    x = jnp.zeros(shape, jnp.bfloat16)
    w = jnp.zeros(shape[-1:], jnp.bfloat16)
    p = jnp.zeros((shape[-1], 16), jnp.bfloat16)
    kw = dict(interpret=False)
    _fwd_bwd(lambda g, u, p: jaxfuse.swiglu_linear(g, u, p, **kw), x, x, p)
    _fwd_bwd(lambda x, r, w, p: jaxfuse.add_norm_linear(x, r, w, projections=(p, p), **kw),
             x, x, w, p)
    _fwd_bwd(lambda x, r, w, p: jaxfuse.add_norm_linear(
        x, r, w, w, projections=(p,), norm="layer", rate=0.1, key=jax.random.key(0), **kw),
        x, x, w, p)


def test_hopper_swiglu_lowers():
    """The Mosaic GPU SwiGLU kernels (TMA tiles in and out, one warpgroup per CTA) lower for
    sm90, forward and the backward that rebuilds the product."""
    x = jnp.zeros((64, 512), jnp.bfloat16)
    p = jnp.zeros((512, 16), jnp.bfloat16)
    blocks = jaxfuse.RowBlocks(8, 512, hopper=True)
    module = _fwd_bwd(lambda g, u, p: jaxfuse.swiglu_linear(g, u, p, interpret=False,
                                                            block_sizes=blocks),
                      x, x, p).mlir_module()
    for name in ("jaxfuse_swiglu_fwd_hopper", "jaxfuse_swiglu_bwd_hopper"):
        assert name in module


# blocks: the rule's (one token a program), and 4 tokens a program, each row's gather issued
# before the row before it is written (with the position table's: both tables prefetched).
@pytest.mark.parametrize("with_pos,blocks", [(False, None), (True, None),
                                             (True, jaxfuse.RowBlocks(4, 256, 4))])
def test_embedding_lowers(with_pos, blocks):
    table = jnp.zeros((1000, 256), jnp.bfloat16)
    tokens = jnp.zeros((4, 100), jnp.int32)
    pos_table = jnp.zeros((128, 256), jnp.bfloat16) if with_pos else None
    key = jax.random.key(0)
    _fwd_bwd(lambda t: jaxfuse.embedding(tokens, t, scale=2.0, pos_table=pos_table, rate=0.1,
                                         key=key, interpret=False, block_sizes=blocks), table)


@pytest.mark.parametrize("hkv", [4, 1])
def test_flash_attention_dropout_lowers(hkv):
    q = jnp.zeros((2, 100, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 100, hkv, 64), jnp.bfloat16)
    key = jax.random.key(0)
    _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, dropout_rate=0.1,
                                                     dropout_key=key, interpret=False), q, k, k)


def test_model_lowers(monkeypatch):
    """The whole model (bf16, scanned and rematerialized layers, fused loss; greedy and beam
    decoding over the bf16 cache) lowers for the GPU."""
    from jaxfuse import model as M
    monkeypatch.setenv("JAXFUSE_INTERPRET", "0")
    cfg = M.Config(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                   max_len=48, dtype="bfloat16", remat="block")
    # The lowering needs the parameters' shapes and dtypes only (the same kernels, checked):
    # M.init run eagerly compiled op by op, a third of this test's time.
    params = jax.eval_shape(lambda key: M.init(key, cfg), jax.random.key(0))
    tokens = jnp.zeros((2, 40), jnp.int32)
    _lower(jax.value_and_grad(lambda p, t: M.loss(p, t, t, cfg)), params, tokens)
    lengths = jnp.full((2,), 40, jnp.int32)
    _lower(lambda p, t: M.greedy(p, cfg, t, lengths, max_new_tokens=4, eos_id=1), params, tokens)
    _lower(lambda p, t: M.beam_search(p, cfg, t, lengths, beam_size=2, max_new_tokens=4,
                                      eos_id=1), params, tokens)


def test_reorder_beams_lowers():
    caches = (jnp.zeros((3, 4, 100, 4, 64), jnp.bfloat16), jnp.zeros((3, 4, 100, 5), jnp.float32))
    parent = jnp.zeros((3, 4), jnp.int32)
    n = jnp.zeros((3,), jnp.int32)
    _lower(lambda c, p, a, z: jaxfuse.reorder_beams(c, p, a, z, interpret=False),
           caches, parent, n, n)


# The window with the cap adds the same ops, of the same types, to the fused kernel (and to the
# forward) at D = 128 as at D = 64 (checked), where test_hopper_flash_attention_lowers lowers
# them with both mask sets (deterministic=False): here causal alone. The default forward at
# D = 64 with causal is lowered there too, so the first D = 64 case (block_q=128) runs a
# variant of test_hopper_overlap_lowers instead (the overlap with 2 consumers taking turns on
# a 2-slot ring): a kernel of its own in the same lowering, the backward's kernel unchanged
# (checked).
@pytest.mark.parametrize("d,opts,bwd,fwd", [
    (128, dict(causal=True), dict(block_q=64), {}),
    (64, dict(causal=True), dict(block_q=128),
     dict(overlap=True, consumers=2, stages=2, pingpong=True)),
    (128, dict(causal=True), dict(dkv_overlap=False), {}),
    (64, dict(causal=True), dict(dkv_overlap=False), {})])
def test_hopper_fused_dq_lowers(d, opts, bwd, fwd):
    """`HopperBwdTiles(fused_dq=True)` forces the fused dQ at D = 128 (by default the separate
    dQ kernel runs there, deterministic=False or not), with a mask (see above); at D = 64 with
    128-row query steps its shared memory (the [4, 64, 128] dS^T buffer) still fits: the
    lowering checks the kernel's shared-memory total. By default the fused kernel's steps
    are overlapped (dS^T written to shared memory while dV's product runs);
    `dkv_overlap=False`, its plain steps, at D = 128 and at 64."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(backward=HopperBwdTiles(fused_dq=True, **bwd), **fwd)
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, deterministic=False,
        block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts), q, k, k).mlir_module()
    assert "jaxfuse_flash_fwd_hopper" in module
    assert "jaxfuse_flash_bwd_dkv_dq_hopper" in module
    assert "jaxfuse_flash_bwd_dq_hopper" not in module


def test_hopper_d256_variants_lower():
    """At D = 256 (the defaults are lowered by test_hopper_flash_attention_lowers):
    `HopperBwdTiles(exchange=False)`, the dK/dV consumers each forming the whole S^T and dP^T
    of 32-row steps and keeping P^T and dS^T in registers; `overlap=True`, the dQ kernel's
    overlapped schedule on a three-slot ring that fills shared memory to within 1 KiB of the
    227 KiB (the lowering checks the size; the buffer the interpreter keeps dQ in must not be
    allocated on the GPU); with masks and soft caps. `exchange` is the dK/dV kernel's setting
    and `overlap` the dQ kernel's, so one lowering takes both: each kernel is the one its
    setting gives alone, but for constants (checked). The window with the cap and causal
    differ by the same ops, of the same types, in these kernels as in the defaults (checked),
    which test_hopper_flash_attention_lowers lowers with causal: so one mask set here."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    opts = dict(sliding_window=200, logits_soft_cap=30.0)
    q = jnp.zeros((1, 256, 4, 256), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, 256), jnp.bfloat16)
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(256),
                                backward=HopperBwdTiles(exchange=False, overlap=True))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles), **opts),
        q, k, k).mlir_module()
    assert _ONE[0] in module          # both kernels' bodies, in the one launch of GQA


def test_hopper_dq_ring_counts_the_segment_ids():
    """The dQ kernel's third ring slot (D = 256 with the overlap forced) is taken only where
    it fits: with segment ids and no cleaning, their two 1 KiB buffers leave no room for it
    (3 slots asked 233,616 bytes of the 232,448 before `dq_stages` counted them)."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
    qs = jnp.zeros((1, 256), jnp.int32)
    bwd = HopperBwdTiles(overlap=True, clean=False)
    assert bwd.dq_stages(256, 2) == 3          # where the slot fits, it is still taken
    assert HopperBwdTiles(stages=3, overlap=True, clean=False).dq_stages(256, 2) == 3  # asked
    hopper = dataclasses.replace(HopperAttnTiles.for_head_dim(256), backward=bwd)
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, q_segment_ids=qs, kv_segment_ids=qs, interpret=False,
        block_sizes=jaxfuse.AttnBlocks(hopper=hopper)), q, q, q).mlir_module()
    assert "jaxfuse_flash_bwd_dq_hopper" in module


def test_hopper_tiles_at_the_edge_of_shared_memory_lower():
    """Tiles the plan now takes where it once lowered a kernel past the 227 KiB: three
    consumers with the overlap at D = 128 (persistent by default before, with a one-slot ring
    the overlap cannot run: now a CTA a tile, two slots) and 128-row dK/dV steps at D = 128
    (two slots)."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    tiles = HopperAttnTiles(consumers=3, overlap=True, backward=HopperBwdTiles(block_q=128))
    module = _fwd_bwd(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, causal=True, interpret=False, block_sizes=jaxfuse.AttnBlocks(hopper=tiles)),
        q, q, q).mlir_module()
    for name in ("jaxfuse_flash_fwd_hopper",) + _TWO:      # no GQA: two launches
        assert name in module, name
