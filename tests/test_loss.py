"""Chunked single-pass lm_head + CE equals the plain full-logits loss, in value, gradient and accuracy."""

import math

import pytest
import torch
from equivalence import check, loss_rtol, rel_distance, scalar_rtol

from dflash_offline.anchors import IGNORE
from dflash_offline.loss import (
    block_ce_loss,
    block_tau,
    dpace_weights,
    mean_tau,
    reference_block_ce_loss,
    simulated_acceptance_length,
    slot_accuracy,
    slot_counts,
    slot_weights,
)

B, A, L, H, V = 2, 5, 4, 16, 50


def make(seed=0, dtype=torch.float32, p_ignore=0.3):
    """Hidden states, lm_head and block labels. The values are multiples of 1/8 (and exact in bf16), so every logit
    is exact in fp32 whatever order a GEMM sums in: the chunked and the full loss see the same logits (bf16-rounded
    alike, too, where a rounding boundary would otherwise split them) and differ only by their own sums."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, A * L, H, generator=g) * 8).round().div(8).to(dtype)
    w = (torch.randn(V, H, generator=g) * 4).round().div(8).to(dtype)
    labels = torch.randint(0, V, (B, A, L), generator=g)
    labels[torch.rand(B, A, L, generator=g) < p_ignore] = IGNORE
    labels[:, :, 0] = IGNORE
    labels[1, 2] = IGNORE  # a dropped anchor
    # make some predictions right so accuracy counts are not all zero
    logits_argmax = (hidden.float() @ w.float().t()).argmax(-1).view(B, A, L)
    fix = (torch.rand(B, A, L, generator=g) < 0.4) & (labels >= 0)
    labels[fix] = logits_argmax[fix]
    return hidden, w, labels


def run(fn, hidden, w, labels, **kw):
    h = hidden.clone().requires_grad_(True)
    out = fn(h, w, labels, **kw)
    out.loss.backward()
    return out, h.grad


def assert_same_loss(out, g, ref, g_ref):
    """The same logits, CE and weights summed in chunks or at once: the loss within λ·u·(√slots + √V) and the input
    gradient (each element a sum over V whose terms cancel) in norm within λ·V·u (tests/equivalence.py): 3.7e-6 and
    1.5e-5; measured ≤ 2.3e-7 and 2.3e-7 on an AMD EPYC, torch 2.13."""
    check("loss", abs(float(out.loss) / float(ref.loss) - 1), loss_rtol(B * A * (L - 1), V))
    check("input gradient", rel_distance(g, g_ref), scalar_rtol(V))


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 9, 1000])  # 1, 1, 2, 3 (10 blocks: not divisible), all
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_chunked_equals_reference(chunk_tokens, weighting):
    hidden, w, labels = make()
    kw = dict(gamma=2.0, weighting=weighting)
    ref, g_ref = run(reference_block_ce_loss, hidden, w, labels, **kw)
    out, g = run(block_ce_loss, hidden, w, labels, chunk_tokens=chunk_tokens, **kw)
    assert_same_loss(out, g, ref, g_ref)
    assert torch.equal(out.correct_BAL, ref.correct_BAL)
    assert torch.equal(out.valid_BAL, labels >= 0)
    assert out.correct_BAL.any()  # the comparison is not vacuous
    # the weights each slot had in the loss (DFlash2's selector CE takes them): the reference's, 0 where unlabelled
    torch.testing.assert_close(out.weights_BAL, ref.weights_BAL, rtol=1e-5, atol=1e-7)
    assert not out.weights_BAL[labels < 0].any() and out.weights_BAL[labels >= 0].min() > 0


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_bf16_logits_equal_reference_on_rounded_logits(weighting):
    """`logits="bf16"`: the CE, accuracy and input gradient of the logits rounded to bf16, and a visible change from
    fp32 logits (the option is not a no-op)."""
    hidden, w, labels = make()
    kw = dict(gamma=2.0, weighting=weighting)
    ref, g_ref = run(reference_block_ce_loss, hidden, w, labels, logits="bf16", **kw)
    out, g = run(block_ce_loss, hidden, w, labels, chunk_tokens=7, logits="bf16", **kw)
    assert_same_loss(out, g, ref, g_ref)
    assert torch.equal(out.correct_BAL, ref.correct_BAL) and out.correct_BAL.any()
    full, g_full = run(block_ce_loss, hidden, w, labels, chunk_tokens=7, **kw)
    assert (out.loss - full.loss).abs() > 1e-5 and (g - g_full).abs().max() > 1e-6
    torch.testing.assert_close(out.loss, full.loss, rtol=2e-3, atol=0)  # ... and a small one
    with pytest.raises(ValueError, match="logits must be one of"):
        block_ce_loss(hidden, w, labels, logits="fp16")


def test_reference_is_weighted_cross_entropy():
    hidden, w, labels = make(1)
    out = block_ce_loss(hidden, w, labels, gamma=3.0)
    logits = hidden.view(-1, H) @ w.t()
    ce = torch.nn.functional.cross_entropy(logits, labels.view(-1).clamp(min=0), reduction="none").view(B, A, L)
    k = torch.arange(L)
    wk = torch.where(k >= 1, torch.exp(-(k - 1) / 3.0), 0.0) * (labels >= 0)
    torch.testing.assert_close(out.loss, (wk * ce).sum() / wk.sum())


def test_slot_weights_values():
    w16 = slot_weights(16)
    assert w16[0] == 0 and w16[1] == 1
    torch.testing.assert_close(w16[2], torch.tensor(math.exp(-1 / 7)))
    torch.testing.assert_close(w16[15], torch.tensor(math.exp(-14 / 7)))
    torch.testing.assert_close(slot_weights(8)[3], torch.tensor(math.exp(-2 / 4)))
    with pytest.raises(ValueError, match="gamma"):
        slot_weights(12)
    torch.testing.assert_close(slot_weights(12, gamma=5.0)[6], torch.tensor(math.exp(-1.0)))


def test_slot0_is_never_scored():
    hidden, w, labels = make(2)
    base = block_ce_loss(hidden, w, labels, gamma=2.0, chunk_tokens=4).loss
    h = hidden.clone().view(B, A, L, H)
    h[:, :, 0] = float("nan")  # slot-0 logits are never computed, so NaN there cannot leak
    lab = labels.clone()
    lab[:, :, 0] = 3  # even a label at slot 0 carries no loss
    hq = h.view(B, A * L, H).requires_grad_(True)
    out = block_ce_loss(hq, w, lab, gamma=2.0, chunk_tokens=4)
    torch.testing.assert_close(out.loss, base)
    out.loss.backward()
    assert torch.all(hq.grad.view(B, A, L, H)[:, :, 0] == 0)
    assert torch.isfinite(hq.grad).all()
    assert not out.correct_BAL[:, :, 0].any()


def test_normalizer_override_and_no_grad():
    hidden, w, labels = make(3)
    out = block_ce_loss(hidden, w, labels, gamma=2.0)
    scaled = block_ce_loss(hidden, w, labels, gamma=2.0, normalizer=out.norm * 4)
    torch.testing.assert_close(scaled.loss * 4, out.loss)
    with torch.no_grad():
        ng = block_ce_loss(hidden.requires_grad_(True), w, labels, gamma=2.0)
    torch.testing.assert_close(ng.loss, out.loss)


def test_all_ignored_gives_zero_loss_and_grad():
    hidden, w, labels = make(4)
    labels[:] = IGNORE
    out, g = run(block_ce_loss, hidden, w, labels, gamma=2.0)
    assert out.loss == 0 and torch.all(g == 0)


def test_bf16_close_to_fp32_reference():
    hidden, w, labels = make(5)
    ref, g_ref = run(reference_block_ce_loss, hidden, w, labels, gamma=2.0)
    out, g = run(block_ce_loss, hidden.bfloat16(), w.bfloat16(), labels, gamma=2.0, chunk_tokens=5)
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g.float(), g_ref, rtol=5e-2, atol=5e-3)


def test_dpace_weights_formula():
    q = torch.tensor([[0.0, 0.5, 0.2, 0.9]])
    valid = torch.tensor([[False, True, True, True]])
    alpha = 0.5
    s1, s2, s3 = 0.75, 0.6, 0.95
    p1, p2, p3 = s1, s1 * s2, s1 * s2 * s3
    expect = torch.tensor([[0.0, p1 + p2 + p3, p2 + p3, p3]])
    torch.testing.assert_close(dpace_weights(q, valid, alpha), expect)
    valid2 = torch.tensor([[False, True, False, True]])  # an invalid slot: factor 1 in the product, no term
    expect2 = torch.tensor([[0.0, p1 + s1 * 1 * s3, 0.0, s1 * s3]])
    torch.testing.assert_close(dpace_weights(q, valid2, alpha), expect2)


def test_metrics():
    correct = torch.tensor([[[False, True, True, False, True], [False, False, True, True, True]]])
    valid = torch.tensor([[[False, True, True, True, True], [False, True, True, True, False]]])
    assert block_tau(correct).tolist() == [[3, 1]]
    torch.testing.assert_close(mean_tau(correct, torch.tensor([[True, False]])), torch.tensor(3.0))
    c, t = slot_counts(correct & valid, valid)
    assert c.tolist() == [0, 1, 2, 1, 1] and t.tolist() == [0, 2, 2, 2, 1]
    acc = slot_accuracy(c, t)
    assert math.isnan(acc[0]) and acc[1:].tolist() == [0.5, 1.0, 0.5, 1.0]
    # sum_k prod_{i<=k} acc_i = 0.5 + 0.5 + 0.25 + 0.25
    torch.testing.assert_close(simulated_acceptance_length(acc), torch.tensor(1.5))


def _fp8_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    Bq, Aq, Lq, Hq, Vq = 2, 6, 16, 64, 512  # float8 GEMMs want H and V multiples of 16
    hidden = torch.randn(Bq, Aq * Lq, Hq, generator=g)
    hidden[..., 3] *= 20  # an outlier channel, as the drafter's outputs have
    w = torch.randn(Vq, Hq, generator=g) * 0.2
    labels = torch.randint(0, Vq, (Bq, Aq, Lq), generator=g)
    labels[:, :, 0] = IGNORE
    fix = torch.rand(Bq, Aq, Lq, generator=g) < 0.5
    labels[fix] = (hidden @ w.t()).argmax(-1).view(Bq, Aq, Lq)[fix]
    labels[:, :, 0] = IGNORE
    return hidden, w, labels


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_fp8_head_gemms_are_the_dequantized_products(device):
    """`Fp8Head`: the logits are (h8·s_h)(W8·s_V)ᵀ with per-row scales and the input gradient (d8·s_d)(W8·s_w) with one
    scale each, up to the bf16 output's rounding: a wrong scale orientation or a transposed operand fails here. On
    CUDA as training runs it: a bf16 head, bf16 hidden states and dlogits, cuBLAS's float8 GEMMs."""
    from dflash_offline.loss import Fp8Head, _rowwise_e4m3

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, w, _ = _fp8_case()
    h, w = hidden.reshape(-1, hidden.shape[-1]).to(device, dtype), w.to(device, dtype)
    head = Fp8Head(w)
    h8, s_h = _rowwise_e4m3(h)
    want = (h8.float() * s_h) @ (head.w8_VH.float() * head.s_1V.t()).t()
    torch.testing.assert_close(head.logits(h).float(), want, rtol=1e-2, atol=1e-2)
    exact = h.float() @ w.float().t()
    d = (torch.softmax(exact, -1) - torch.nn.functional.one_hot(torch.arange(h.shape[0], device=device) % w.shape[0],
                                                                w.shape[0])).to(dtype)
    got = head.grad_input(d.clone()).float()  # (it consumes its argument)
    s_d = d.float().abs().amax() / torch.finfo(torch.float8_e5m2).max
    d8 = d.clone().mul_(1 / s_d).to(torch.float8_e5m2)  # scaled in d's dtype, as grad_input scales it (bf16 on CUDA)
    want = (d8.float() * s_d) @ (head.w8_HV.float() * head.s_w).t()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    # … and close to the exact products, not equal to them (it is float8)
    assert 0 < (head.logits(h).float() - exact).abs().max() < 0.1 * exact.abs().max()
    assert torch.nn.functional.cosine_similarity(got.flatten(), (d.float() @ w.float()).flatten(), dim=0) > 0.999


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_fp8_logits_train_like_fp32(weighting):
    """`logits="fp8"` (both lm_head GEMMs in float8): loss within 2 % of the fp32 loss, input gradient at cosine ≥ 0.99
    and ≤ 10 % relative error, top-1 agreeing on ≥ 90 % of the scored slots — and not the fp32 result itself.
    (Measured on seeds 1–3, both weightings: loss 0.05–0.5 % off, gradient cosine 0.997–0.998 and 6–7 % relative
    error, top-1 agreeing on 95–97 %.)"""
    hidden, w, labels = _fp8_case(1)
    kw = dict(gamma=7.0, weighting=weighting, chunk_tokens=60)  # several chunks, not a multiple of 15 scored slots
    ref, g_ref = run(block_ce_loss, hidden, w, labels, **kw)
    out, g = run(block_ce_loss, hidden, w, labels, logits="fp8", **kw)
    assert out.loss != ref.loss
    assert abs(out.loss.item() / ref.loss.item() - 1) < 0.02
    assert torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0) > 0.99
    assert (g - g_ref).norm() / g_ref.norm() < 0.1
    v = out.valid_BAL
    assert (out.correct_BAL[v] == ref.correct_BAL[v]).float().mean() > 0.9 and ref.correct_BAL.any()


def test_fp8_head_is_quantized_once_per_weight():
    from dflash_offline.loss import Fp8Head

    _, w, _ = _fp8_case()
    a = Fp8Head.of(w)
    assert Fp8Head.of(w) is a
    w.mul_(2)  # an in-place change (a new version) is seen
    b = Fp8Head.of(w)
    assert b is not a and torch.equal(b.w8_VH, Fp8Head(w).w8_VH)
    w.data = w.data * 3  # other storage, same tensor and version: seen by its address
    b3 = Fp8Head.of(w)
    assert b3 is not b and torch.equal(b3.w8_VH, Fp8Head(w).w8_VH)
    b = b3
    # the cache lets go when the weight is freed (a new tensor at its address is another weight)
    del w
    assert Fp8Head._cache is None
    w2 = torch.randn(512, 64) * 3
    c = Fp8Head.of(w2)
    assert c is not b and torch.equal(c.w8_VH, Fp8Head(w2).w8_VH)


def test_fp8_head_quantized_in_row_blocks_equals_at_once(monkeypatch):
    from dflash_offline import loss

    _, w, _ = _fp8_case()
    whole = loss.Fp8Head(w)
    monkeypatch.setattr(loss, "ROWS_AT_ONCE", 100)  # 512 rows: 6 blocks, the last one short
    parts = loss.Fp8Head(w)
    for name in ("w8_VH", "s_1V", "s_w", "w8_HV"):
        assert torch.equal(getattr(parts, name).float(), getattr(whole, name).float()), name
