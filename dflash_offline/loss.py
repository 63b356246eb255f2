"""Block CE loss through the frozen target lm_head, chunked so `[A*L, vocab]` logits never exist in full.

`block_ce_loss` runs one pass over chunks of whole blocks. Per chunk: logits = h @ W^T (low-precision GEMM,
fp32 output; or bf16 output with `logits="bf16"`), then one epilogue: fp32 softmax, weighted CE, argmax accuracy and
dlogits = w * (softmax - onehot) (on CUDA a two-pass Triton kernel reading the logits twice, `ce_kernel`; eager
elsewhere); then the input gradient dh = dlogits @ W (second GEMM). Only dh is kept for backward: no recompute, no
grad for W.
Slot 0 (the given token) is skipped entirely: its logits are never computed.

Weighting (`weighting=`):
- "decay" (DFlash): w[k] = exp(-(k-1)/gamma) for slot k >= 1, times label validity; loss = sum(w*ce) / sum(w).
- "dpace": acceptance-aware weights (the D-PACE option of SpecForge's DFlash trainer, the same weights). With
  q_k = p_draft(label_k) (detached) and s_k = (1-alpha)*q_k + alpha for valid slots (s_k = 1 for invalid ones),
  P_j = prod_{i<=j} s_i and w_k = valid_k * sum_{j>=k} valid_j * P_j: a surrogate of the smoothed expected acceptance
  length sum_j P_j (whose gradient is sum_k w_k * dlog s_k, and dlog s_k = (1-alpha) q_k / s_k * dlog q_k: the CE
  weights here leave out that factor, as SpecForge does). Weights are detached; loss = sum(w*ce) / (number of blocks
  with >= 1 label) — a mean over blocks, where SpecForge divides by rows: its loss and gradient are larger by the mean
  number of labelled blocks a row (at most num_anchors: 512 on full rows of the 27B recipes), so with grad_clip=1.0
  its updates are clipped far more often than these (not measured here); Adam is otherwise blind to the scale.
  alpha: `train.dpace_alpha` (0.5, SpecForge's default).
  Its weights need the chunk's CE first, so a chunk runs the same epilogue twice: CE without dlogits, then dlogits
  with those weights (the Triton kernel on CUDA: three reads of the logits and one write, where decay's is two and one).
The denominator (`loss_weight`) is the batch's by default; training divides every micro-batch by its optimizer
step's, over all its micro-batches and processes (`step_normalizer`).

Metrics come from the same pass: `correct_BAL` (argmax == label, False where no label).

Shape legend: B rows, A anchors per row, L block length, H hidden, V vocab, X = B*A blocks, n chunk tokens.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_offline import ce_kernel
from dflash_offline.anchors import IGNORE
from dflash_offline.config import ConfigError, check_choice

DEFAULT_GAMMA = {16: 7.0, 8: 4.0}  # DFlash paper / DESIGN: gamma per block size


@dataclass
class LossSettings:
    """What a run's loss scores and how it computes it (`train` settings)."""

    num_anchors: int = 512  # anchors per row, resampled every step (padded with a keep mask)
    gamma: float = 0.0  # slot-weight decay exp(-(k-1)/gamma); 0 = 7 for block 16, 4 for block 8; inf = no decay
    weighting: str = "decay"  # slot weights: "decay" (exp(-(k-1)/gamma)) or "dpace"
    dpace_alpha: float = 0.5  # weighting=dpace: each slot's factor (1-alpha)*p(label) + alpha, alpha in [0, 1] (SpecForge's dpace_alpha)
    noise_std: float = 0.0  # Gaussian noise on the context hidden states (relative to their RMS); 0 = off
    selector_weight: float = 1.0  # dflash2: weight of the selector CE added to the block CE
    loss_chunk_tokens: int = 4096  # query tokens per lm_head chunk (logits: chunk x vocab x 4 bytes; 2 if bf16)
    loss_epilogue: str = "auto"  # softmax/CE/dlogits of a chunk: "triton", "compiled" or "eager"; auto = triton on CUDA
    loss_logits: str = "fp32"  # lm_head logits the CE reads: "fp32", "bf16" (rounded as a bf16 lm_head; less memory) or "fp8" (both lm_head GEMMs in float8, bf16 logits)

    def resolve(self) -> "LossSettings":
        check_choice("train.weighting", self.weighting, ("decay", "dpace"))
        check_choice("train.loss_epilogue", self.loss_epilogue, ("auto", "triton", "compiled", "eager"))
        check_choice("train.loss_logits", self.loss_logits, ("fp32", "bf16", "fp8"))
        if self.num_anchors <= 0:
            raise ConfigError(f"train.num_anchors must be > 0, got {self.num_anchors}")
        if not 0.0 <= self.dpace_alpha <= 1.0:  # (NaN too)
            raise ConfigError(f"train.dpace_alpha={self.dpace_alpha}: give a value in [0, 1] (0: the product of the "
                              f"label probabilities, 1: the count of labelled slots from each to its block's end)")
        if not self.gamma >= 0:  # (NaN too)
            raise ConfigError(f"train.gamma={self.gamma}: give a decay length > 0, inf for no decay, or 0 for the "
                              f"default (7 for block 16, 4 for block 8)")
        return self


def slot_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """fp32 [L]: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1 (gamma defaults per DEFAULT_GAMMA)."""
    if gamma is None:
        if block_size not in DEFAULT_GAMMA:
            raise ValueError(f"no default loss gamma for block_size={block_size}; set gamma explicitly")
        gamma = DEFAULT_GAMMA[block_size]
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def dpace_weights(q_XL: torch.Tensor, valid_XL: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [X, L] (see module doc) from per-slot label probabilities q (fp32, detached)."""
    s = torch.where(valid_XL, (1.0 - alpha) * q_XL + alpha, torch.ones_like(q_XL))
    prefix = torch.cumprod(s, dim=-1) * valid_XL
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return suffix * valid_XL


LOGITS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}  # fp8: bf16 GEMM output
E4M3_MAX, E5M2_MAX = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max


ROWS_AT_ONCE = 16384  # rows quantized at a time: the float32 temporaries stay ≤ this × H × 4 bytes


def _rowwise_e4m3(x_nK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x in float8 e4m3 with one float32 scale per row (x ≈ q · s): (q [n, K], s [n, 1]) — the fp8 cache's
    per-token encoding (`encodings.fp8_encode`), ROWS_AT_ONCE rows at a time."""
    from dflash_offline.cache.encodings import fp8_encode

    q = torch.empty(x_nK.shape, dtype=torch.float8_e4m3fn, device=x_nK.device)
    s = torch.empty((x_nK.shape[0], 1), dtype=torch.float32, device=x_nK.device)
    for r0 in range(0, x_nK.shape[0], ROWS_AT_ONCE):
        q[r0:r0 + ROWS_AT_ONCE], s[r0:r0 + ROWS_AT_ONCE] = fp8_encode(x_nK[r0:r0 + ROWS_AT_ONCE])
    return q, s


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar, without a temporary the size of x."""
    return torch.maximum(x.amax(), -x.amin()).float()


class Fp8Head:
    """The frozen lm_head W [V, H] in float8 e4m3, quantized once per weight (`of`): rows scaled one by one for the
    logits GEMM (W8_VH, s_V), and the whole matrix, transposed, with one scale for the input-gradient GEMM (W8_HV,
    s_w). Both GEMMs are `torch._scaled_mm` with bf16 output: logits = (h8 · s_h) (W8 · s_V)ᵀ with h scaled per row
    (e4m3), and dh = (d8 · s_d) (W8 · s_w) with dlogits scaled per chunk in e5m2 (its range keeps the softmax's
    small probabilities, which e4m3 would flush to zero). Quantizing W takes ROWS_AT_ONCE rows at a time."""

    _cache: tuple | None = None  # (weak reference to the weight, its (version, address), its Fp8Head)

    def __init__(self, w_VH: torch.Tensor):
        self.w8_VH, s_V1 = _rowwise_e4m3(w_VH)
        self.s_1V = s_V1.t().contiguous()
        self.s_w = _absmax(w_VH).clamp(min=1e-12) / E4M3_MAX
        V, H = w_VH.shape
        self.w8_HV = torch.empty((H, V), dtype=torch.float8_e4m3fn, device=w_VH.device)
        for r0 in range(0, V, ROWS_AT_ONCE):
            self.w8_HV[:, r0:r0 + ROWS_AT_ONCE] = (w_VH[r0:r0 + ROWS_AT_ONCE].float().t() / self.s_w).to(
                torch.float8_e4m3fn)

    @classmethod
    def of(cls, w_VH: torch.Tensor) -> "Fp8Head":
        """The head of this weight tensor as it is now (another tensor, even at the same address, the same one
        changed in place, or given other storage through `.data =`, is quantized anew; a change through `w.data`'s
        in-place ops is not seen: autograd does not count it either); the cache lets go when the weight is freed."""
        import weakref

        c, now = cls._cache, (w_VH._version, w_VH.data_ptr())
        if c is None or c[0]() is not w_VH or c[1] != now:
            cls._cache = None  # (the old head's memory first)
            cls._cache = (weakref.ref(w_VH, lambda _: setattr(cls, "_cache", None)), now, cls(w_VH))
        return cls._cache[2]

    def logits(self, h_nH: torch.Tensor) -> torch.Tensor:
        h8, s_n1 = _rowwise_e4m3(h_nH)
        return _scaled_mm(h8, self.w8_VH.t(), s_n1, self.s_1V)

    def grad_input(self, d_nV: torch.Tensor) -> torch.Tensor:
        """dlogits @ W; `d_nV` is consumed (scaled in place, then cast: no float32 copy of a chunk's logits)."""
        s_d = _absmax(d_nV).clamp(min=1e-30) / E5M2_MAX
        d8 = d_nV.mul_(1 / s_d).to(torch.float8_e5m2)
        return _scaled_mm(d8, self.w8_HV.t(), s_d, self.s_w)


def _scaled_mm(a8_nK: torch.Tensor, b8_KM: torch.Tensor, s_a: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """(a8 · s_a)(b8 · s_b) in bf16: `torch._scaled_mm` on CUDA. On the CPU the float32 GEMM of the dequantized
    operands, rounded to bf16 — what torch's CPU `_scaled_mm` computes, bit for bit (torch 2.11 and 2.13, AMD EPYC
    Zen 5), written out because torch 2.11's refuses per-row scales ("only supports per-tensor scaling")."""
    if a8_nK.device.type != "cpu":
        return torch._scaled_mm(a8_nK, b8_KM, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
    return ((a8_nK.float() * s_a) @ (b8_KM.float() * s_b)).to(torch.bfloat16)


def _logits(h_nH: torch.Tensor, w_VH: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """h @ W^T with fp32 sums, output in `dtype` (fp32, or bf16: the sums rounded once, as a bf16 lm_head gives)."""
    if h_nH.is_cuda and h_nH.dtype in (torch.bfloat16, torch.float16):
        if dtype == h_nH.dtype:
            return h_nH @ w_VH.t()  # low-precision GEMM: fp32 accumulate, rounded output
        return torch.mm(h_nH, w_VH.t(), out_dtype=dtype)  # bf16 GEMM, fp32 accumulate + output
    return (h_nH.float() @ w_VH.float().t()).to(dtype)


def _decay_epilogue(z_nV: torch.Tensor, lab_n: torch.Tensor, w_n: torch.Tensor, need_grad: bool, grad_dtype):
    """From fp32 or bf16 logits of one chunk: (ce_n, argmax_n, dlogits_nV = w * (softmax - onehot) in grad_dtype or
    None). Written for torch.compile to fuse into a few passes over the logits (it runs eager off CUDA). bf16 logits are
    read as fp32 (all arithmetic is fp32)."""
    z_nV = z_nV.float()
    z_max, pred_n = z_nV.max(-1, keepdim=True)
    e_nV = torch.exp(z_nV - z_max)
    z_sum = e_nV.sum(-1, keepdim=True)
    z_lab = z_nV.gather(1, lab_n[:, None])
    ce_n = (z_max + z_sum.log() - z_lab).squeeze(1)
    if not need_grad:
        return ce_n, pred_n.squeeze(1), None
    onehot = torch.arange(z_nV.shape[1], device=z_nV.device)[None, :] == lab_n[:, None]
    d_nV = (e_nV * (w_n[:, None] / z_sum) - torch.where(onehot, w_n[:, None], 0.0)).to(grad_dtype)
    return ce_n, pred_n.squeeze(1), d_nV


_compiled_epilogue = None
EPILOGUES = ("auto", "triton", "compiled", "eager")


def resolve_epilogue(kind: str, cuda: bool) -> str:
    """The epilogue implementation for logits on CUDA or not: `ce_kernel`'s two-pass Triton kernel ("triton", the
    CUDA default where Triton imports), `_decay_epilogue` under torch.compile ("compiled") or eager ("eager", the
    default off CUDA). All compute the same values (tested against each other on the GPU). A choice this machine
    cannot run is an error."""
    if kind not in EPILOGUES:
        raise ValueError(f"loss epilogue must be one of {EPILOGUES}, got {kind!r}")
    if kind == "auto":
        return ("triton" if ce_kernel.available() else "compiled") if cuda else "eager"
    if kind != "eager" and not cuda:
        raise ValueError(f"loss epilogue {kind!r} needs a CUDA device; use 'auto' or 'eager' on the CPU")
    if kind == "triton" and not ce_kernel.available():
        raise ValueError("loss epilogue 'triton' needs Triton importable; install it or use 'auto'/'compiled'")
    return kind


def _epilogue(kind: str):
    """The function of a resolved epilogue kind (see `resolve_epilogue`)."""
    global _compiled_epilogue
    if kind == "eager":
        return _decay_epilogue
    if kind == "triton":
        return ce_kernel.ce_epilogue
    if _compiled_epilogue is None:
        _compiled_epilogue = torch.compile(_decay_epilogue, dynamic=False)
    return _compiled_epilogue


class _ChunkedBlockCE(torch.autograd.Function):
    """Over the scored slots only: h [X, K, H] and labels [X, K] of slots 1..L-1 (K = L-1), weights w [K]."""

    @staticmethod
    def forward(ctx, h_XKH, w_VH, labels_XK, slot_w_K, norm, chunk_blocks: int, dpace_alpha, need_grad: bool,
                epilogue: str, logits_dtype: torch.dtype, fp8_head: bool):
        X, K, H = h_XKH.shape
        head = Fp8Head.of(w_VH) if fp8_head else None

        def grad_into(d_nV, out_nH):  # dh = dlogits @ W
            if head is None:
                torch.mm(d_nV, w_VH, out=out_nH)
            else:
                out_nH.copy_(head.grad_input(d_nV))

        grad_XKH = torch.empty_like(h_XKH, memory_format=torch.contiguous_format) if need_grad else None
        valid_XK = labels_XK >= 0
        safe_XK = labels_XK.clamp(min=0)
        correct_XK = torch.empty(X, K, dtype=torch.bool, device=h_XKH.device)
        weight_XK = torch.empty(X, K, dtype=torch.float32, device=h_XKH.device)  # each slot's weight, as used
        loss = torch.zeros((), dtype=torch.float32, device=h_XKH.device)
        for c0 in range(0, X, chunk_blocks):
            c1 = min(c0 + chunk_blocks, X)
            lab_n = safe_XK[c0:c1].reshape(-1)
            val_n = valid_XK[c0:c1].reshape(-1)
            h_nH = h_XKH[c0:c1].reshape(-1, H)
            z_nV = head.logits(h_nH) if head is not None else _logits(h_nH, w_VH, logits_dtype)
            run = _epilogue(epilogue)
            if dpace_alpha is None:
                w_n = (slot_w_K * valid_XK[c0:c1]).reshape(-1)
                ce_n, pred_n, d_nV = run(z_nV, lab_n, w_n, need_grad, w_VH.dtype)
            else:  # D-PACE: the weights come from the chunk's own CE, so the epilogue runs twice: CE, then dlogits
                ce_n, pred_n, _ = run(z_nV, lab_n, val_n.float(), False, w_VH.dtype)
                q = torch.exp(-ce_n).view(c1 - c0, K)
                w_n = dpace_weights(q, valid_XK[c0:c1], dpace_alpha).reshape(-1)
                d_nV = run(z_nV, lab_n, w_n, True, w_VH.dtype)[2] if need_grad else None
            del z_nV
            correct_XK[c0:c1] = ((pred_n == lab_n) & val_n).view(c1 - c0, K)
            weight_XK[c0:c1] = w_n.view(c1 - c0, K)
            loss += (w_n * ce_n).sum()
            if need_grad:  # dlogits = w * (softmax - onehot), unnormalized; 1/norm is applied in backward
                grad_into(d_nV, grad_XKH[c0:c1].view(-1, H))
        ctx.mark_non_differentiable(correct_XK, weight_XK)
        if need_grad:
            ctx.save_for_backward(grad_XKH, norm)
        return loss / norm, correct_XK, weight_XK

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct, _grad_weight):
        grad_XKH, norm = ctx.saved_tensors
        return (grad_XKH.float() * (grad_loss / norm)).to(grad_XKH.dtype), None, None, None, None, None, None, None, None, \
            None, None


class BlockLoss(NamedTuple):
    loss: torch.Tensor  # scalar fp32, weighted mean CE
    correct_BAL: torch.Tensor  # bool, argmax == label (False where no label)
    valid_BAL: torch.Tensor  # bool, slot has a label
    norm: torch.Tensor  # scalar fp32, the denominator used
    weights_BAL: torch.Tensor  # fp32, each slot's weight in the loss (decay's or D-PACE's; 0 at slot 0 and unlabelled)


def _check(hidden_BQH, labels_BAL):
    B, A, L = labels_BAL.shape
    if hidden_BQH.shape[:2] not in ((B, A * L), (B, A * (L - 1))):
        raise ValueError(f"hidden {tuple(hidden_BQH.shape)} does not match labels {tuple(labels_BAL.shape)}: want "
                         f"[B, A*L, H] (every slot) or [B, A*(L-1), H] (slots 1.. only)")
    return B, A, L


def loss_weight(labels_BAL: torch.Tensor, gamma: float | None = None, weighting: str = "decay") -> torch.Tensor:
    """The loss weight of these labels (fp32, 0-dim): the sum of the slot weights of the labelled slots ("decay"),
    or the number of blocks with a label ("dpace"). `block_ce_loss` divides by it by default (floored at 1e-6);
    summed over an optimizer step, it gives the step's normalizer (`step_normalizer`)."""
    valid = labels_BAL >= 0
    if weighting == "dpace":
        return valid.any(-1).sum().float()
    return (valid * slot_weights(labels_BAL.shape[-1], gamma, labels_BAL.device)).sum()


def step_normalizer(weights: list[torch.Tensor], world: int) -> torch.Tensor:
    """The `normalizer` of every micro-batch of an optimizer step from the `loss_weight`s of this process's ones: the
    step's total over the `world` processes (all-reduced) / world, as their gradients are averaged (DDP, FSDP,
    `optim.fp32_allreduce_hook`): the averaged gradient is that of the step's weighted CE / its total weight, however
    its rows are split (SpecForge's rule). Floored at 1e-6: a step without a label has loss 0."""
    total = torch.stack(list(weights)).sum()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(total)  # (sum)
    return (total / world).clamp(min=1e-6)


def _norm(labels_BAL, gamma, weighting: str, normalizer):
    if normalizer is not None:
        return torch.as_tensor(normalizer, dtype=torch.float32, device=labels_BAL.device)
    return loss_weight(labels_BAL, gamma, weighting).clamp(min=1e-6)


def block_ce_loss(
    hidden_BQH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_BAL: torch.Tensor,
    *,
    gamma: float | None = None,
    weighting: str = "decay",
    dpace_alpha: float = 0.5,
    chunk_tokens: int = 8192,
    normalizer: torch.Tensor | float | None = None,
    epilogue: str = "auto",
    logits: str = "fp32",
) -> BlockLoss:
    """Chunked weighted CE of the drafter's block outputs [B, A*L, H] against labels [B, A, L] (IGNORE = none).
    The outputs may also be given for the scored slots only, [B, A*(L-1), H] (slots 1..L-1 of each block, as
    `DFlashDrafter.forward(scored_only=True)` returns them).

    `chunk_tokens` bounds the query tokens per chunk (rounded down to whole blocks of L-1 scored slots): the
    logits buffer is chunk_tokens x V x 4 bytes (2 with `logits="bf16"`). `normalizer` overrides the denominator
    (training passes its optimizer step's, `step_normalizer`); by default it is this batch's `loss_weight`.
    `epilogue` picks the epilogue's implementation (`resolve_epilogue`; D-PACE runs it twice a chunk).
    `logits` is the dtype the chunk's logits are stored in, "fp32" or "bf16" (`LOGITS_DTYPES`; the epilogue computes
    in fp32 either way), or "fp8": both lm_head GEMMs in float8 (`Fp8Head`), bf16 logits.
    """
    B, A, L = _check(hidden_BQH, labels_BAL)
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"weighting must be 'decay' or 'dpace', got {weighting!r}")
    if logits not in LOGITS_DTYPES:
        raise ValueError(f"logits must be one of {tuple(LOGITS_DTYPES)}, got {logits!r}")
    dpace = weighting == "dpace"
    epilogue = resolve_epilogue(epilogue, hidden_BQH.is_cuda)
    slot_w_L = slot_weights(L, gamma, labels_BAL.device) if not dpace else torch.ones(L, device=labels_BAL.device)
    norm = _norm(labels_BAL, gamma, weighting, normalizer)
    chunk_blocks = max(1, chunk_tokens // (L - 1))
    h_XKH = hidden_BQH.reshape(B * A, -1, hidden_BQH.shape[-1])
    if h_XKH.shape[1] == L:
        h_XKH = h_XKH[:, 1:]  # slot 0 is never scored
    loss, correct_XK, weight_XK = _ChunkedBlockCE.apply(
        h_XKH,
        lm_head_VH,
        labels_BAL.reshape(B * A, L)[:, 1:],
        slot_w_L[1:],
        norm,
        chunk_blocks,
        dpace_alpha if dpace else None,
        torch.is_grad_enabled() and hidden_BQH.requires_grad,
        epilogue,
        LOGITS_DTYPES[logits],
        logits == "fp8",
    )
    correct_BAL = torch.cat([torch.zeros_like(correct_XK[:, :1]), correct_XK], 1).view(B, A, L)
    weights_BAL = torch.cat([torch.zeros_like(weight_XK[:, :1]), weight_XK], 1).view(B, A, L)
    return BlockLoss(loss, correct_BAL, labels_BAL >= 0, norm, weights_BAL)


def reference_block_ce_loss(
    hidden_BQH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_BAL: torch.Tensor,
    *,
    gamma: float | None = None,
    weighting: str = "decay",
    dpace_alpha: float = 0.5,
    normalizer: torch.Tensor | float | None = None,
    logits: str = "fp32",
) -> BlockLoss:
    """Plain version of `block_ce_loss` (full logits, F.cross_entropy, autograd); for tests only. Every slot.
    `logits="bf16"` rounds the logits' values to bf16 (their gradient passes through in fp32)."""
    B, A, L = _check(hidden_BQH, labels_BAL)
    if hidden_BQH.shape[1] != A * L:
        raise ValueError("reference_block_ce_loss wants the outputs of every slot, [B, A*L, H]")
    dpace = weighting == "dpace"
    slot_w_L = slot_weights(L, gamma, labels_BAL.device) if not dpace else torch.ones(L, device=labels_BAL.device)
    norm = _norm(labels_BAL, gamma, weighting, normalizer)
    z = hidden_BQH.reshape(B * A * L, -1).float() @ lm_head_VH.float().t()  # exact products, fp32 sums
    if logits != "fp32":
        z = z + (z.to(LOGITS_DTYPES[logits]).float() - z).detach()
    flat = labels_BAL.reshape(-1)
    ce = torch.nn.functional.cross_entropy(z, flat, ignore_index=IGNORE, reduction="none").view(B, A, L)
    valid = labels_BAL >= 0
    if dpace:
        w = dpace_weights(torch.exp(-ce.detach()), valid, dpace_alpha)
    else:
        w = slot_w_L * valid
    correct = (z.argmax(-1) == flat).view(B, A, L) & valid
    return BlockLoss((w * ce).sum() / norm, correct, valid, norm, w.detach().float())


# --- metrics ---------------------------------------------------------------------------------------------


def slot_counts(correct_BAL: torch.Tensor, valid_BAL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct [L], labelled [L]) summed over blocks: sum these across steps/ranks, then divide."""
    return correct_BAL.sum((0, 1)), valid_BAL.sum((0, 1))


def slot_accuracy(correct_L: torch.Tensor, total_L: torch.Tensor) -> torch.Tensor:
    """Per-slot accuracy [L] (fp32); NaN for slot 0 and for slots without labels."""
    acc_L = correct_L.float() / total_L.clamp(min=1)
    return torch.where(total_L > 0, acc_L, torch.full_like(acc_L, math.nan))


def simulated_acceptance_length(acc_L: torch.Tensor) -> torch.Tensor:
    """sum_{k>=1} prod_{1<=i<=k} acc_i over slots 1..L-1 (slot 0 ignored; a NaN slot counts as 0)."""
    return torch.cumprod(torch.nan_to_num(acc_L[1:].float(), nan=0.0), 0).sum()


def block_tau(correct_BAL: torch.Tensor) -> torch.Tensor:
    """Per-block teacher-forced tau [B, A] = 1 + number of leading correct slots from slot 1.

    A slot without a label is not correct, so a block ends its run at a document/row end.
    """
    return 1 + torch.cumprod(correct_BAL[..., 1:].long(), -1).sum(-1)


def mean_tau(correct_BAL: torch.Tensor, keep_BA: torch.Tensor) -> torch.Tensor:
    """Mean per-block tau over kept anchors."""
    tau = block_tau(correct_BAL).float()
    return (tau * keep_BA).sum() / keep_BA.sum().clamp(min=1)
