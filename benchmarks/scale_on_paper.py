"""Scale on paper: the 1B preset's train step on 8 H200s (data x tensor) and a 128K-token
context with ring attention over 8 H200s, extrapolated from single-GPU times measured in
BENCHMARKS.md and the H200's NVLink bandwidth. Pure arithmetic (no JAX, no GPU); prints the
markdown table of BENCHMARKS.md's "Scale on paper" section.

    python benchmarks/scale_on_paper.py

Every input is a named constant below with where it comes from. Collectives are counted on the
critical path (no overlap) for the communication share, and the step is also given with the
data-parallel gradient all-reduce hidden under the backward (what XLA's async collectives aim
for). Tensor-parallel all-reduces sit between matmuls that need their result, so they are not
hidden without collective matmuls.
"""
from __future__ import annotations

# ---- measured on one H200 (BENCHMARKS.md, shared/BENCHMARKING.md) ----------------------------
MATMUL_TFLOPS = 668.0        # x @ W of the LCE section, N=8192 D=4096 V=128256 bf16 (run 37)
ATTN_D64_TFLOPS = 215.0      # causal fwd+bwd B8 H16/4 T2048 D64: 1.12 ms (end-to-end table)
ATTN_D128_TFLOPS = 358.0     # causal fwd+bwd B4 H32 T4096 D128: 5.375 ms (run 8)
STEP_157M_MS = 33.7          # 157M train step B8 T2048, jaxfuse (end-to-end table)
# ---- NVLink 4 on an H200 SXM: 18 links, 900 GB/s both directions, 450 GB/s each way ----------
NVLINK_GBS = 450.0           # per direction, per GPU (datasheet)
BUS_EFFICIENCY = 0.8         # NCCL bus bandwidth / link rate assumed for all-reduce and ppermute
BF16 = 2


def model_params(vocab, d, layers, heads, kv_heads, d_ff):
    hd = d // heads
    per_layer = d * d * 2 + 2 * d * kv_heads * hd + 3 * d * d_ff
    return per_layer * layers, vocab * d        # (blocks, one of embed/unembed)


def step_flops(vocab, d, layers, heads, kv_heads, d_ff, tokens, seq):
    """(matmul FLOPs, attention FLOPs) of a fwd+bwd step: 6 N per token for the block weights
    and the unembedding (the embedding is a gather), 4 T^2 D H / 2 per causal layer x 3.5."""
    blocks, unembed = model_params(vocab, d, layers, heads, kv_heads, d_ff)
    matmul = 6 * (blocks + unembed) * tokens
    attn = 4 * (tokens // seq) * heads * seq * seq * (d // heads) / 2 * 3.5 * layers
    return matmul, attn


def kernel_ms(matmul, attn, attn_tflops):
    return matmul / MATMUL_TFLOPS / 1e9 + attn / attn_tflops / 1e9


def allreduce_ms(nbytes, n):
    """Ring all-reduce: each GPU sends and receives 2 (n - 1) / n of the buffer."""
    return 2 * (n - 1) / n * nbytes / (NVLINK_GBS * BUS_EFFICIENCY * 1e9) * 1e3


def main():
    # The 157M model's measured step calibrates what the kernels' FLOPs leave out (norms,
    # RoPE, SwiGLU, the loss, launch gaps): its step over its matmul + attention time.
    m157, a157 = step_flops(32768, 1024, 8, 16, 4, 2816, 8 * 2048, 2048)
    overhead = STEP_157M_MS / kernel_ms(m157, a157, ATTN_D64_TFLOPS)

    preset = dict(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, d_ff=8192)
    blocks, unembed = model_params(**preset)
    params = blocks + 2 * unembed
    rows = []

    # 1B, 8 GPUs = data 4 x tensor 2, global batch 16 x 8192 tokens (4 sequences per replica).
    data, tensor, seq, seqs = 4, 2, 8192, 16
    tokens_replica = seqs // data * seq
    m, a = step_flops(**preset, tokens=tokens_replica, seq=seq)
    compute = kernel_ms(m, a, ATTN_D64_TFLOPS) * overhead / tensor
    act = tokens_replica * preset["d"] * BF16
    tp = (4 * preset["layers"] + 2) * allreduce_ms(act, tensor)   # 2 fwd + 2 bwd per layer; x, dx of the loss
    dp = allreduce_ms(params / tensor * BF16, data)              # bf16 gradients of the shard
    rows.append(("1B, data 4 x tensor 2, B=16 x T=8192 (32K tokens per replica)",
                 compute, tp, dp, tokens_replica * data))

    # Same 8 GPUs, data 8 (pure data parallel), for comparison.
    tokens_gpu = seqs // 8 * seq
    m, a = step_flops(**preset, tokens=tokens_gpu, seq=seq)
    compute8 = kernel_ms(m, a, ATTN_D64_TFLOPS) * overhead
    rows.append(("1B, data 8, B=16 x T=8192 (16K tokens per GPU)", compute8, 0.0,
                 allreduce_ms(params * BF16, 8), tokens_gpu * 8))

    # 128K context, ring attention over 8 GPUs (seq 8), one sequence, load-balanced chunks.
    n, t = 8, 131072
    m, a = step_flops(**preset, tokens=t, seq=t)
    compute_ring = kernel_ms(m / n, a / n, ATTN_D64_TFLOPS) * overhead
    kv_chunk = t // n * preset["kv_heads"] * (preset["d"] // preset["heads"]) * 2 * BF16
    p2p = kv_chunk / (NVLINK_GBS * BUS_EFFICIENCY * 1e9) * 1e3          # one ring step, K and V
    # Forward passes K, V (n - 1 steps); backward K, V, dK, dV (n steps, dK/dV return home).
    ring = preset["layers"] * ((n - 1) * p2p + n * 2 * p2p)
    rows.append(("1B, seq 8 (ring attention), B=1 x T=131072", compute_ring, ring,
                 allreduce_ms(params * BF16, n), t))

    print(f"calibration: 157M step {STEP_157M_MS} ms = {overhead:.2f} x its matmul + attention "
          f"kernel time; 1B preset: {params / 1e9:.2f}B parameters ({blocks / 1e6:.0f}M in blocks)")
    print("| configuration | compute per GPU | TP / ring comm. | DP grad all-reduce | step, "
          "nothing overlapped | comm. share | step, overlapped | tokens/s (all GPUs) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, comp, inner, dp, tokens in rows:
        hide_ring = name.startswith("1B, seq")
        total = comp + inner + dp
        hidden = comp + (0.0 if hide_ring else inner)
        print(f"| {name} | {comp:.0f} ms | {inner:.1f} ms | {dp:.1f} ms | {total:.0f} ms | "
              f"{(inner + dp) / total:.0%} | {hidden:.0f} ms | {tokens / hidden * 1e3:,.0f} |")


if __name__ == "__main__":
    main()
