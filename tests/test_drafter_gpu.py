"""GPU: compiled flex path == dense SDPA path at bf16 tolerance on realistic shapes; chunked loss == reference.

Run with `pytest -m gpu tests/test_drafter_gpu.py` on a CUDA machine (torch >= 2.11). Errors are judged against an
fp32 dense run of the same weights: the flex path must be about as close to it as the bf16 dense path is.
"""

import pytest
import torch

from dflash_offline.anchors import block_labels, sample_anchors
from dflash_offline.drafter import DFlashDrafter, DrafterConfig
from dflash_offline.loss import block_ce_loss, reference_block_ce_loss
from dflash_offline.masks import dense_mask, flex_block_mask, make_mask_mod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

B, S, H, A, L, V = 2, 2048, 1024, 128, 16, 32000
DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def packed(seed):
    """Rows of 3-6 documents (lengths 150..900) and a padding tail; first 20% of each doc unsupervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    doc = torch.full((B, S), -1)
    pos = torch.zeros(B, S, dtype=torch.long)
    lm = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        start, d = 0, 0
        while True:
            n = int(torch.randint(150, 900, (1,), generator=g))
            if start + n > S - 40:
                break
            doc[b, start : start + n] = d
            pos[b, start : start + n] = torch.arange(n)
            lm[b, start + n // 5 : start + n] = 1
            start, d = start + n, d + 1
    return [t.to(DEV) for t in (ids, lm, doc, pos)]


def config(block_attention="causal"):
    return DrafterConfig(
        hidden_size=H, intermediate_size=3072, vocab_size=V, target_layer_ids=[1, 9, 17], num_target_layers=28,
        mask_token_id=V - 1, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, rope_theta=1e6,
        block_size=L, sliding_window=512, layer_types=["full_attention", "sliding_attention"],
        block_attention=block_attention,
    )


@pytest.mark.parametrize("W, causal", [(None, True), (512, True), (512, False)])
def test_compiled_block_mask_equals_dense(W, causal):
    ids, lm, doc, pos = packed(0)
    anc, keep = sample_anchors(lm, doc, A, L, torch.Generator(DEV).manual_seed(0))
    keep[1, -5:] = False  # some dropped anchors
    dense = dense_mask(anc, keep, doc, L, W, causal)
    Q = A * L
    grid = torch.nn.attention.flex_attention.create_mask(make_mask_mod(anc, keep, doc, L, W, block_causal=causal),
                                                         B, 1, Q, S + Q, DEV)
    assert torch.equal(grid, dense)
    for context_only, K in ((True, S), (False, S + Q)):  # the split path's context-only mask, and the full one
        bm = flex_block_mask(anc, keep, doc, L, W, context_only=context_only, block_causal=causal)  # compiled
        tiles = dense[..., :K].view(B, 1, Q // 128, 128, K // 128, 128).any(-1).any(-2)
        assert torch.equal(bm.to_dense().bool(), tiles)
    # new anchors, same shapes: no recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            anc2, keep2 = sample_anchors(lm, doc, A, L, torch.Generator(DEV).manual_seed(seed))
            flex_block_mask(anc2, keep2, doc, L, W, block_causal=causal)


def fwd_bwd(fn, model, batch, embed, masks, attn, R):
    """Output and parameter grads of `fn` (the module or its compiled wrapper) for loss = sum(out * R)."""
    ids, lm, doc, pos, hidden, anc, keep = batch
    out = fn(hidden, ids, pos, anc, keep, embed, masks, attn=attn)
    model.zero_grad(set_to_none=True)
    (out.float() * R).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
def test_flex_compiled_equals_dense_forward_and_backward(block_attention):
    attn = "flex"
    torch.manual_seed(0)
    cfg = config(block_attention)
    ref_model = DFlashDrafter(cfg).to(DEV)  # fp32 dense: ground truth
    model = DFlashDrafter(cfg).to(DEV, torch.bfloat16)
    model.load_state_dict(ref_model.state_dict())
    embed = torch.randn(V, H, device=DEV)
    ids, lm, doc, pos = packed(1)
    hidden = torch.randn(B, S, 3 * H, device=DEV)
    anc, keep = sample_anchors(lm, doc, A, L, torch.Generator(DEV).manual_seed(0))
    keep[0, -3:] = False
    R = torch.randn(B, A * L, H, device=DEV)
    batch32 = [ids, lm, doc, pos, hidden, anc, keep]
    batch16 = [ids, lm, doc, pos, hidden.bfloat16(), anc, keep]

    dense = model.build_masks(doc, anc, keep, "dense")
    out32, g32 = fwd_bwd(ref_model, ref_model, batch32, embed, dense, "dense", R)
    out_d, g_d = fwd_bwd(model, model, batch16, embed.bfloat16(), dense, "dense", R)
    compiled = torch.compile(model, dynamic=False)
    flex = model.build_masks(doc, anc, keep, attn)
    out_f, g_f = fwd_bwd(compiled, model, batch16, embed.bfloat16(), flex, attn, R)
    assert torch.isfinite(out_f).all()

    e_dense, e_flex = rel(out_d, out32), rel(out_f, out32)
    assert e_flex < 1.5 * e_dense + 1e-3, (e_flex, e_dense)
    assert rel(out_f, out_d) < 2e-2
    for n in g32:
        ed, ef = rel(g_d[n], g32[n]), rel(g_f[n], g32[n])
        assert ef < 1.5 * ed + 2e-3, (n, ef, ed)

    # resampled anchors (new masks, same shapes) run without recompiling
    anc2, keep2 = sample_anchors(lm, doc, A, L, torch.Generator(DEV).manual_seed(1))
    flex2 = model.build_masks(doc, anc2, keep2, attn)
    batch2 = [ids, lm, doc, pos, hidden.bfloat16(), anc2, keep2]
    with torch._dynamo.config.patch(error_on_recompile=True):
        fwd_bwd(compiled, model, batch2, embed.bfloat16(), flex2, attn, R)


@pytest.mark.parametrize("epilogue,weighting,logits", [("triton", "decay", "fp32"), ("compiled", "decay", "fp32"),
                                                        ("triton", "dpace", "fp32"), ("compiled", "dpace", "fp32"),
                                                        ("triton", "decay", "bf16"), ("compiled", "decay", "bf16"),
                                                        ("triton", "dpace", "bf16"), ("compiled", "dpace", "bf16")])
def test_chunked_loss_equals_reference_on_gpu(epilogue, weighting, logits):
    Vb, Hb = 151936, 1024
    g = torch.Generator(DEV).manual_seed(0)
    ids, lm, doc, pos = packed(2)
    anc, keep = sample_anchors(lm, doc, A, L, g)
    labels = block_labels(ids % Vb, lm, doc, anc, keep, L)
    hidden = torch.randn(B, A * L, Hb, device=DEV, generator=g).bfloat16()
    w = (torch.randn(Vb, Hb, device=DEV, generator=g) * 0.05).bfloat16()
    # every other block's labelled slots made likely (p(label) 0.8-0.99), the others left near 1/V: D-PACE's weights
    # then hang on q, where with q near 0 everywhere they would be alpha's powers alone and a kernel that lost the
    # q -> weight link would still pass
    lab = labels.reshape(B, A * L)
    strong = (lab >= 0) & (torch.arange(A * L, device=DEV) // L % 2 == 0)
    hidden = torch.where(strong[..., None], 6.0 * w.float()[lab.clamp(min=0)], hidden.float()).bfloat16()
    q = torch.log_softmax(hidden[strong].float() @ w.float().T, -1).gather(1, lab[strong][:, None]).exp()
    assert float(q.median()) > 0.5 and 0.2 < float(strong.sum() / (lab >= 0).sum()) < 0.8
    del q
    h1 = hidden.clone().requires_grad_(True)
    ref = reference_block_ce_loss(h1, w, labels, weighting=weighting, logits=logits)
    ref.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    out = block_ce_loss(h2, w, labels, weighting=weighting, chunk_tokens=1000,  # 66 blocks a chunk, not divisible
                        epilogue=epilogue, logits=logits)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-4)
    assert h2.grad.dtype == torch.bfloat16
    assert rel(h2.grad, h1.grad) < 1e-2
    mismatch = (out.correct_BAL != ref.correct_BAL).float().mean().item()
    assert mismatch < 1e-3  # argmax ties/rounding only
    # each slot's weight as used (DFlash2's selector CE takes them): D-PACE's from q = exp(-CE), a product of up to 15
    # factors (1 - α)q + α, each q within the CE's rounding of the reference's
    torch.testing.assert_close(out.weights_BAL, ref.weights_BAL, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("V_,dtype", [(248320, torch.float32), (1000, torch.float32), (4096 * 3, torch.float32),
                                      (248320, torch.bfloat16), (1000, torch.bfloat16)])
def test_triton_epilogue_equals_eager(V_, dtype):
    """The two-pass kernel == `_decay_epilogue` on fp32 or bf16 logits: CE to fp32 rounding, the same argmax (bf16,
    where ties are common: the kernel's first column of the max, a column of the max for torch's), dlogits to one
    bf16 rounding; a vocabulary that is and is not a multiple of the kernel's block; no gradient asked."""
    from dflash_offline import ce_kernel
    from dflash_offline.loss import _decay_epilogue

    g = torch.Generator(DEV).manual_seed(V_)
    n = 300
    z = torch.randn(n, V_, device=DEV, generator=g) * 4
    z[:, 7] += 30  # some rows with one dominant logit (softmax ~ onehot), as a trained model has
    z[::2, 7] -= 30
    lab = torch.randint(0, V_, (n,), device=DEV, generator=g)
    lab[::3] = 7
    w = torch.rand(n, device=DEV, generator=g)
    w[::5] = 0.0  # unlabelled slots
    z = z.to(dtype)
    ce, pred, d = ce_kernel.ce_epilogue(z, lab, w, True, torch.bfloat16)
    ce_r, pred_r, d_r = _decay_epilogue(z, lab, w, True, torch.bfloat16)
    torch.testing.assert_close(ce, ce_r, rtol=1e-5, atol=1e-4)
    if dtype == torch.float32:
        assert torch.equal(pred, pred_r)
    else:
        top = z == z.max(-1, keepdim=True).values
        assert torch.equal(pred, top.int().argmax(-1))  # the kernel keeps the first column of the max
        assert top.gather(1, pred_r[:, None]).all()
    torch.testing.assert_close(d.float(), d_r.float(), rtol=2 ** -7, atol=1e-6)
    assert (d[::5] == 0).all()
    ce2, pred2, d2 = ce_kernel.ce_epilogue(z, lab, w, False, torch.bfloat16)
    assert d2 is None and torch.equal(pred2, pred)
    torch.testing.assert_close(ce2, ce, rtol=1e-5, atol=1e-5)  # another compiled variant: last-bit differences
