"""Anchor sampling and block labels for DFlash training.

A training step draws, for every packed row, up to A anchor positions. Each anchor starts one block of L
tokens: block input `[token at anchor, MASK x (L-1)]`; slot k is trained to predict the token at `anchor + k`
(same position, not shifted). Slot 0 is given and never has a loss.

Everything runs on the tensors' device with fixed shapes: no host sync, no data-dependent sizes, so the
compiled drafter always sees one shape.

Shape legend: B rows per batch, S row length, A anchors per row, L block length (slots), Q = A*L.
"""

import torch

IGNORE = -100  # label value of a slot without a loss


def valid_anchor_mask(loss_mask_BS: torch.Tensor, doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: p may be an anchor iff tokens p and p+1 are supervised and p+1 is in p's document."""
    sup_BS = loss_mask_BS > 0
    ok_BS = torch.zeros_like(sup_BS)
    ok_BS[:, :-1] = (
        sup_BS[:, :-1] & sup_BS[:, 1:] & (doc_ids_BS[:, :-1] == doc_ids_BS[:, 1:]) & (doc_ids_BS[:, :-1] >= 0)
    )
    return ok_BS


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` distinct valid anchors per row, uniformly without replacement.

    Returns `anchor_pos_BA` (int64, ascending among kept anchors, kept ones first) and `keep_BA` (bool).
    A row with fewer than A valid positions is padded with keep=False anchors at position 0.
    `block_size` does not restrict anchors: a block that runs past its document end (or the row end) keeps
    its anchor and loses only the labels past the end (see `block_labels`). `generator` must live on the
    tensors' device; each call draws fresh anchors from it. A list of B generators draws each row's from its own (a
    row's anchors then depend on its generator alone, not on which rows share its batch).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (slot 0 is the given token), got {block_size}")
    B, S = loss_mask_BS.shape
    if not 0 < num_anchors <= S:
        raise ValueError(f"num_anchors must be in 1..{S} (the row length), got {num_anchors}")
    ok_BS = valid_anchor_mask(loss_mask_BS, doc_ids_BS)
    # random keys in [0, 1) for valid positions, -1 for invalid ones: top-A keys = uniform sample w/o replacement
    keys_BS = random_rows(torch.rand, (B, S), generator, loss_mask_BS.device)
    keys_BS = torch.where(ok_BS, keys_BS, torch.full_like(keys_BS, -1.0))
    top_BA, pos_BA = keys_BS.topk(num_anchors, dim=1)
    keep_BA = top_BA >= 0
    # sort: kept anchors ascending first, padding after (nearby queries see similar context -> sparser mask)
    order_BA = torch.where(keep_BA, pos_BA, pos_BA + S).argsort(dim=1)
    pos_BA = pos_BA.gather(1, order_BA)
    keep_BA = keep_BA.gather(1, order_BA)
    pos_BA = torch.where(keep_BA, pos_BA, torch.zeros_like(pos_BA))
    return pos_BA, keep_BA


def random_rows(draw, shape: tuple, generator, device) -> torch.Tensor:
    """`draw(shape)` (torch.rand, torch.randn) from `generator`, or with a list of generators one row of `shape` from
    each."""
    if isinstance(generator, list | tuple):
        return torch.cat([draw((1, *shape[1:]), generator=g, device=device) for g in generator])
    return draw(shape, generator=generator, device=device)


def sample_blocks(batch: dict, num_anchors: int, block_size: int,
                  generator: torch.Generator | list[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training batch's blocks from its `loss_mask`, `doc_ids` and `input_ids` [B, S]: (anchor_pos_BA, keep_BA,
    labels_BAL), `sample_anchors` drawing from `generator`, then `block_labels`."""
    mask_BS, doc_BS = batch["loss_mask"], batch["doc_ids"]
    anchor_pos_BA, keep_BA = sample_anchors(mask_BS, doc_BS, num_anchors, block_size, generator)
    labels_BAL = block_labels(batch["input_ids"], mask_BS, doc_BS, anchor_pos_BA, keep_BA, block_size)
    return anchor_pos_BA, keep_BA, labels_BAL


def block_positions(anchor_pos_BA: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row indices [B, A, L] of the tokens each block slot stands for: anchor + k (may run past the row)."""
    offs = torch.arange(block_size, device=anchor_pos_BA.device)
    return anchor_pos_BA[:, :, None] + offs


def block_labels(
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Labels [B, A, L] (int64): slot k holds the token at anchor + k, or IGNORE (-100).

    A slot has a label only if k >= 1, the anchor is kept, anchor + k lies inside the row and in the
    anchor's document, and that token is supervised (loss_mask).
    """
    B, S = input_ids_BS.shape
    A = anchor_pos_BA.shape[1]
    idx_BAL = block_positions(anchor_pos_BA, block_size)
    safe_BX = idx_BAL.clamp(max=S - 1).reshape(B, A * block_size)
    tok_BAL = input_ids_BS.gather(1, safe_BX).view(B, A, block_size)
    sup_BAL = (loss_mask_BS.gather(1, safe_BX) > 0).view(B, A, block_size)
    doc_BAL = doc_ids_BS.gather(1, safe_BX).view(B, A, block_size)
    anchor_doc_BA = doc_ids_BS.gather(1, anchor_pos_BA)
    slot_L = torch.arange(block_size, device=input_ids_BS.device)
    valid_BAL = (
        (idx_BAL < S)
        & (doc_BAL == anchor_doc_BA[:, :, None])
        & sup_BAL
        & keep_BA[:, :, None]
        & (slot_L > 0)
    )
    return torch.where(valid_BAL, tok_BAL.long(), torch.full_like(tok_BAL, IGNORE, dtype=torch.long))


def block_input_ids(
    input_ids_BS: torch.Tensor,
    anchor_pos_BA: torch.Tensor,
    keep_BA: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> torch.Tensor:
    """Block inputs [B, A*L]: `[token at anchor, MASK x (L-1)]` per anchor; padded anchors are all MASK."""
    B, A = anchor_pos_BA.shape
    ids_BAL = torch.full((B, A, block_size), mask_token_id, dtype=torch.long, device=input_ids_BS.device)
    first_BA = input_ids_BS.gather(1, anchor_pos_BA).long()
    ids_BAL[:, :, 0] = torch.where(keep_BA, first_BA, torch.full_like(first_BA, mask_token_id))
    return ids_BAL.view(B, A * block_size)


def block_position_ids(position_ids_BS: torch.Tensor, anchor_pos_BA: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions [B, A*L] of the block tokens: document-local pos(anchor) + k."""
    B, A = anchor_pos_BA.shape
    base_BA = position_ids_BS.gather(1, anchor_pos_BA).long()
    offs = torch.arange(block_size, device=anchor_pos_BA.device)
    return (base_BA[:, :, None] + offs).view(B, A * block_size)
