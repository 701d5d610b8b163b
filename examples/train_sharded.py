"""Train LikesWorld (the main job, `examples/likesworld.py`) on a device mesh: data, FSDP,
tensor and sequence parallel through `jaxfuse.model.sharding`, and print the same accuracy line.

    python examples/train_sharded.py --mesh data=2,tensor=4          # 8 devices

Mesh axes: data, fsdp, tensor, seq (`jaxfuse.model.sharding`); their product is the number of
devices. Without enough accelerators it runs on virtual CPU devices: XLA reads their count when
jax starts, so this script sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` before
importing jax (N = the mesh's size, or --cpu-devices N). On a GPU host that flag is harmless
(it only concerns the CPU platform); force CPUs there with JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time


def parse_mesh(text: str) -> dict[str, int]:
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh {text!r}: write axis=size pairs, e.g. data=2,tensor=4")
        axes[name.strip()] = int(size)
    return axes


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="data=2,tensor=4",
                    help="axis=size pairs over data, fsdp, tensor, seq (default data=2,tensor=4)")
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="virtual CPU devices (default: the mesh's size)")
    ap.add_argument("--axis-types", default="explicit", choices=["explicit", "auto"],
                    help="the mesh's axis types (default explicit, jax.make_mesh's own)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--impl", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    axes = parse_mesh(args.mesh)
    n_devices = math.prod(axes.values())

    if "jax" not in sys.modules:      # before jax starts: how many CPU devices it creates
        flag = "--xla_force_host_platform_device_count"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + f" {flag}={args.cpu_devices or n_devices}").strip()

    import jax
    import numpy as np
    from jax.sharding import AxisType

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from likesworld import accuracy, make_targets, random_baseline
    from likesworld_data import World

    from jaxfuse import model as M

    if jax.device_count() < n_devices:
        raise SystemExit(f"--mesh {args.mesh} needs {n_devices} devices, jax has "
                         f"{jax.device_count()} ({jax.default_backend()}): on a CPU pass "
                         f"--cpu-devices {n_devices} (with JAX_PLATFORMS=cpu on a GPU host)")
    names = tuple(axes)
    kind = AxisType.Explicit if args.axis_types == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(tuple(axes.values()), names, axis_types=(kind,) * len(names),
                         devices=jax.devices()[:n_devices])

    world, test_world = World(n_facts=4, n_questions=2), World(n_facts=4, n_questions=2)
    # sequence parallel: causal ring attention needs T % (2 x seq) == 0; pad the episodes'
    # ends (pad tokens, no targets: causal attention keeps them out of every real position)
    chunk = 2 * axes.get("seq", 1)
    seq_len = -(-world.seq_len // chunk) * chunk
    cfg = M.preset("likesworld", max_len=seq_len + 8)
    params = M.init(jax.random.key(args.seed), cfg)
    opt = M.optimizer(args.lr, args.steps, warmup_steps=100, weight_decay=0.01)
    step = M.sharded_train_step(cfg, opt, mesh, impl=args.impl, batch=args.batch,
                                seq_len=seq_len)
    params, opt_state = M.sharding.shard_train_state(params, opt.init(params), cfg, opt, mesh)
    print(f"LikesWorld on mesh {dict(mesh.shape)} ({n_devices} {jax.default_backend()} "
          f"devices), jax {jax.__version__}, impl={args.impl}")
    rng = np.random.default_rng(args.seed)
    test_rng = np.random.default_rng(10_000 + args.seed)
    test = test_world.sample(test_rng, 1000)

    t0 = time.time()
    for i in range(1, args.steps + 1):
        tokens, targets = make_targets(*world.sample(rng, args.batch))
        pad = ((0, 0), (0, seq_len - tokens.shape[1]))
        batch = M.sharding.shard_batch((np.pad(tokens, pad, constant_values=world.tok("<pad>")),
                                        np.pad(targets, pad, constant_values=-100)), mesh)
        params, opt_state, loss = step(params, opt_state, *batch)
        if i % 250 == 0 or i == args.steps:
            print(f"step {i:5d}  loss {float(loss):.3f}  ({time.time() - t0:.0f}s)", flush=True)
    print(f"trained {args.steps} steps in {time.time() - t0:.0f}s")

    with jax.set_mesh(mesh):
        acc = accuracy(params, cfg, *test, impl=args.impl)
    base = random_baseline(test_world, test_rng, test[0], test[2])
    print(f"held-out answer accuracy {acc:.3f}; random item from the context {base:.3f}")
    print(f"test_accuracy={acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
