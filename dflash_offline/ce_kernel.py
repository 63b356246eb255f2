"""The CE epilogue of one lm_head chunk as a two-pass Triton kernel (CUDA; see `loss.py`).

From fp32 (or bf16) logits z [n, V] it gives, per row: ce = logsumexp(z) - z[label], the argmax, and (for the
backward) dlogits = w * (softmax(z) - onehot(label)) in bf16. The logits are the largest tensor of a training step
(n x V x 4 bytes in fp32, ~7.6 GB at 27B shapes), so the epilogue is bound by how often it reads them: pass 1
reads each row once with an online (running-max) softmax that also tracks the argmax; pass 2 reads it again and
writes dlogits. That is two reads and one bf16 write, where the compiled elementwise version reads the logits three
times.

One program per row; each lane keeps its own running max, rescaled sum and first index of its max, and the lanes
are combined at the end. Same arithmetic as `loss._decay_epilogue` (fp32 throughout; `tl.exp` like inductor's).
Only imported where Triton is (`available()`).
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # columns per iteration (fp32: 16 KB per program in flight)
NUM_WARPS = 8


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(z_ptr, lab_ptr, w_ptr, ce_ptr, pred_ptr, d_ptr, stride_z, stride_d, V: tl.constexpr,
                NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_z
        offs = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        m = tl.full([BLOCK], neg_inf, tl.float32)  # per-lane running max
        s = tl.zeros([BLOCK], tl.float32)  # per-lane sum of exp(z - m)
        idx = tl.zeros([BLOCK], tl.int32)  # per-lane first column holding m
        for start in tl.range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(z_row + cols, mask=cols < V, other=neg_inf).to(tl.float32)
            m_new = tl.maximum(m, x)
            idx = tl.where(x > m, cols, idx)
            seen = m_new != neg_inf  # a lane that has only seen padding keeps s = 0 (no inf - inf)
            s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        mx = tl.max(m, 0)
        total = tl.sum(tl.where(m != neg_inf, s * tl.exp(m - mx), 0.0), 0)
        pred = tl.min(tl.where(m == mx, idx, V), 0)
        lab = tl.load(lab_ptr + row)
        ce = mx + tl.log(total) - tl.load(z_row + lab).to(tl.float32)
        tl.store(ce_ptr + row, ce)
        tl.store(pred_ptr + row, pred.to(tl.int64))
        if NEED_GRAD:
            w = tl.load(w_ptr + row)
            scale = w / total
            d_row = d_ptr + row * stride_d
            for start in tl.range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(z_row + cols, mask=cols < V, other=neg_inf).to(tl.float32)
                d = tl.exp(x - mx) * scale - tl.where(cols == lab, w, 0.0)
                tl.store(d_row + cols, d.to(d_ptr.dtype.element_ty), mask=cols < V)

    return ce_rows


def ce_epilogue(z_nV: torch.Tensor, lab_n: torch.Tensor, w_n: torch.Tensor, need_grad: bool, grad_dtype,
                block: int = BLOCK, num_warps: int = NUM_WARPS):
    """(ce_n fp32, argmax_n int64, dlogits_nV in grad_dtype or None) of fp32 or bf16 logits (read as fp32); see the
    module doc."""
    n, V = z_nV.shape
    if z_nV.dtype not in (torch.float32, torch.bfloat16) or z_nV.stride(1) != 1:
        raise ValueError(f"ce_epilogue wants fp32 or bf16 logits with contiguous rows, got {z_nV.dtype} "
                         f"{z_nV.stride()}")
    lab_n, w_n = lab_n.contiguous(), w_n.float().contiguous()
    ce = torch.empty(n, dtype=torch.float32, device=z_nV.device)
    pred = torch.empty(n, dtype=torch.int64, device=z_nV.device)
    d = torch.empty((n, V), dtype=grad_dtype, device=z_nV.device) if need_grad else None
    if n:
        _kernel()[(n,)](z_nV, lab_n, w_n, ce, pred, d if need_grad else ce, z_nV.stride(0),
                        d.stride(0) if need_grad else 0, V=V, NEED_GRAD=need_grad, BLOCK=block, num_warps=num_warps)
    return ce, pred, d
