"""The drafter against an independent per-anchor reference, the training mask, the z-lab key names."""

import json
import math

import pytest
import torch
from equivalence import check, forward_rtol, rel_distance, scalar_rtol, step_terms
from safetensors.torch import save_file
from torch.nn.attention.flex_attention import create_mask

from dflash_offline.drafter import (
    DFlashDrafter,
    DrafterConfig,
    expand_heads,
    load_target_embeddings,
    split_attention,
)
from dflash_offline.masks import block_allow, dense_mask, flex_block_mask, make_mask_mod

H, S, A, L, V, MASK = 64, 64, 6, 4, 100, 97
TAPS = [0, 2, 4]


def config(**kw):
    base = dict(
        hidden_size=H, intermediate_size=96, vocab_size=V, target_layer_ids=TAPS, num_target_layers=6,
        mask_token_id=MASK, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, block_size=L,
    )
    return DrafterConfig(**(base | kw))


def packed_batch(seed=0):
    """Two rows: docs [20, 30, 10] + 4 pad, and [40, 24]. Loss mask: the second half of every doc."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 4, (2, S), generator=g)
    doc = torch.full((2, S), -1)
    pos = torch.zeros(2, S, dtype=torch.long)
    lm = torch.zeros(2, S)
    for b, lens in enumerate([[20, 30, 10], [40, 24]]):
        start = 0
        for d, n in enumerate(lens):
            doc[b, start : start + n] = d
            pos[b, start : start + n] = torch.arange(n)
            lm[b, start + n // 2 : start + n] = 1
            start += n
    hidden = torch.randn(2, S, len(TAPS) * H, generator=g)
    # hand-picked anchors: doc start (no context), a block crossing into the next doc, the row end,
    # doc-internal ones, and dropped (keep=False) anchors
    anc = torch.tensor([[0, 17, 25, 48, 56, 62], [5, 39, 41, 60, 0, 0]])
    keep = torch.tensor([[True, True, True, True, True, True], [True, True, True, True, False, False]])
    return ids, pos, doc, lm, hidden, anc, keep


def model_and_embed(cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norm weights so a swapped/missing norm is caught
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(seed + 1))
    return model, embed


# --- an independent reference: one block at a time, explicit loops, float64 ---------------------------------


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta):
    """Qwen/HF RoPE: dims (i, i + D/2) are rotated together by angle pos * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    ang = positions.double()[:, None] * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def reference_forward(model, cfg, hidden, ids, pos, doc, anc, keep, embed):
    P = {k: v.double() for k, v in model.state_dict().items()}
    eps, theta, D = cfg.rms_norm_eps, cfg.rope_theta, cfg.head_dim
    nH, G = cfg.num_heads, cfg.num_kv_heads
    kv_head = torch.arange(nH) // (nH // G)  # GQA: query head h reads kv head h // (nH / G)
    docs, anchors, kept = doc.tolist(), anc.tolist(), keep.tolist()
    out = torch.zeros(anc.shape[0], anc.shape[1] * L, H, dtype=torch.float64)
    for b in range(anc.shape[0]):
        ctx = rms(hidden[b].double() @ P["fc.weight"].t(), P["hidden_norm.weight"], eps)  # [S, H]
        for a in range(anc.shape[1]):
            p = anchors[b][a]
            toks = [int(ids[b, p]) if kept[b][a] else MASK] + [MASK] * (L - 1)
            x = embed.double()[toks]  # [L, H]
            bpos = pos[b, p] + torch.arange(L)
            for i in range(cfg.num_layers):
                pre = f"layers.{i}."
                sliding = cfg.layer_types[i] == "sliding_attention"
                W = cfg.sliding_window
                xn = rms(x, P[pre + "input_layernorm.weight"], eps)
                q = rotate(rms((xn @ P[pre + "self_attn.q_proj.weight"].t()).view(L, nH, D),
                               P[pre + "self_attn.q_norm.weight"], eps), bpos, theta)
                kb = rotate(rms((xn @ P[pre + "self_attn.k_proj.weight"].t()).view(L, G, D),
                                P[pre + "self_attn.k_norm.weight"], eps), bpos, theta)
                vb = (xn @ P[pre + "self_attn.v_proj.weight"].t()).view(L, G, D)
                kc = rotate(rms((ctx @ P[pre + "self_attn.k_proj.weight"].t()).view(S, G, D),
                                P[pre + "self_attn.k_norm.weight"], eps), pos[b], theta)
                vc = (ctx @ P[pre + "self_attn.v_proj.weight"].t()).view(S, G, D)
                att = torch.zeros(L, nH, D, dtype=torch.float64)
                for k in range(L):
                    vis_ctx = [
                        j for j in range(S)
                        if kept[b][a] and j < p and docs[b][j] == docs[b][p] and (not sliding or p + k - j < W)
                    ]
                    vis_blk = [kk for kk in range(L) if not sliding or kk <= k or cfg.block_attention != "causal"]
                    keys = torch.cat([kc[vis_ctx], kb[vis_blk]])[:, kv_head]  # [n, nH, D]
                    vals = torch.cat([vc[vis_ctx], vb[vis_blk]])[:, kv_head]
                    scores = torch.einsum("nhd,hd->hn", keys, q[k]) / math.sqrt(D)
                    att[k] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vals)
                x = x + att.reshape(L, nH * D) @ P[pre + "self_attn.o_proj.weight"].t()
                xn = rms(x, P[pre + "post_attention_layernorm.weight"], eps)
                gate = xn @ P[pre + "mlp.gate_proj.weight"].t()
                up = xn @ P[pre + "mlp.up_proj.weight"].t()
                x = x + (torch.nn.functional.silu(gate) * up) @ P[pre + "mlp.down_proj.weight"].t()
            out[b, a * L : (a + 1) * L] = rms(x, P["norm.weight"], eps)
    return out


def forward(model, embed, batch, attn):
    ids, pos, doc, lm, hidden, anc, keep = batch
    masks = model.build_masks(doc, anc, keep, attn)
    return model(hidden, ids, pos, anc, keep, embed, masks, attn=attn)


@pytest.mark.parametrize(
    "kw",
    [{}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7),
     dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7, block_attention="bidirectional")],
    ids=["full", "sliding+full", "sliding bidirectional+full"],
)
def test_forward_equals_independent_reference(kw):
    """The drafter's forward = a float64 reference written out here, and flex attention = dense. Outputs are RMS-normed
    (scale ~1); 2 layers × ~8 sums of ≤ 128 terms: λ·u·√(128·16) = 1.4e-5 (`equivalence.forward_rtol`) for flex vs
    dense, each side's own rounding against float64 alike, 1e-4 for the reference's other association as well
    (measured ≤ 1 % and ≤ 0.2 % of those on an AMD EPYC, torch 2.13)."""
    cfg = config(**kw)
    model, embed = model_and_embed(cfg)
    batch = packed_batch()
    ids, pos, doc, lm, hidden, anc, keep = batch
    ref = reference_forward(model, cfg, hidden, ids, pos, doc, anc, keep, embed)
    out = forward(model, embed, batch, "dense")
    assert out.shape == (2, A * L, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # flex_attention has no CPU backward; eager forward only
        out_flex = forward(model, embed, batch, "flex")
    tol = forward_rtol(128, 2 * 8)
    torch.testing.assert_close(out_flex, out, rtol=tol, atol=tol)


def test_block_sees_nothing_after_anchor_or_in_other_docs():
    cfg = config()
    model, embed = model_and_embed(cfg)
    batch = list(packed_batch())
    base = forward(model, embed, batch, "dense").view(2, A, L, H)
    hidden = batch[4].clone()
    hidden[0, 25:] += 10.0  # row 0: the anchor at 25 (doc 1) and everything after it
    hidden[0, :20] += 10.0  # doc 0 of row 0
    batch[4] = hidden
    out = forward(model, embed, batch, "dense").view(2, A, L, H)
    torch.testing.assert_close(out[0, 2], base[0, 2])  # anchor 25 sees only positions 20..24
    assert not torch.allclose(out[0, 1], base[0, 1])  # anchor 17 (doc 0) does see its context
    torch.testing.assert_close(out[1], base[1])  # the other row is untouched


def test_gradients_reach_every_parameter_and_dropped_anchors_are_finite():
    cfg = config(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
    model, embed = model_and_embed(cfg)
    out = forward(model, embed, packed_batch(), "dense")
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# --- the mask ----------------------------------------------------------------------------------------------


def loop_mask(anc, keep, doc, W=None, causal=True):
    B, Sx = doc.shape
    Q = anc.shape[1] * L
    m = torch.zeros(B, 1, Q, Sx + Q, dtype=torch.bool)
    for b in range(B):
        for q in range(Q):
            a, k = divmod(q, L)
            p = int(anc[b, a])
            for j in range(Sx):
                m[b, 0, q, j] = bool(keep[b, a] and j < p and doc[b, j] == doc[b, p] and (W is None or p + k - j < W))
            for kk in range(L):
                m[b, 0, q, Sx + a * L + kk] = W is None or kk <= k or not causal
    return m


# (W, block causal): full layers; sliding layers causal inside the block (DFlash); every slot (DFlash2, is_causal false)
MASKS = [(None, True), (7, True), (7, False)]


@pytest.mark.parametrize("W, causal", MASKS)
def test_dense_mask_semantics(W, causal):
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    m = dense_mask(anc, keep, doc, L, W, causal)
    assert torch.equal(m, loop_mask(anc, keep, doc, W, causal))
    if W is not None:  # the two sliding masks differ inside the block only
        other = dense_mask(anc, keep, doc, L, W, not causal)
        assert torch.equal(m[..., :S], other[..., :S]) and not torch.equal(m, other)
    assert m.any(-1).all()  # no empty row, so no NaN
    # strictly before the anchor: the anchor's own position is never visible
    for b in range(2):
        for a in range(A):
            assert not m[b, 0, a * L : (a + 1) * L, int(anc[b, a])].any()


def test_split_attention_with_kv_repeated_per_head_equals_gqa():
    """`expand_kv` (what the trainer runs: K/V repeated to the query heads, for flex's backward parallelism) and
    GQA compute the same attention; both equal the dense reference over [context | block] keys."""
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    N, G, D, Q = 4, 2, 16, A * L
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, N, Q, D, generator=g)
    kc, vc = torch.randn(2, G, S, D, generator=g), torch.randn(2, G, S, D, generator=g)
    kb, vb = torch.randn(2, G, Q, D, generator=g), torch.randn(2, G, Q, D, generator=g)
    bm = flex_block_mask(anc, keep, doc, L, None, compiled=False, tile=8)
    allow = block_allow(L, None)
    out = {e: split_attention(q, kc, vc, kb, vb, bm, allow, D**-0.5, expand_kv=e) for e in (False, True)}
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), attn_mask=dense_mask(anc, keep, doc, L), scale=D**-0.5,
        enable_gqa=True)
    for e in (False, True):
        torch.testing.assert_close(out[e], ref, rtol=1e-5, atol=1e-5)
    k2, v2 = expand_heads(kc, vc, N)
    assert k2.shape == (2, N, S, D) and torch.equal(k2[:, 3], kc[:, 1]) and torch.equal(v2[:, 2], vc[:, 1])


@pytest.mark.parametrize("W, causal", MASKS)
def test_flex_mask_equals_dense(W, causal):
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    dense = dense_mask(anc, keep, doc, L, W, causal)
    Q = A * L
    grid = create_mask(make_mask_mod(anc, keep, doc, L, W, block_causal=causal), 2, 1, Q, S + Q, device="cpu")
    assert torch.equal(grid, dense)
    # the split flex path: context-only mask over the first S keys + the same L x L pattern in every block
    grid = create_mask(make_mask_mod(anc, keep, doc, L, W, context_only=True, block_causal=causal), 2, 1, Q, S,
                       device="cpu")
    assert torch.equal(grid, dense[..., :S])
    blocks = dense[..., S:].view(2, A, L, A, L).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [2, A, L, L]
    assert torch.equal(blocks, block_allow(L, W, None, causal).expand(2, A, L, L))
    assert not dense[..., S:].sum() - blocks.sum()  # nothing outside the own block
    tile = 8
    for context_only, K in ((True, S), (False, S + Q)):
        bm = flex_block_mask(anc, keep, doc, L, W, compiled=False, tile=tile, context_only=context_only,
                             block_causal=causal)
        tiles = dense[..., :K].view(2, 1, Q // tile, tile, K // tile, tile).any(-1).any(-2)
        assert torch.equal(bm.to_dense().bool(), tiles)


def test_build_masks_per_attention_kind():
    """flex: context-only BlockMask [B, 1, Q, S]; dense: bool [B, 1, Q, S+Q]; one per layer type; anything else
    (the removed "flex_joint" too) is refused by name."""
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    model = DFlashDrafter(config(layer_types=["sliding_attention", "full_attention"], sliding_window=7))
    Q = A * L
    flex, dense = (model.build_masks(doc, anc, keep, a) for a in ("flex", "dense"))
    assert set(flex) == set(dense) == {"sliding_attention", "full_attention"}
    for t in dense:
        assert dense[t].shape == (2, 1, Q, S + Q) and dense[t].dtype == torch.bool
        assert flex[t].shape == (2, 1, Q, S)
        grid = torch.meshgrid(torch.arange(2), torch.zeros(1, dtype=torch.long), torch.arange(Q), torch.arange(S),
                              indexing="ij")
        assert torch.equal(flex[t].mask_mod(*grid), dense[t][..., :S]), t
    for gone in ("sdpa", "flex_joint"):
        with pytest.raises(ValueError, match="attn must be one of"):
            model.build_masks(doc, anc, keep, gone)


# --- names, init, target embeddings --------------------------------------------------------------------------


def test_state_dict_keys_are_zlab_names():
    model = DFlashDrafter(config())
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
    expect = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    sd = model.state_dict()
    assert set(sd) == expect
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, H)
    assert sd["layers.1.self_attn.k_norm.weight"].shape == (16,)


def test_init_like_qwen3():
    model = DFlashDrafter(config(hidden_size=256, head_dim=64))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002, name


def test_config_validation():
    with pytest.raises(ValueError, match="sliding_window"):
        config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        config(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="num_kv_heads"):
        config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="block_attention must be one of"):
        config(block_attention="full")
    with pytest.raises(ValueError, match=r"block_attention='bidirectional' needs sliding_window=3 >= block_size=4"):
        config(layer_types=["sliding_attention"] * 2, sliding_window=3, block_attention="bidirectional")


def test_load_target_embeddings(tmp_path):
    emb, head = torch.randn(V, H), torch.randn(V, H)
    other = {"model.layers.0.mlp.up_proj.weight": torch.randn(4, 4)}
    # Qwen3, one file
    d = tmp_path / "qwen3"
    d.mkdir()
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": head, **other}, d / "model.safetensors")
    e, h = load_target_embeddings(d)
    assert torch.equal(e, emb) and torch.equal(h, head)
    # Qwen3.5 VL wrapper, sharded
    d = tmp_path / "qwen35"
    d.mkdir()
    save_file({"model.language_model.embed_tokens.weight": emb, **other}, d / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": head}, d / "model-00002-of-00002.safetensors")
    wm = {"model.language_model.embed_tokens.weight": "model-00001-of-00002.safetensors",
          "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
          "lm_head.weight": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    e, h = load_target_embeddings(d)
    assert torch.equal(e, emb) and torch.equal(h, head)
    # tied embeddings
    d = tmp_path / "tied"
    d.mkdir()
    save_file({"model.embed_tokens.weight": emb}, d / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        load_target_embeddings(d)
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    e, h = load_target_embeddings(d)
    assert torch.equal(h, emb)
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_target_embeddings(tmp_path)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_load_target_embeddings_on_real_checkpoints(arch, request):
    """The tiny targets are written by transformers' save_pretrained: real key names, real layout."""
    from safetensors.torch import load_file

    from fixtures import tiny

    target_dir = request.getfixturevalue("qwen35_dir" if arch == "qwen3_5" else "qwen3_dir")
    e, h = load_target_embeddings(target_dir)
    side = tiny.read_sidecar(target_dir)
    assert e.shape == h.shape == (side["vocab_size"], side["hidden_size"])
    assert not torch.equal(e, h)  # untied: the head is its own tensor
    prefix = "model.language_model." if arch == "qwen3_5" else "model."
    sd = load_file(target_dir / "model.safetensors")
    assert torch.equal(e, sd[prefix + "embed_tokens.weight"]) and torch.equal(h, sd["lm_head.weight"])


def test_scored_only_forward_and_loss_equal_the_full_ones():
    """Training's layout: slots 1..L-1 only (the last MLP skips slot 0) and the lm_head dtype. The outputs, the
    loss and every parameter gradient equal those of the full forward whose slot 0 the loss ignores, to the rounding
    of the last MLP's GEMMs on fewer rows: each gradient in norm within λ·n·u = 5.2e-5 (`equivalence.scalar_rtol`,
    n = 2 rows × (64 + 6 × 4) terms; element by element a gradient's terms cancel, so no rtol follows; measured
    ≤ 6e-8 on an AMD EPYC, torch 2.13), the outputs and the loss, sums of one sign, element by element."""
    from dflash_offline.anchors import block_labels
    from dflash_offline.loss import block_ce_loss

    cfg = config()
    ids, pos, doc, lm, hidden, anc, keep = packed_batch(3)
    model, embed = model_and_embed(cfg, 3)
    masks = model.build_masks(doc, anc, keep, "dense")
    labels = block_labels(ids, lm, doc, anc, keep, L)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    runs = []
    for scored in (False, True):
        model.zero_grad()
        h = model(hidden, ids, pos, anc, keep, embed, masks, "dense", scored_only=scored, out_dtype=torch.float64)
        assert h.dtype == torch.float64 and h.shape == (2, A * (L - 1 if scored else L), H)
        out = block_ce_loss(h.float(), head, labels, gamma=2.0)
        out.loss.backward()
        runs.append((h.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h_full, full, g_full), (h_scored, scored, g_scored) = runs
    torch.testing.assert_close(h_scored, h_full.view(2, A, L, H)[:, :, 1:].reshape(2, -1, H), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scored.loss, full.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(scored.correct_BAL, full.correct_BAL)
    for name in g_full:
        check(name, rel_distance(g_scored[name], g_full[name]), scalar_rtol(step_terms(2, S, A, L)))
    assert g_full["layers.1.mlp.down_proj.weight"].abs().sum() > 0
