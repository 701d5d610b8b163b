import jax
import pytest

from jaxfuse.pallas import _common


def test_interpret_resolution(monkeypatch):
    monkeypatch.delenv("JAXFUSE_INTERPRET", raising=False)
    assert _common.resolve_interpret(None) == (jax.default_backend() == "cpu")
    assert _common.resolve_interpret(True) is True
    assert _common.resolve_interpret(False) is False
    monkeypatch.setenv("JAXFUSE_INTERPRET", "0")
    assert _common.resolve_interpret(None) is False
    monkeypatch.setenv("JAXFUSE_INTERPRET", "1")
    assert _common.resolve_interpret(None) is True
    assert _common.resolve_interpret(False) is False  # an explicit flag wins
    monkeypatch.setenv("JAXFUSE_INTERPRET", "yes")
    with pytest.raises(ValueError, match="JAXFUSE_INTERPRET='yes'"):
        _common.resolve_interpret(None)


def test_keep_mask_bottom_right():
    import jax.numpy as jnp
    q = jnp.arange(3)[:, None]
    k = jnp.arange(5)[None, :]
    keep = _common.keep_mask(q, k, n_q=3, n_k=5, causal=True, window=2)
    # query i sees keys i+1 and i+2 (shift 2, window 2).
    assert keep.astype(int).tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
