"""The DFlash training attention mask, as a dense bool tensor (reference) and as a flex_attention BlockMask.

Queries are the Q = A*L block tokens of a row (anchor a, slot k at query index a*L + k). Keys are the S context
positions of the row followed by the same Q block tokens. Query (a, k) with anchor position p sees

- context key j  iff  j < p (strictly before the anchor) and j is in p's document and the anchor is kept;
- block key (a', k')  iff  a' == a (its own block, bidirectional); nothing of other blocks.

Sliding-window layers additionally require `(p + k) - j < W` for context keys (the query's own position minus
the key's) and, with `block_causal` (the default; DESIGN: "context limited to the window, block causal"; z-lab's
inference mask for `sliding_attention` layers of a config without `is_causal`), `k' <= k` inside the block.
`block_causal=False` keeps the whole block visible in sliding layers too, as z-lab's DFlash2 drafters declare with
`is_causal: false` (docs/serving.md); the window never cuts a block (L <= W). Padded anchors (keep=False) see only
their own block, so no row of the mask is empty and no NaN appears.

The training flex path splits the two parts (see `drafter.split_attention`): flex_attention over the S context
keys with a context-only BlockMask (`flex_block_mask`, `context_only=True` in `make_mask_mod`), and the
block-diagonal part as a small dense attention per block (`block_allow`); the two are merged by their
log-sum-exps. A query whose context is empty (padded anchor, anchor at its document's start) has an empty
context row there, which the merge handles.

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
    block_causal: bool = True,
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
        blk_QQ &= block_allow(L, sliding_window, dev, block_causal).repeat(A, A)
    full_BQK = torch.cat([ctx_BQS, blk_QQ.expand(B, -1, -1)], dim=2)
    return full_BQK[:, None]


def query_bounds(
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the context keys it sees as one interval: int32 (lo_BQ, hi_BQ), key j visible iff lo <= j < hi.

    Documents of a packed row are contiguous runs of one doc id (packing writes them so), so "j < p and j in p's
    document" is "start of p's document <= j < p"; a sliding window raises lo to p + k - W + 1; a padded anchor
    gets hi = 0 (no context).
    """
    B, S = doc_ids_BS.shape
    L = block_size
    pos_S = torch.arange(S, device=doc_ids_BS.device)
    starts_BS = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    doc_start_BS = torch.where(starts_BS, pos_S, 0).cummax(dim=1).values
    lo_BQ = doc_start_BS.gather(1, anchor_pos_BA).repeat_interleave(L, dim=1)
    hi_BQ = torch.where(keep_BA, anchor_pos_BA, 0).repeat_interleave(L, dim=1)
    if sliding_window is not None:
        k_Q = torch.arange(hi_BQ.shape[1], device=hi_BQ.device) % L
        lo_BQ = torch.maximum(lo_BQ, anchor_pos_BA.repeat_interleave(L, dim=1) + k_Q - sliding_window + 1)
    return lo_BQ.to(torch.int32), hi_BQ.to(torch.int32)


def block_allow(block_size: int, sliding_window: int | None = None, device=None,
                block_causal: bool = True) -> torch.Tensor:
    """Bool [L, L]: slot k may see slot k' of its own block (all of them; sliding layers with `block_causal`:
    k - W < k' <= k; without it |k - k'| < W, every slot when L <= W)."""
    if sliding_window is None:
        return torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    k = torch.arange(block_size, device=device)
    dk = k[:, None] - k[None, :]
    return ((dk >= 0) if block_causal else (-dk < sliding_window)) & (dk < sliding_window)


def make_mask_mod(
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    context_only: bool = False,
    block_causal: bool = True,
):
    """flex_attention mask_mod(b, h, q_idx, kv_idx) with the semantics of `dense_mask` (keys: S context + Q
    block), or with `context_only` of its first S columns (keys: the S context positions only).

    Context visibility is one interval per query (`query_bounds`): two loads indexed by the query only, no gather
    per key. Indices are clamped before every gather, so the function is safe on out-of-range indices (flex may
    evaluate padded tiles) and broadcasts over index tensors of any shape.
    """
    S = doc_ids_BS.shape[1]
    Q, L = anchor_pos_BA.shape[1] * block_size, block_size
    lo_BQ, hi_BQ = query_bounds(anchor_pos_BA, keep_BA, doc_ids_BS, block_size, sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        qi = q_idx.clamp(0, Q - 1)
        ctx = (kv_idx >= lo_BQ[b, qi]) & (kv_idx < hi_BQ[b, qi])  # hi <= anchor < S: context keys only
        if context_only:
            return ctx
        kb = kv_idx - S
        blk = (kb >= 0) & (kb // L == q_idx // L)
        if sliding_window is not None:
            dk = q_idx % L - kb % L
            blk = blk & ((dk >= 0) if block_causal else (-dk < sliding_window)) & (dk < sliding_window)
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
    context_only: bool = True,
    block_causal: bool = True,
) -> BlockMask:
    """BlockMask (B, heads broadcast, Q, S) over the context keys only (what `drafter.split_attention` takes), or
    with `context_only=False` (B, heads broadcast, Q, S+Q) over context + block keys (one flex call for both).

    `compiled` defaults to True on CUDA: uncompiled, create_block_mask materializes the full mask per row. Pass
    compiled=False on CPU (tests, tiny shapes). `tile` is flex's BLOCK_SIZE.
    """
    B, S = doc_ids_BS.shape
    Q = anchor_pos_BA.shape[1] * block_size
    if compiled is None:
        compiled = anchor_pos_BA.device.type == "cuda"
    mask_mod = make_mask_mod(anchor_pos_BA, keep_BA, doc_ids_BS, block_size, sliding_window, context_only, block_causal)
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(mask_mod, B, None, Q, S if context_only else S + Q, device=anchor_pos_BA.device, BLOCK_SIZE=tile)
