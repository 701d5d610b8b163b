"""Train the tiny jaxfuse Transformer on LikesWorld, on a CPU, with the Pallas kernels in
interpret mode; then probe it (head ablations, attention maps) and decode with greedy and beam
search. The package's main job:

    python examples/likesworld.py            # 1-2 minutes on 2 CPU cores

Episodes (lecture 5, sec. 2.2):

    <bos> eve likes tea . dan likes jam . hal likes figs . gus likes plums . q dan jam . q gus plums . <eos>

A 2-layer, 4-head model of about 85K parameters (d_model 64, d_ff 128, RoPE, SwiGLU, RMSNorm)
must learn a two-step lookup: each item learns its owner (the name two tokens back, a layer-0
head), then the asked name finds the item that learned it (a layer-1 head). Until it does,
accuracy sits on the plateau of "some item from the context" (1/4).

The recipe, and what was measured finding it (2-core CPU, jax 0.10.2, plain-XLA model, batch 64,
loss on answers only, AdamW, 100 warmup steps then cosine):
- Initialization decides it. With token embeddings ~ N(0, 1) (what `jaxfuse.model.init` does)
  held-out accuracy crossed from the plateau to 97-100% by step 500 in each of 4 seeds (1,500
  steps: 37 s); with GPT-2's N(0, 0.02) embeddings the same run sat at 27-30% through step
  1,500, the plateau the issue's calibration reports for 4,500 steps. RMSNorm makes the block
  inputs scale-free, so a tiny embedding mostly shrinks the residual stream against what the
  blocks add, and the two-step circuit starts from almost nothing.
- Loss on the answers only: with the loss on every next token the run stayed at 10-32% through
  step 1,500 (the unpredictable names and items dominate the gradient).
- Learning rate 1e-3 and 3e-3 both crossed by step 500 with this initialization.
- Asking all 4 facts (4 questions) also works but lets the last answer be found by elimination;
  training on 2 questions keeps the task honest, and the test set always has 2.
With the Pallas kernels in interpret mode a step takes about 36 ms (25 ms with impl="reference"),
so the default 1,500 steps train in about a minute; the whole script ran in 83 s on 2 cores and
reached 100% held-out accuracy (random item from the context: 24%).

What the trained model does (seed 0, ablating one head at a time on 1,000 held-out episodes):
zeroing layer 1 head 2 drops accuracy to 22%, the plateau: it is the lookup head, whose query at
`q NAME` lands on the item that NAME likes. Layer 0 heads 0 and 3 cost 22 and 17 points each:
they share the "item remembers its owner" job (at `jam` they attend to the name two tokens back).
The other heads cost 0-2 points. The lecture's model split the work the other way round (one
layer-0 head essential, two layer-1 heads); the two-step circuit is the same.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxfuse import model as M  # noqa: E402
from likesworld_data import World  # noqa: E402


DEFAULT_STEPS = 1500
DEFAULT_BATCH = 64
DEFAULT_LR = 1e-3
DEFAULT_QUESTIONS = 2


def make_targets(tokens, positions, answers):
    """Loss on the answers only: the target at the position of `NAME` in `q NAME` is its item."""
    targets = np.full_like(tokens, -100)
    np.put_along_axis(targets, positions, answers, axis=1)
    return jnp.asarray(tokens), jnp.asarray(targets)


# One compiled forward for every accuracy evaluation (the ablations call it once per head).
_apply = jax.jit(M.apply, static_argnames=("cfg", "impl"))


def accuracy(params, cfg, tokens, positions, answers, *, impl, head_mask=None):
    logits = _apply(params, jnp.asarray(tokens), cfg, impl=impl, head_mask=head_mask)
    picked = jnp.take_along_axis(logits, jnp.asarray(positions)[..., None], axis=1)
    return float(jnp.mean(jnp.argmax(picked, -1) == jnp.asarray(answers)))


def random_baseline(world, rng, tokens, answers) -> float:
    """Accuracy of answering with a random item from the episode's context."""
    items = world.context_items(tokens)
    guess = items[np.arange(len(items))[:, None], rng.integers(0, items.shape[1], answers.shape)]
    return float(np.mean(guess == answers))


def save_checkpoint(params, path: str) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


def ablation_table(params, cfg, test, impl):
    full = accuracy(params, cfg, *test, impl=impl)
    rows = []
    for layer in range(cfg.n_layers):
        for head in range(cfg.n_heads):
            mask = jnp.ones((cfg.n_layers, cfg.n_heads)).at[layer, head].set(0.0)
            rows.append((layer, head, accuracy(params, cfg, *test, impl=impl, head_mask=mask)))
    return full, rows


def plot_heads(params, cfg, world, tokens, heads, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: `pip install -e .[plot]` for the attention PNG)")
        return
    maps = np.asarray(M.attention_maps(params, jnp.asarray(tokens[:1]), cfg))   # [L, 1, H, T, T]
    words = world.decode(tokens[0]).split()
    fig, axes = plt.subplots(1, len(heads), figsize=(5.5 * len(heads), 5.5), squeeze=False)
    for ax, (layer, head) in zip(axes[0], heads):
        ax.imshow(maps[layer, 0, head], cmap="Blues", vmin=0, vmax=1)
        ax.set_title(f"layer {layer} head {head}")
        ax.set_xticks(range(len(words)), words, rotation=90, fontsize=6)
        ax.set_yticks(range(len(words)), words, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"attention maps of the heads that matter: {path}")


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS)
    ap.add_argument("--impl", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="checkpoints")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip ablations, plot and decoding (for quick runs)")
    args = ap.parse_args(argv)

    world = World(n_facts=4, n_questions=args.questions)
    test_world = World(n_facts=4, n_questions=2)
    cfg = M.preset("likesworld", max_len=world.seq_len + 8)
    params = M.init(jax.random.key(args.seed), cfg)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"LikesWorld: {n_params:,} parameters, jax {jax.__version__} on "
          f"{jax.default_backend()}, impl={args.impl}")
    opt = M.optimizer(args.lr, args.steps, warmup_steps=100, weight_decay=0.01)
    opt_state = opt.init(params)
    rng = np.random.default_rng(args.seed)
    test_rng = np.random.default_rng(10_000 + args.seed)   # held-out episodes
    test = test_world.sample(test_rng, 1000)

    t0 = time.time()
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", mininterval=1.0)
    for step in bar:
        tokens, targets = make_targets(*world.sample(rng, args.batch))
        params, opt_state, loss = M.train_step(params, opt_state, tokens, targets, cfg=cfg,
                                               opt=opt, impl=args.impl)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
    print(f"trained {args.steps} steps in {time.time() - t0:.0f}s")

    acc = accuracy(params, cfg, *test, impl=args.impl)
    base = random_baseline(test_world, test_rng, test[0], test[2])
    print(f"held-out answer accuracy {acc:.3f}; random item from the context {base:.3f}")
    path = os.path.join(args.out, "likesworld.npz")
    save_checkpoint(params, path)
    print(f"checkpoint: {path}")

    if not args.no_extras:
        full, rows = ablation_table(params, cfg, test, args.impl)
        print("\nablation: accuracy with one head's output zeroed")
        print("layer head accuracy  drop")
        for layer, head, a in rows:
            print(f"{layer:5d} {head:4d} {a:8.3f} {full - a:+.3f}")
        matter = [(layer, head) for layer, head, a in rows if full - a > 0.05]
        if matter:
            plot_heads(params, cfg, test_world, test[0], matter,
                       os.path.join(args.out, "likesworld_heads.png"))
        decode_examples(params, cfg, test_world, test, args.impl)
    print(f"test_accuracy={acc:.3f}")
    return acc


def decode_examples(params, cfg, world, test, impl, n=4):
    """Prompts cut right after the first `q NAME`: greedy decoding and a 3-beam search of the
    answer (the model was trained on answers only, so one new token is the meaningful part)."""
    tokens, positions, answers = test
    lengths = positions[:n, 0] + 1
    prompts = np.zeros((n, tokens.shape[1]), np.int32)
    for i in range(n):
        prompts[i, :lengths[i]] = tokens[i, :lengths[i]]
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths, jnp.int32)
    eos = world.tok("<eos>")
    greedy = M.greedy(params, cfg, prompts, lengths, max_new_tokens=1, eos_id=eos, impl=impl)
    beams, scores = M.beam_search(params, cfg, prompts, lengths, beam_size=3, max_new_tokens=1,
                                  eos_id=eos, impl=impl)
    print("\ndecoding: prompt (end) -> truth | greedy | 3 beams with probabilities")
    for i in range(n):
        tail = world.decode(np.asarray(prompts[i, lengths[i] - 6:lengths[i]]))
        beam_txt = ", ".join(f"{world.decode(beams[i, j])} {float(jnp.exp(scores[i, j])):.3f}"
                             for j in range(3))
        print(f"  ... {tail} -> {world.vocab[int(answers[i, 0])]} | "
              f"{world.decode(greedy[i])} | {beam_txt}")


if __name__ == "__main__":
    main()
