"""What DFlash2 adds to the DFlash drafter: a block-local dynamic convolution around every sublayer and a candidate
selector (`drafter.DFlashDrafter` with `DrafterConfig.variant="dflash2"` builds them in).

The reference is z-lab's published inference code, z-lab/dflash `dflash/model.py` at commit
10129599dffb338ff38cfd235a53ca6d3667b4dd (`GroupedDynamicCausalConv`, `CandidateSelector`, `DFlash2DraftModel`);
what follows re-states its computation for training, with the parameter names of its checkpoints.

Block convolution (`BlockConv`; one wraps each attention and each MLP of every layer). A sublayer f whose input is
the normed residual stream x becomes post(f(pre(x))), where both are depthwise convolutions along the block's slots:

    pre(x)_t  = sum_j (base[0, j] + dyn[t, 0, j, g]) * x_{t-j}        j < kernel; g = the channel's group
    post(y)_t = sum_j (base[1, j] + dyn[t, 1, j, g]) * y_{t-j}
    dyn       = kernel_projection(x)  [.., 2, kernel, groups]         one dynamic tap per group of channels

x_{t-j} is zero when t-j falls before the block's first slot: a slot reads only earlier slots of its own block (at
inference the sequence is one block; in training A blocks lie end to end and the convolution restarts at each).
Identity at init: base[:, 0] = 1, base[:, 1:] = 0, kernel_projection = 0, so pre and post return their input bit
for bit and an untrained DFlash2 computes what DFlash computes with the same other weights.

Candidate selector (`CandidateSelector`). For a scored slot with final hidden state h and drafter logits z, the
top-k tokens of z are its candidates; candidate c after predecessor p scores

    s(c | p) = z_c + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >

Drafting walks the block: p = the anchor token, pick the best candidate (or sample), it is the next slot's p. Both
codebooks span the vocabulary at rank r. Identity at init: successor_codebook = 0, so s = z and the walk picks each
slot's argmax, as DFlash does; the predecessor codebook and hidden_projection start random so the successor
codebook's gradient is not zero (with two zero factors of the trilinear term no factor would ever move).

Training objective (`selector_ce_loss`, our choice; z-lab publishes no training code; docs/training.md): DFlash's
block CE, which trains everything but the selector, plus a CE over each labelled slot's candidates scored after its
*true* predecessor (the token before it in the data), against the true token's place among them; a slot whose true
token is not a candidate has nothing to select and is left out. Slot weights (decay's or D-PACE's) and denominator
are the block CE's.

Shape legend: B rows, Q = A*L block tokens, A blocks per row, L block length, H hidden, G groups, C channels per
group, J kernel taps, n scored slots, K candidates, R selector rank, V vocab.
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_offline.anchors import block_positions
from dflash_offline.loss import _logits, _norm, slot_weights


@contextmanager
def rng_untouched(device: torch.device | str | None = None):
    """Random draws inside leave the global generators (CPU's and `device`'s, default: the default device's) as they
    found them: DFlash2's modules draw without moving what the DFlash backbone around them draws, so a seeded DFlash2
    shares every DFlash tensor with the DFlash built from the same seed (paired A/B runs, untrained baselines)."""
    device = torch.device(device if device is not None else torch.get_default_device())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        yield


def block_conv(x_BQH: torch.Tensor, tap_BQJG: torch.Tensor, base_JH: torch.Tensor, block: int) -> torch.Tensor:
    """sum_j (base[j] + tap[.., j, g]) * x shifted by j slots inside each block of `block` slots (zeros before a
    block's first slot). The j = 0 term comes first, so with base[0] = 1 and zero taps the result is x exactly."""
    B, Q, H = x_BQH.shape
    J, G = base_JH.shape[0], tap_BQJG.shape[-1]
    x6 = x_BQH.view(B, Q // block, block, 1, G, H // G)  # [B, A, L, 1, G, C]
    tap6 = tap_BQJG.view(B, Q // block, block, J, G, 1)
    base = base_JH.to(x_BQH.dtype).view(J, G, H // G)
    out = x6[:, :, :, 0] * base[0] + tap6[:, :, :, 0] * x6[:, :, :, 0]
    for j in range(1, J):
        prev = F.pad(x6[:, :, :-j, 0], (0, 0, 0, 0, j, 0))  # slot t reads slot t-j of its block, zeros before it
        out = out + prev * base[j] + tap6[:, :, :, j] * prev
    return out.reshape(B, Q, H)


class BlockConv(nn.Module):
    """The pre- and post-convolution around one sublayer; parameters `base_kernel` [2, J, H] and
    `kernel_projection` (H -> 2*J*G), as z-lab's checkpoints name them."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}")
        self.kernel_size, self.groups, self.block_size = kernel_size, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        with rng_untouched():  # (nn.Linear draws its default init)
            self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: the current slot's tap 1, the others 0, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def around(self, sublayer, x_BQH: torch.Tensor) -> torch.Tensor:
        """post(sublayer(pre(x))), both taps predicted from x (blocks of `block_size` slots end to end)."""
        B, Q, _ = x_BQH.shape
        tap = self.kernel_projection(x_BQH).view(B, Q, 2, self.kernel_size, self.groups)
        y = sublayer(block_conv(x_BQH, tap[:, :, 0], self.base_kernel[0], self.block_size))
        return block_conv(y, tap[:, :, 1], self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """Scores each scored slot's top-k candidates given the token before it; parameters `predecessor_codebook`,
    `successor_codebook` [V, R] (plain tensors: no `.weight` in their names) and `hidden_projection` (H -> R)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab_size or rank < 1:
            raise ValueError(f"selector_top_k={top_k} must be in [1, {vocab_size}] and selector_rank={rank} >= 1")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        with rng_untouched():  # (nn.Linear draws its default init)
            self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """The identity (scores = logits): successor codebook 0; the predecessor codebook and hidden_projection
        ~ N(0, std)."""
        self.hidden_projection.weight.normal_(0.0, std)
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.zero_()

    def scores(self, h_nH: torch.Tensor, unary_nK: torch.Tensor, cand_nK: torch.Tensor,
               prev_n: torch.Tensor) -> torch.Tensor:
        """s(c | p) [n, K] for candidates `cand` with logits `unary`, after predecessors `prev` [n]."""
        hp = self.hidden_projection
        gate_nR = F.embedding(prev_n, self.predecessor_codebook) * hp(h_nH.to(hp.weight.dtype)).to(
            self.predecessor_codebook.dtype)
        pair_nK = torch.einsum("nr,nkr->nk", gate_nR, F.embedding(cand_nK, self.successor_codebook))
        return unary_nK + pair_nK.to(unary_nK.dtype)


# --- the selector's training objective ---------------------------------------------------------------------------


class SelectorLoss(NamedTuple):
    loss: torch.Tensor  # scalar fp32: sum of slot weight x CE over slots whose label is a candidate / the denominator
    correct_BAL: torch.Tensor  # bool: the selector's pick after the true predecessor is the label (slot 0: False)
    recall: torch.Tensor  # scalar fp32: labelled slots whose label is among the candidates / labelled slots
    weight: torch.Tensor  # scalar fp32: the slot weights of those slots (loss x denominator / weight = their mean CE)


@torch.no_grad()
def top_candidates(h_nH: torch.Tensor, lm_head_VH: torch.Tensor, k: int, chunk_tokens: int) -> torch.Tensor:
    """Ids [n, k] of each row's k largest logits h @ W^T, `chunk_tokens` rows at a time (the logits of one chunk
    exist at once, as in `loss.block_ce_loss`)."""
    return torch.cat([_logits(h_nH[c:c + chunk_tokens], lm_head_VH).topk(k, dim=-1).indices
                      for c in range(0, h_nH.shape[0], chunk_tokens)])


def selector_ce_loss(selector: CandidateSelector, hidden_BQH: torch.Tensor, lm_head_VH: torch.Tensor,
                     labels_BAL: torch.Tensor, input_ids_BS: torch.Tensor, anchor_pos_BA: torch.Tensor, *,
                     gamma: float | None = None, normalizer: torch.Tensor | float | None = None,
                     chunk_tokens: int = 4096, weighting: str = "decay",
                     slot_w_BAL: torch.Tensor | None = None) -> SelectorLoss:
    """The selector's CE on the drafter's outputs [B, A*(L-1), H] (scored slots, `scored_only=True`) or [B, A*L, H].

    Per labelled slot k: its candidates are the top-k tokens of its logits (found without gradient, chunked); their
    logits are recomputed from the gathered lm_head rows, so the gradient reaches the drafter through them as well
    as through `hidden_projection` (as `F.cross_entropy` over top-k logits would, without [n, V] logits in the
    graph: the gathered rows, n x K x H, are what backward keeps). The predecessor is the token at anchor + k - 1 in
    the row (the anchor's for k = 1). Weights: the block CE's — `slot_w_BAL`, the weights it used
    (`loss.BlockLoss.weights_BAL`: D-PACE's come from the drafter's own probabilities, so `weighting="dpace"` needs
    them), else decay's; the denominator: `normalizer` (the optimizer step's, `loss.step_normalizer`) or this batch's
    loss weight under `weighting`.
    """
    B, A, L = labels_BAL.shape
    if weighting == "dpace" and slot_w_BAL is None:
        raise ValueError("selector_ce_loss: weighting='dpace' weighs the slots as the block CE did: pass its "
                         "weights (slot_w_BAL=BlockLoss.weights_BAL)")
    H, S = hidden_BQH.shape[-1], input_ids_BS.shape[1]
    h_XKH = hidden_BQH.reshape(B * A, -1, H)
    if h_XKH.shape[1] == L:
        h_XKH = h_XKH[:, 1:]
    h_nH, lab_n = h_XKH.reshape(-1, H), labels_BAL[:, :, 1:].reshape(-1)
    pos_BAL = block_positions(anchor_pos_BA, L).clamp(max=S - 1)
    prev_n = input_ids_BS.gather(1, pos_BAL.view(B, -1)).view(B, A, L)[:, :, :-1].reshape(-1)
    cand_nK = top_candidates(h_nH, lm_head_VH, selector.top_k, chunk_tokens)
    unary_nK = torch.einsum("nh,nkh->nk", h_nH, lm_head_VH[cand_nK].to(h_nH.dtype)).float()
    scores_nK = selector.scores(h_nH, unary_nK, cand_nK, prev_n)
    hit_nK = cand_nK == lab_n[:, None]
    has_n = hit_nK.any(-1) & (lab_n >= 0)
    ce_n = F.cross_entropy(scores_nK.float(), hit_nK.int().argmax(-1), reduction="none")
    w_n = (slot_weights(L, gamma, h_nH.device)[1:].repeat(B * A) if slot_w_BAL is None
           else slot_w_BAL[:, :, 1:].reshape(-1).float()) * has_n
    norm = _norm(labels_BAL, gamma, weighting, normalizer)
    picked_n = cand_nK.gather(1, scores_nK.argmax(-1, keepdim=True))[:, 0]
    correct = ((picked_n == lab_n) & (lab_n >= 0)).view(B, A, L - 1)
    recall = has_n.sum().float() / (lab_n >= 0).sum().clamp(min=1)
    return SelectorLoss((w_n * ce_n).sum() / norm, torch.cat([torch.zeros_like(correct[:, :, :1]), correct], -1),
                        recall.detach(), w_n.sum())
