"""The DFlash training attention mask, as a dense bool tensor (reference) and as a flex_attention BlockMask.

Queries are the Q = A*L block tokens of a row (anchor a, slot k at query index a*L + k). Keys are the S context
positions of the row followed by the same Q block tokens. Query (a, k) with anchor position p sees

- context key j  iff  j < p (strictly before the anchor) and j is in p's document and the anchor is kept;
- block key (a', k')  iff  a' == a (its own block, bidirectional); nothing of other blocks.

Sliding-window layers (DESIGN: "context limited to the window, block causal"; z-lab's inference mask for
`sliding_attention` layers) additionally require `(p + k) - j < W` for context keys (the query's own position
minus the key's), and `k' <= k` inside the block. Padded anchors (keep=False) see only their own block, so
no row of the mask is empty and no NaN appears.

Shape legend: B rows, S row length, A anchors per row, L block length, Q = A*L queries, KV = S + Q keys.
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def dense_mask(
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Bool mask [B, 1, Q, S+Q] (True = may attend) for SDPA; memory O(B*Q*(S+Q)), meant for tests/CPU."""
    B, S = doc_ids_BS.shape
    A, L = anchor_pos_BA.shape[1], block_size
    dev = anchor_pos_BA.device
    slot_Q = torch.arange(A * L, device=dev) % L
    blk_Q = torch.arange(A * L, device=dev) // L
    anchor_BQ = anchor_pos_BA.repeat_interleave(L, dim=1)
    keep_BQ = keep_BA.repeat_interleave(L, dim=1)
    adoc_BQ = doc_ids_BS.gather(1, anchor_pos_BA).repeat_interleave(L, dim=1)
    j_S = torch.arange(S, device=dev)
    ctx_BQS = (
        (j_S[None, None, :] < anchor_BQ[:, :, None])
        & (doc_ids_BS[:, None, :] == adoc_BQ[:, :, None])
        & keep_BQ[:, :, None]
    )
    blk_QQ = blk_Q[:, None] == blk_Q[None, :]
    if sliding_window is not None:
        qpos_BQ = anchor_BQ + slot_Q
        ctx_BQS &= (qpos_BQ[:, :, None] - j_S[None, None, :]) < sliding_window
        dk_QQ = slot_Q[:, None] - slot_Q[None, :]
        blk_QQ &= (dk_QQ >= 0) & (dk_QQ < sliding_window)
    full_BQK = torch.cat([ctx_BQS, blk_QQ.expand(B, -1, -1)], dim=2)
    return full_BQK[:, None]


def make_mask_mod(
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
):
    """flex_attention mask_mod(b, h, q_idx, kv_idx) with the semantics of `dense_mask`.

    Indices are clamped before every gather, so the function is safe on out-of-range indices (flex may
    evaluate padded tiles) and broadcasts over index tensors of any shape.
    """
    S = doc_ids_BS.shape[1]
    A, L = anchor_pos_BA.shape[1], block_size
    anchor_doc_BA = doc_ids_BS.gather(1, anchor_pos_BA)

    def mask_mod(b, h, q_idx, kv_idx):
        a = (q_idx // L).clamp(0, A - 1)
        k = q_idx % L
        anchor = anchor_pos_BA[b, a]
        j = kv_idx.clamp(0, S - 1)
        ctx = (kv_idx < S) & (kv_idx < anchor) & (doc_ids_BS[b, j] == anchor_doc_BA[b, a]) & keep_BA[b, a]
        kb = (kv_idx - S).clamp(min=0)
        blk = (kv_idx >= S) & (kb // L == q_idx // L)
        if sliding_window is not None:
            ctx = ctx & ((anchor + k - kv_idx) < sliding_window)
            dk = k - kb % L
            blk = blk & (dk >= 0) & (dk < sliding_window)
        return ctx | blk

    return mask_mod


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask, dynamic=False)


def flex_block_mask(
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    *,
    compiled: bool | None = None,
    tile: int = 128,
) -> BlockMask:
    """BlockMask (B, heads broadcast, Q, S+Q) for flex_attention.

    `compiled` defaults to True on CUDA: uncompiled, create_block_mask materializes the full [Q, S+Q] mask
    per row. Pass compiled=False on CPU (tests, tiny shapes). `tile` is flex's BLOCK_SIZE.
    """
    B, S = doc_ids_BS.shape
    Q = anchor_pos_BA.shape[1] * block_size
    if compiled is None:
        compiled = anchor_pos_BA.device.type == "cuda"
    mask_mod = make_mask_mod(anchor_pos_BA, keep_BA, doc_ids_BS, block_size, sliding_window)
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(mask_mod, B, None, Q, S + Q, device=anchor_pos_BA.device, BLOCK_SIZE=tile)
