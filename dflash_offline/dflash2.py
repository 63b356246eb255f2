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

Shape legend: B rows, Q = A*L block tokens, A blocks per row, L block length, H hidden, G groups, C channels per
group, J kernel taps, n scored slots, K candidates, R selector rank, V vocab.
"""

import torch
import torch.nn.functional as F
from torch import nn


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
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """The identity (scores = logits): successor codebook 0; the predecessor codebook ~ N(0, std)."""
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.zero_()

    def scores(self, h_nH: torch.Tensor, unary_nK: torch.Tensor, cand_nK: torch.Tensor,
               prev_n: torch.Tensor) -> torch.Tensor:
        """s(c | p) [n, K] for candidates `cand` with logits `unary`, after predecessors `prev` [n]."""
        gate_nR = F.embedding(prev_n, self.predecessor_codebook) * self.hidden_projection(h_nH).to(
            self.predecessor_codebook.dtype)
        pair_nK = torch.einsum("nr,nkr->nk", gate_nR, F.embedding(cand_nK, self.successor_codebook))
        return unary_nK + pair_nK.to(unary_nK.dtype)
