"""Every op under jax.vmap (with jit and a gradient) equals the reference applied per example."""
import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from tests._util import assert_close, keys, randn


def _check(f, *args, grad_argnums=0):
    """vmap(f) with impl="pallas" vs "reference", values and gradients of their sum."""
    for fn in (lambda impl: jax.vmap(lambda *a: f(*a, impl=impl)),):
        out = jax.jit(fn("pallas"))(*args)
        ref = fn("reference")(*args)
        assert_close(out, ref, jnp.float32, scale=5.0)
        g = jax.grad(lambda *a: jnp.sum(fn("pallas")(*a)), argnums=grad_argnums)(*args)
        g_r = jax.grad(lambda *a: jnp.sum(fn("reference")(*a)), argnums=grad_argnums)(*args)
        assert_close(g, g_r, jnp.float32, scale=5.0)


def test_cross_entropy_vmap():
    k = keys(0, 2)
    labels = jax.random.randint(k[1], (3, 5), 0, 11)
    _check(lambda x, y, impl: jaxfuse.cross_entropy(x, y, label_smoothing=0.1, impl=impl),
           randn(k[0], (3, 5, 11)), labels)


def test_flash_attention_vmap():
    k = keys(1, 3)
    q, kk, v = randn(k[0], (2, 1, 9, 4, 8)), randn(k[1], (2, 1, 9, 2, 8)), randn(k[2], (2, 1, 9, 2, 8))
    _check(lambda q, kk, v, impl: jaxfuse.flash_attention(q, kk, v, causal=True, impl=impl),
           q, kk, v, grad_argnums=(0, 1, 2))


def test_decode_attention_vmap_and_no_gradient():
    k = keys(2, 3)
    q, kc = randn(k[0], (2, 3, 4, 8)), randn(k[1], (2, 3, 10, 2, 8))
    lengths = jnp.array([[0, 4, 10], [1, 9, 3]], jnp.int32)
    f = lambda impl: jax.vmap(lambda q, kc, n: jaxfuse.decode_attention(
        q, kc, kc, n, num_splits=2, impl=impl), in_axes=(0, 0, 0))
    assert_close(jax.jit(f("pallas"))(q, kc, lengths), f("reference")(q, kc, lengths),
                 jnp.float32)
    # An unbatched cache under a batched query is broadcast, not refused.
    g = jax.vmap(lambda q: jaxfuse.decode_attention(q, kc[0], kc[0], lengths[0]))(q)
    g_r = jax.vmap(lambda q: jaxfuse.decode_attention(q, kc[0], kc[0], lengths[0],
                                                      impl="reference"))(q)
    assert_close(g, g_r, jnp.float32)
    with pytest.raises(ValueError, match="decode_attention is for inference"):
        jax.grad(lambda q: jnp.sum(jaxfuse.decode_attention(q[0], kc[0], kc[0], lengths[0])))(q)


def test_linear_cross_entropy_vmap():
    k = keys(3, 3)
    labels = jax.random.randint(k[2], (2, 6), 0, 40)
    _check(lambda x, w, y, impl: jaxfuse.linear_cross_entropy(x, w, y, impl=impl),
           randn(k[0], (2, 6, 8)), randn(k[1], (2, 8, 40), scale=0.3), labels,
           grad_argnums=(0, 1))


def test_beam_top_k_vmap():
    k = keys(4, 2)
    lp, sc = randn(k[0], (2, 3, 4, 17)), randn(k[1], (2, 3, 4))
    out = jax.vmap(lambda a, b: jaxfuse.beam_top_k(a, b, 5))(lp, sc)
    ref = jax.vmap(lambda a, b: jaxfuse.beam_top_k(a, b, 5, impl="reference"))(lp, sc)
    for a, b in zip(out, ref):
        assert jnp.array_equal(a, b)
