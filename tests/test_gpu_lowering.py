"""Every kernel lowers to Triton for an NVIDIA GPU, checked on a CPU.

`jax.export` with platforms=["cuda"] runs the Pallas -> Triton lowering without a GPU, so bugs
that only the GPU path has (Triton's power-of-two tiles, one indexer per load, scalar types)
fail here, in CI, instead of on the benchmark machine. Compiling and running stay GPU-only
(benchmarks/gpu_check.py).
"""
import jax
import jax.numpy as jnp
import pytest
from jax import export

import jaxfuse


def _lower(f, *args):
    try:
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
def test_decode_attention_lowers(hq, hkv):
    q = jnp.zeros((3, hq, 128), jnp.bfloat16)
    kc = jnp.zeros((3, 1000, hkv, 128), jnp.bfloat16)
    lens = jnp.array([0, 10, 1000], jnp.int32)
    _lower(lambda q, kc, lens: jaxfuse.decode_attention(q, kc, kc, lens, interpret=False,
                                                        num_splits=3), q, kc, lens)


@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-4, logits_soft_cap=30.0)])
def test_linear_cross_entropy_lowers(opts):
    x = jnp.zeros((300, 256), jnp.bfloat16)
    w = jnp.zeros((256, 5000), jnp.bfloat16)
    labels = jnp.zeros((300,), jnp.int32)
    _fwd_bwd(lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, interpret=False, **opts), x, w)


def test_beam_top_k_lowers():
    lp = jnp.zeros((2, 4, 1000), jnp.float32)
    _lower(lambda lp, s: jaxfuse.beam_top_k(lp, s, 4, interpret=False), lp, jnp.zeros((2, 4)))


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
    module = _fwd_bwd(lambda x, w: f(x, w, labels), x, w).mlir_module()
    for name in ("jaxfuse_linear_cross_entropy_fwd_hopper", "jaxfuse_lce_bwd_dz",
                 "jaxfuse_lce_bwd_dx", "jaxfuse_lce_bwd_dw"):
        assert name in module


def test_model_lowers(monkeypatch):
    """The whole model (bf16, scanned and rematerialized layers, fused loss; greedy and beam
    decoding over the bf16 cache) lowers for the GPU."""
    from jaxfuse import model as M
    monkeypatch.setenv("JAXFUSE_INTERPRET", "0")
    cfg = M.Config(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                   max_len=48, dtype="bfloat16", remat="block")
    params = M.init(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 40), jnp.int32)
    _lower(jax.value_and_grad(lambda p, t: M.loss(p, t, t, cfg)), params, tokens)
    lengths = jnp.full((2,), 40, jnp.int32)
    _lower(lambda p, t: M.greedy(p, cfg, t, lengths, max_new_tokens=4, eos_id=1), params, tokens)
    _lower(lambda p, t: M.beam_search(p, cfg, t, lengths, beam_size=2, max_new_tokens=4,
                                      eos_id=1), params, tokens)
