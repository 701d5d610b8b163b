"""Session s31's changes on the GPU's jax (0.11.2): the ops' option checks and the model's
input checks on the compiled path, one device. Prints one line per check."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse import model as M

print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
q = jax.random.normal(jax.random.key(0), (2, 256, 4, 128), jnp.bfloat16)
a = jaxfuse.flash_attention(q, q, q, causal=jnp.array(True), scale=jnp.float32(0.1))
b = jaxfuse.flash_attention(q, q, q, causal=True, scale=0.1)
print("flash jax-scalar options equal:", bool(jnp.array_equal(a, b)), flush=True)
c = jaxfuse.flash_attention(q, q, q, causal=True, sliding_window=2 ** 31 - 1)
d = jaxfuse.flash_attention(q, q, q, causal=True)
print("huge window == none:", bool(jnp.array_equal(c, d)), flush=True)
cfg = M.Config(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512,
               max_len=64, dtype="bfloat16")
p = M.init(jax.random.key(1), cfg)
tok = jax.random.randint(jax.random.key(2), (4, 32), 0, 512)
loss = jax.jit(M.loss, static_argnames="cfg")(p, tok, jnp.roll(tok, -1, 1), cfg=cfg)
print("model loss finite:", bool(np.isfinite(float(loss))), float(loss), flush=True)
g = M.greedy(p, cfg, tok[:, :8], jnp.array([8, 3, 5, 1]), max_new_tokens=8, eos_id=0)
print("greedy shape:", g.shape, flush=True)
try:
    M.loss(p, tok, jnp.roll(tok, -1, 1).at[0, 0].set(512), cfg)
    print("bad target: NOT refused", flush=True)
except ValueError as e:
    print("bad target refused:", str(e)[:60], flush=True)
