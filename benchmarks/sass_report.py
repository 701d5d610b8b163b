"""Registers, spills, shared memory and instruction counts of compiled kernels, on a CPU.

`jax.export(..., platforms=["cuda"])` runs the Pallas -> Triton lowering without a GPU; this script
catches each kernel's Triton IR on the way, compiles it with the `triton` package for sm_90a and
runs its bundled ptxas and nvdisasm. No GPU is needed, so a kernel change can be checked for
register pressure, spills, shared memory beyond the H200's 227 KiB (a launch failure) and its
instruction count before it reaches the benchmark machine. Found this way (issue 15):
bias_act_dropout's backward used 255 registers and spilled 872 bytes per thread, and attention's
dropout mask, in plain column order, cost 16 KiB of shared memory per tile (above the limit with
the forward's 3 stages) and more instructions than its generator.

    pip install triton      # a developer tool, not a dependency of jaxfuse (its ptxas is used)
    PYTHONPATH=. python benchmarks/sass_report.py --only dropout,attention

Counts are static (each loop body once), which is what a change in a body moves. The compile
options must match the kernel's (`num_warps`, `num_stages`): they are taken from the lowered
custom call. Fragile by nature: it patches a private JAX function and Triton's IR text format
must be one the installed `triton` parses (checked with jax 0.10.2 and triton 3.9.0).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

import jaxfuse  # noqa: E402

CAUGHT: list = []   # (name, ttir text, num_warps, num_stages)


def _patch():
    from jax._src.pallas.triton import lowering as L
    from jax._src.pallas.triton import pallas_call_registration as R
    orig = L.lower_jaxpr_to_triton_module

    def lower(*a, **k):
        res = orig(*a, **k)
        asm = res.module.operation.get_asm(enable_debug_info=False)
        name = re.search(r"tt.func public @(\S+)\(", asm)
        CAUGHT.append([name.group(1) if name else "?", asm, None, None])
        return res
    R.lowering.lower_jaxpr_to_triton_module = lower
    orig_call = R.mlir.custom_call

    def custom_call(*a, backend_config=None, **k):   # num_warps / num_stages of the last kernel
        if isinstance(backend_config, dict) and "num_warps" in backend_config and CAUGHT:
            CAUGHT[-1][2] = int(str(backend_config["num_warps"]).split(":")[0])
            CAUGHT[-1][3] = int(str(backend_config["num_stages"]).split(":")[0])
        return orig_call(*a, backend_config=backend_config, **k)
    R.mlir.custom_call = custom_call


# Inference ops (no gradient): lowered forward only.
FORWARD_ONLY = {"decode_attention", "decode_attention_fused"}


def _lower(f, *args, forward_only=False):
    def g(*a):
        if forward_only:
            return f(*a)
        y, vjp = jax.vjp(f, *a)
        return y, vjp(jax.tree.map(jnp.ones_like, y))
    export.export(jax.jit(g), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def workloads():
    """The issue-15 shapes (activations [16384, 4096] bf16, embedding V=128256, attention B8
    T2048 H32 D128 causal), forward and backward."""
    key = jax.random.key(0)
    x = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    kw = dict(rate=0.1, key=key, interpret=False)
    q = jax.ShapeDtypeStruct((8, 2048, 32, 128), jnp.bfloat16)
    tok = jnp.zeros((8, 2048), jnp.int32)
    return {
        "dropout": (lambda x: jaxfuse.dropout(x, 0.1, key, interpret=False), x),
        "bias_dropout_add": (lambda x, b, r: jaxfuse.bias_dropout_add(x, b, r, **kw), x, b, x),
        "bias_act_dropout": (lambda x, b: jaxfuse.bias_act_dropout(x, b, **kw), x, b),
        "bias_act_dropout_tanh": (lambda x, b: jaxfuse.bias_act_dropout(
            x, b, activation="gelu_tanh", **kw), x, b),
        "add_norm": (lambda x, r, w: jaxfuse.add_norm(x, r, w, **kw), x, x, b),
        "swiglu": (lambda g, u: jaxfuse.swiglu(g, u, interpret=False), x, x),
        "embedding": (lambda t: jaxfuse.embedding(tok, t, scale=64.0, **kw),
                      jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16)),
        "attention": (lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, causal=True, dropout_rate=0.1, dropout_key=key, interpret=False), q, q, q),
        "attention_no_dropout": (lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, causal=True, interpret=False), q, q, q),
        # the 157M model's decoding step (B32, a 768-position cache, 16 query heads on 4 KV
        # heads of 64), the cache read in place
        "decode_attention": (lambda q, kc, vc, n: jaxfuse.decode_attention(
            q, kc, vc, n, interpret=False), jax.ShapeDtypeStruct((32, 16, 64), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((32, 768, 4, 64), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((32,), jnp.int32)),
        # the same step as the model runs it (s26): q/k/v as 8 float32 partial sums of the
        # grouped projection, scaled by the input's RMS, rotated (RoPE), the new K/V appended
        "decode_attention_fused": (lambda q, kc, vc, n, x: jaxfuse.decode_attention(
            q, kc, vc, n, packed_qkv="grouped", partial_sums=True, rope_base=10000.0,
            rms_input=x, interpret=False), jax.ShapeDtypeStruct((8, 32, 24, 64), jnp.float32),
            *[jax.ShapeDtypeStruct((32, 768, 4, 64), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((32, 1024), jnp.bfloat16)),
    }


def compile_report(name, ttir, warps, stages, tmp, keep=None):
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    path = os.path.join(tmp, f"{name}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")
                 if os.path.exists(os.path.join(bin_dir, n)))
    ptx, cubin = path + ".ptx", path + ".cubin"
    with open(ptx, "w") as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                          capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True,
                          text=True).stdout
    if keep:   # the IR stages and the SASS, to read
        os.makedirs(keep, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(keep, f"{name}.{ext}"), "w") as f:
                f.write(k.asm[ext])
        with open(os.path.join(keep, f"{name}.sass"), "w") as f:
            f.write(sass)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", sass, re.M)
    return dict(kernel=name, warps=warps, stages=stages, smem=k.metadata.shared,
                regs=int(regs.group(1)) if regs else None,
                spill_bytes=int(spill.group(1)) if spill else None, sass=len(ops),
                top=collections.Counter(ops).most_common(8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated workloads: " +
                    ",".join(workloads()))
    ap.add_argument("--keep", default=None,
                    help="a folder for each kernel's TTGIR, PTX and SASS")
    args = ap.parse_args()
    _patch()
    wl = workloads()
    names = args.only.split(",") if args.only else list(wl)
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            CAUGHT.clear()
            f, *a = wl[n]
            _lower(f, *a, forward_only=n in FORWARD_ONLY)
            for kname, ttir, warps, stages in CAUGHT:
                r = compile_report(kname, ttir, warps or 4, stages or 3, tmp, args.keep)
                print(f"{n:22s} {r['kernel']:36s} warps={r['warps']} stages={r['stages']} "
                      f"smem={r['smem']} regs={r['regs']} spill={r['spill_bytes']}B "
                      f"sass={r['sass']} {r['top']}", flush=True)


if __name__ == "__main__":
    main()
