"""The visibility rule shared by softmax, attention and decoding (written once)."""
from __future__ import annotations


def keep_mask(q_pos, k_pos, *, n_q: int, n_k: int, causal: bool = False,
              window: int | None = None):
    """Which (query, key) pairs are kept: keys in range, causal and window bounds.

    Positions are absolute indices that broadcast against each other. The causal mask is aligned
    bottom-right, so the last query sees every key: key j is kept for query i iff
    `j <= i + (n_k - n_q)`; a window of w also drops `j < i + (n_k - n_q) - w + 1`.
    """
    keep = (k_pos < n_k) & (q_pos < n_q)
    shift = n_k - n_q
    if causal:
        keep = keep & (k_pos <= q_pos + shift)
    if window is not None:
        keep = keep & (k_pos >= q_pos + shift - window + 1)
    return keep
