"""DFlash2 (`DrafterConfig.variant="dflash2"`): identity at init (= DFlash bit for bit), z-lab's tensor names and
shapes, a convolution that stays inside its block, the training forward equal to the shipped `DFlash2DraftModel`
(forward and selector walk), and a compiled forward equal to the eager one without recompiles."""

import dataclasses
import json
import math

import pytest
import torch
from test_drafter import A, H, L, V, config, forward, model_and_embed, packed_batch

from dflash_offline.anchors import block_input_ids
from dflash_offline.dflash2 import BlockConv
from dflash_offline.export import zlab_config
from dflash_offline.zlab_dflash import DFlash2DraftModel

SHAPE = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
D2 = dict(variant="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def dflash2(seed=0, std=0.0, **kw):
    """A DFlash2 drafter (with every parameter moved by N(0, std) when std > 0) and the embedding table."""
    model, embed = model_and_embed(config(**{**SHAPE, **D2, **kw}), seed)
    if std:
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * std)
    return model, embed


def expected_shapes(num_layers, hidden, vocab, kernel, group, rank) -> dict[str, tuple]:
    """The tensors of a DFlash2 checkpoint besides DFlash's, as z-lab's published drafters name them (no `.weight`
    on the codebooks): per layer a base kernel [2, kernel, hidden] and a kernel projection [2*kernel*groups, hidden]
    for the attention and for the MLP; the selector's two codebooks [vocab, rank] and its projection [rank, hidden]."""
    out = {"candidate_selector.hidden_projection.weight": (rank, hidden),
           "candidate_selector.predecessor_codebook": (vocab, rank),
           "candidate_selector.successor_codebook": (vocab, rank)}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * (hidden // group), hidden)
    return out


def shipped(model) -> DFlash2DraftModel:
    """The shipped modeling class the export's config.json names, built from that config and holding the drafter's
    weights (strict load)."""
    from transformers import Qwen3Config

    from dflash_offline import zlab_dflash

    dc = model.cfg
    tgt = {"max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": None}
    cfg = zlab_config(dc, tgt, "float32")
    hf = getattr(zlab_dflash, cfg["architectures"][0])(Qwen3Config(**cfg)).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def test_untrained_dflash2_is_dflash_bit_for_bit():
    dflash, embed = model_and_embed(config(**SHAPE))
    model, _ = dflash2()
    missing, unexpected = model.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and set(missing) == set(expected_shapes(2, H, V, 2, 16, 8))
    batch = packed_batch()
    ids, pos, doc, lm, hidden, anc, keep = batch
    with torch.no_grad():  # (flex_attention has no CPU backward)
        for attn in ("dense", "flex"):
            assert torch.equal(forward(model, embed, batch, attn), forward(dflash, embed, batch, attn)), attn
            masks = model.build_masks(doc, anc, keep, attn)
            scored = [m(hidden, ids, pos, anc, keep, embed, masks, attn=attn, scored_only=True) for m in (model, dflash)]
            assert torch.equal(*scored), attn
    h = torch.randn(5, H)
    unary, cand = torch.randn(5, 4), torch.randint(0, V, (5, 4))
    assert torch.equal(model.candidate_selector.scores(h, unary, cand, torch.randint(0, V, (5,))), unary)


def test_a_seeded_dflash2_shares_every_dflash_tensor_and_computes_dflash_untrained():
    """Built after the same `torch.manual_seed`, DFlash and DFlash2 draw the same backbone (seeded A/B runs and
    untrained baselines are paired): every common tensor bit for bit, the generator left in the same state, and the
    untrained DFlash2 forward = DFlash's with no weights copied."""
    from dflash_offline.drafter import DFlashDrafter

    def build(cfg):
        torch.manual_seed(0)
        return DFlashDrafter(cfg), torch.get_rng_state()

    (dflash, after_dflash), (model, after_dflash2) = build(config(**SHAPE)), build(config(**SHAPE, **D2))
    ours, theirs = model.state_dict(), dflash.state_dict()
    assert set(ours) - set(theirs) == set(expected_shapes(2, H, V, 2, 16, 8))
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    assert torch.equal(after_dflash, after_dflash2)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(forward(model, embed, packed_batch(), "dense"), forward(dflash, embed, packed_batch(), "dense"))


def test_a_fresh_shipped_dflash2_computes_the_shipped_dflash():
    """`DFlash2DraftModel(config)` built fresh is the identity around DFlash (its convolutions' init survives
    transformers' `post_init`): with a DFlash's weights loaded, or built after the same seed as the shipped DFlash
    (no weights copied), it gives DFlash's hidden states and drafts DFlash's argmax."""
    from transformers import Qwen3Config

    from dflash_offline.zlab_dflash import DFlashDraftModel

    tgt = {"max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": None}

    def build(cls, cfg):
        torch.manual_seed(0)
        return cls(Qwen3Config(**zlab_config(cfg, tgt, "float32"))).eval()

    dflash, fresh = build(DFlashDraftModel, config(**SHAPE)), build(DFlash2DraftModel, config(**SHAPE, **D2))
    ours, theirs = fresh.state_dict(), dflash.state_dict()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    ids, pos, _, _, hidden, _, _ = packed_batch()
    embed, head = torch.randn(V, H, generator=torch.Generator().manual_seed(1)), torch.randn(V, H)
    block = torch.cat([ids[:1, 17:18], torch.full((1, L - 1), 97)], 1)
    args = dict(position_ids=torch.cat([pos[:1, :17], pos[:1, 17:18] + torch.arange(L)], 1), input_ids=block,
                embed_tokens=embed, target_hidden=hidden[:1, :17])
    trained, _ = model_and_embed(config(**SHAPE), seed=3)  # other weights, norms off 1
    with torch.no_grad():
        for weights in (None, trained.state_dict()):
            if weights is not None:
                dflash.load_state_dict(weights)
                assert set(fresh.load_state_dict(weights, strict=False).missing_keys) == set(
                    expected_shapes(2, H, V, 2, 16, 8))
            assert torch.equal(fresh(**args), dflash(**args))
            drafted = [m.draft_tokens(hidden[:1, :17], ids[:1, 17:18], m.draft_cache(), embed, head)
                       for m in (fresh, dflash)]
            assert torch.equal(*drafted)


@pytest.mark.parametrize("field, value", [("is_causal", True), ("output_multiplier", 0.5),
                                          ("dflash_config.output_multiplier", 2.0), ("final_logit_softcapping", 30.0)])
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_the_shipped_models_refuse_a_config_asking_for_another_computation(field, value, variant):
    """z-lab's configs may carry fields this file does not compute: a model built from one is refused in one line
    naming the field, not built to compute something else — causal full_attention layers (is_causal true beside a
    full layer), causality fields that disagree (vLLM reads dflash_config.causal after is_causal, SGLang and z-lab only
    is_causal), a logit multiplier or softcap. Values asking for what it computes pass: is_causal false (the whole
    block in every layer, z-lab's DFlash2 drafters) with any layers, true where every layer slides."""
    from transformers import Qwen3Config

    from dflash_offline import zlab_dflash

    tgt = {"max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": None}
    cls = getattr(zlab_dflash, "DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel")

    def config_with(shape, **fields):
        cfg = zlab_config(config(**shape, **(D2 if variant == "dflash2" else {})), tgt, "float32")
        for name, v in fields.items():
            if name.startswith("dflash_config."):
                cfg["dflash_config"][name.split(".")[1]] = v
            else:
                cfg[name] = v
        return Qwen3Config(**cfg)

    # (SHAPE: a sliding and a full layer, so a causal value asks for a causal full layer)
    with pytest.raises(ValueError, match=rf"^DFlash drafter config: {field}={value!r} asks for a computation this "
                                         rf"modeling file does not do \(it computes the drafter dflash_offline trains"):
        cls(config_with(SHAPE, **{field: value}))
    sliding = dict(layer_types=["sliding_attention"] * 2, sliding_window=7)
    # a causality field beside the top-level is_causal (which z-lab and SGLang alone read) that some engine would read
    # otherwise: saying the other value, or set without is_causal where it changes what vLLM computes
    for shape, fields, top in ((sliding, {"is_causal": False, "dflash_config.causal": True}, "False"),
                               (sliding, {"dflash_config.causal": False}, "absent"),
                               (sliding, {"causal": False}, "absent"),
                               (sliding, {"dflash_config.is_causal": False}, "absent"),
                               (SHAPE, {"dflash_config.causal": True}, "absent")):
        other = next(k for k in fields if k != "is_causal")
        with pytest.raises(ValueError, match=rf"^DFlash drafter config: {other}={fields[other]} while the top-level "
                                             rf"is_causal is {top} \(z-lab and SGLang read only is_causal"):
            cls(config_with(shape, **fields))
    assert cls(config_with(sliding, **{"dflash_config.causal": True})).block_causal  # (what every engine computes)
    assert cls(config_with(sliding, is_causal=True, output_multiplier=1.0, final_logit_softcapping=None)).block_causal
    assert not cls(config_with(SHAPE, is_causal=False, **{"dflash_config.causal": False})).block_causal
    assert cls(config_with(dict(layer_types=["full_attention"] * 2))).block_causal  # no field: sliding layers causal


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
def test_the_export_config_makes_the_shipped_model_compute_the_training_attention(variant, block_attention):
    """With every parameter moved off its init, the shipped class the export's config.json names (built from that
    config alone: `is_causal` false for a bidirectional drafter, no field for a block-causal one) drafts each block of
    a packed batch as the training forward does, for a sliding and a full layer; the two settings differ in the
    sliding layer, so neither equality holds by accident."""
    kw = {"block_attention": block_attention} | ({} if variant == "dflash2" else {"variant": "dflash"})
    model, embed = dflash2(std=0.3, **kw)
    model.eval()
    hf = shipped(model)
    assert ("is_causal" in hf.config.to_dict()) == (block_attention == "bidirectional")
    batch = packed_batch()
    ids, pos, doc, lm, hidden, anc, keep = batch
    flip = "bidirectional" if block_attention == "causal" else "causal"
    other, _ = dflash2(std=0.3, **{**kw, "block_attention": flip})  # the same weights, the other mask
    other.eval()
    with torch.no_grad():
        want = forward(model, embed, batch, "dense")
        assert not torch.allclose(want, forward(other, embed, batch, "dense"), atol=1e-3)
        bids = block_input_ids(ids, anc, keep, L, model.cfg.mask_token_id)
        for b, a in ((0, 1), (0, 4), (1, 3)):
            shipped_block_equals(hf, want, bids, embed, (pos, doc, hidden, anc), b, a, L)


def test_tensor_names_and_shapes_are_zlab_s():
    model, _ = dflash2()
    dflash, _ = model_and_embed(config(**SHAPE))
    want = {k: tuple(v.shape) for k, v in dflash.state_dict().items()} | expected_shapes(2, H, V, 2, 16, 8)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == want
    assert {k: tuple(v.shape) for k, v in shipped(model).state_dict().items()} == want
    # the published Qwen3.8-27B drafter's settings are the defaults; its layer 0 conv: [2, 2, 5120], [1280, 5120]
    dc = dataclasses.replace(config(), variant="dflash2", hidden_size=5120)
    assert (dc.conv_kernel_size, dc.conv_group_size, dc.selector_rank, dc.selector_top_k) == (2, 16, 256, 16)
    big = expected_shapes(5, 5120, 248320, 2, 16, 256)
    assert big["layers.0.attention_conv.kernel_projection.weight"] == (1280, 5120)
    assert big["candidate_selector.successor_codebook"] == (248320, 256)


def leaks_across_blocks(model, embed) -> bool:
    """Changing the token at one anchor changes that block only (blocks see neither each other's tokens through
    attention nor, if the convolution restarts at every block, through it): True if another block moved."""
    batch = list(packed_batch())
    with torch.no_grad():
        base = forward(model, embed, batch, "dense").view(2, A, L, H)
        ids = batch[0].clone()
        ids[0, batch[5][0, 1]] = (ids[0, batch[5][0, 1]] + 1) % V  # row 0, anchor 1's own token
        batch[0] = ids
        out = forward(model, embed, batch, "dense").view(2, A, L, H)
    assert not torch.equal(out[0, 1], base[0, 1])  # the changed block does change
    others = [a for a in range(A) if a != 1]
    return not (torch.equal(out[0, others], base[0, others]) and torch.equal(out[1], base[1]))


def test_the_convolution_stays_inside_its_block(monkeypatch):
    model, embed = dflash2(std=0.3)
    assert not leaks_across_blocks(model, embed)
    # planted: one convolution along the whole row (block A*L), so slot 0 of block 2 reads block 1's last slot
    for m in model.modules():
        if isinstance(m, BlockConv):
            monkeypatch.setattr(m, "block_size", A * L)
    assert leaks_across_blocks(model, embed)


def test_training_forward_equals_the_shipped_model():
    """Every parameter moved off the identity; the shipped class drafts each block as engines do (its document's
    context up to the anchor, default inference masks, one block), from the same weights."""
    model, embed = dflash2(std=0.3)
    model.eval()
    hf = shipped(model)
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.05  # logits ~ the pair scores
    unlike_argmax = 0
    with torch.no_grad():
        want = forward(model, embed, (ids, pos, doc, lm, hidden, anc, keep), "dense")
        bids = block_input_ids(ids, anc, keep, L, model.cfg.mask_token_id)
        for b, a in ((0, 1), (0, 3), (0, 4), (1, 1), (1, 3)):
            p, start = shipped_block_equals(hf, want, bids, embed, (pos, doc, hidden, anc), b, a, L)
            # the walk: each slot's best-scoring candidate after the previous pick, scored by the training selector
            drafted = hf.draft_tokens(hidden[b:b + 1, start:p], ids[b:b + 1, p:p + 1], hf.draft_cache(), embed, head)
            h_KH = want[b, a * L + 1:(a + 1) * L]
            unary, cand = (h_KH @ head.t()).topk(4, dim=-1)
            prev, walk = ids[b, p:p + 1], []
            for k in range(L - 1):
                s = model.candidate_selector.scores(h_KH[k:k + 1], unary[k:k + 1], cand[k:k + 1], prev)
                prev = cand[k:k + 1, s.argmax(-1)][0]
                walk.append(int(prev))
            assert drafted[0].tolist() == walk
            unlike_argmax += walk != (h_KH @ head.t()).argmax(-1).tolist()
    assert unlike_argmax  # (the moved selector does not just take each slot's argmax)


def test_compiled_forward_equals_eager_without_recompiling():
    """The training forward under torch.compile (fixed shapes, Inductor on this CPU) gives the eager result and a
    second batch of the same shapes compiles nothing."""
    model, embed = dflash2(std=0.3)
    compiled = torch.compile(model, dynamic=False)
    for seed in (0, 1):
        ids, pos, doc, lm, hidden, anc, keep = packed_batch(seed)
        masks = model.build_masks(doc, anc, keep, "dense")
        args = (hidden, ids, pos, anc, keep, embed, masks)
        with torch._dynamo.config.patch(error_on_recompile=seed == 1):
            got = compiled(*args, attn="dense", scored_only=True)
        want = model(*args, attn="dense", scored_only=True)
        # (Inductor's fused float32 sums run in another order: up to 1.4e-5 apart here, on outputs of order 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.shape == (2, A * (L - 1), H)


def test_scored_only_keeps_slot_0_for_the_convolution():
    """The last layer drops slot 0 after its MLP (its convolution reads slot 0): scored_only = slots 1.. of all."""
    model, embed = dflash2(std=0.3)
    ids, pos, doc, lm, hidden, anc, keep = packed_batch()
    masks = model.build_masks(doc, anc, keep, "dense")
    with torch.no_grad():
        full = model(hidden, ids, pos, anc, keep, embed, masks, attn="dense").view(2, A, L, H)
        scored = model(hidden, ids, pos, anc, keep, embed, masks, attn="dense", scored_only=True)
    torch.testing.assert_close(scored, full[:, :, 1:].reshape(2, -1, H), rtol=0, atol=0)


def test_gradients_reach_every_dflash2_parameter():
    """From the identity init the block CE reaches the convolutions; the selector needs its own loss."""
    model, embed = dflash2()
    out = forward(model, embed, packed_batch(), "dense")
    out.square().mean().backward()
    for name, p in model.named_parameters():
        if "candidate_selector" in name:
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_export_writes_the_dflash2_format_and_automodel_loads_every_tensor(tmp_path, qwen3_dir):
    """A DFlash2 run exports as z-lab's DFlash2 drafters are published: config.json names DFlash2DraftModel (and
    auto_map the shipped class), dflash_config holds the conv and selector settings beside block_size, mask_token_id
    and target_layer_ids (the layout of z-lab/dflash tests/fixtures/dflash2-config.json), the weights are exactly the
    training drafter's under z-lab's names (codebooks without `.weight`). `AutoModel.from_pretrained` builds
    DFlash2DraftModel with every tensor of the file consumed and none missing, holding the trained weights bit for
    bit; its drafting step (hidden states, logits, the selector walk) equals the shipped class built from the
    training drafter, which `test_training_forward_equals_the_shipped_model` holds equal to the training forward."""
    from safetensors import safe_open
    from test_export import fake_run
    from transformers import AutoModel

    from dflash_offline.export import export

    run, model = fake_run(tmp_path / "run", qwen3_dir, variant="dflash2", selector_rank=8, selector_top_k=4)
    dc = model.cfg
    out = export(run, tmp_path / "out", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"} and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"block_size": dc.block_size, "mask_token_id": dc.mask_token_id,
                                    "mask_token": cfg["dflash_config"]["mask_token"],
                                    "target_layer_ids": dc.target_layer_ids, "conv_kernel_size": 2,
                                    "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    trained = model.state_dict()
    assert set(tensors) == set(trained)
    new = expected_shapes(dc.num_layers, dc.hidden_size, dc.vocab_size, 2, 16, 8)
    assert {k: tuple(tensors[k].shape) for k in new} == new
    assert all(torch.equal(tensors[k], v) for k, v in trained.items())

    hf, info = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32,
                                         output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == "DFlash2DraftModel" and type(hf).__module__.endswith("dflash")
    assert {k: list(v) for k, v in info.items()} == {k: [] for k in info}, info  # missing, unexpected, mismatched
    assert set(hf.state_dict()) == set(trained)
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in trained.items())
    ref = shipped(model)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 11, len(dc.target_layer_ids) * dc.hidden_size, generator=g)
    anchor = torch.tensor([[5]])
    got = hf.draft_block(ctx, anchor, hf.draft_cache(), embed, head, return_hidden=True)
    want = ref.draft_block(ctx, anchor, ref.draft_cache(), embed, head, return_hidden=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(hf.draft_tokens(ctx, anchor, hf.draft_cache(), embed, head),
                       ref.draft_tokens(ctx, anchor, ref.draft_cache(), embed, head))


@pytest.mark.parametrize("attention", [{}, dict(layer_types=["sliding_attention"] * 2, sliding_window=16,
                                                block_attention="bidirectional")], ids=["full", "bidirectional"])
def test_spec_generate_with_the_selector_is_lossless(tmp_path, qwen3_dir, attention):
    """The shipped DFlash2 drafts with its selector walk inside spec_generate; the output is the target's greedy
    one, and with an lm_head of one live row and the selector at its identity drafts agree, so blocks of several
    tokens are accepted. Also with every layer sliding and bidirectional inside the block (is_causal false, the
    published Qwen3.8-27B drafter's attention): the loop runs losslessly over the growing, cropped cache (lossless
    whatever the drafter computes; that the masks are the trained ones is checked against the training forward in
    test_the_export_config_makes_the_shipped_model_compute_the_training_attention)."""
    from test_export import fake_run, greedy
    from transformers import AutoModelForCausalLM

    _, model = fake_run(tmp_path / "run", qwen3_dir, variant="dflash2", selector_rank=8, **attention)
    hf = shipped(model)
    target = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    prompt = torch.randint(0, 1980, (1, 9), generator=torch.Generator().manual_seed(2))
    calls = []
    walk = hf.candidate_selector.walk
    hf.candidate_selector.walk = lambda *a, **k: calls.append(1) or walk(*a, **k)
    out = hf.spec_generate(target, prompt, max_new_tokens=24, return_stats=True)
    assert torch.equal(out.output_ids, greedy(target, prompt, 24)) and len(calls) == len(out.acceptance_lengths)
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        live = head[7].clone()
        head.zero_()
        head[7] = live  # logits are 0 everywhere but token 7
        hf.candidate_selector.successor_codebook.zero_()  # (the random selector would prefer other candidates)
    out = hf.spec_generate(target, prompt, max_new_tokens=24, return_stats=True)
    assert torch.equal(out.output_ids, greedy(target, prompt, 24)) and max(out.acceptance_lengths) > 1


# --- the training objective --------------------------------------------------------------------------------------


def reference_selector_ce(selector, h_XKH, head, labels_XL, prev_XK, gamma, w_XL=None, norm=None):
    """The selector CE written out slot by slot: full logits, the top-k, the score formula, F.cross_entropy; slot k
    of block x weighs w_XL[x, k] (default: decay's slot weights) and the sum is divided by `norm` (default: decay's
    loss weight)."""
    from dflash_offline.loss import slot_weights

    L = labels_XL.shape[1]
    if w_XL is None:
        w_XL = slot_weights(L, gamma).expand(labels_XL.shape)
        norm = (w_XL * (labels_XL >= 0)).sum()
    total = 0.0
    P, S, Wh = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    for x in range(h_XKH.shape[0]):
        for k in range(1, L):
            y = int(labels_XL[x, k])
            if y < 0:
                continue
            z = h_XKH[x, k - 1] @ head.t()
            cand = z.topk(selector.top_k).indices
            if y not in cand.tolist():
                continue
            s = torch.stack([z[c] + (P[prev_XK[x, k - 1]] * (Wh @ h_XKH[x, k - 1]) * S[c]).sum() for c in cand])
            total = total + w_XL[x, k] * torch.nn.functional.cross_entropy(
                s[None], torch.tensor([cand.tolist().index(y)]))
    return total / norm


def _selector_case():
    """A selector (its successor codebook off the identity), scored-slot outputs h, an lm_head, a row's tokens,
    anchors, labels (half of them made candidates, a block running past the row) and each slot's true predecessor."""
    from dflash_offline.dflash2 import CandidateSelector

    torch.manual_seed(0)
    B, A, S, K = 2, 3, 40, 4
    sel = CandidateSelector(V, H, 8, K)
    sel.reset_parameters(0.3)
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.3)
    h = torch.randn(B, A * (L - 1), H, requires_grad=True)
    head = torch.randn(V, H) * 0.1
    ids = torch.randint(0, V, (B, S))
    anc = torch.tensor([[0, 10, 30], [5, 20, 36]])
    pos = (anc[:, :, None] + torch.arange(L)).clamp(max=S - 1)
    labels = ids.gather(1, pos.view(B, -1)).view(B, A, L)
    labels[:, :, 0] = -100
    labels[1, 2, 3:] = -100  # past the row
    with torch.no_grad():  # half the labels made candidates: the top logit of their slot
        z = h.view(B, A, L - 1, H) @ head.t()
        labels[:, :, 1:] = torch.where(torch.rand(B, A, L - 1) < 0.5, z.argmax(-1), labels[:, :, 1:])
        labels[1, 2, 3:] = -100
    prev = ids.gather(1, pos.view(B, -1)).view(B * A, L)[:, :-1]
    return sel, h, head, ids, anc, labels, prev


def test_selector_ce_equals_a_slot_by_slot_reference_and_trains_the_selector():
    from dflash_offline.dflash2 import selector_ce_loss

    sel, h, head, ids, anc, labels, prev = _selector_case()
    B, A = anc.shape
    K = sel.top_k
    got = selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0)
    want = reference_selector_ce(sel, h.view(B * A, L - 1, H), head, labels.view(B * A, L), prev, 4.0)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    g_got = torch.autograd.grad(got.loss, [h, *sel.parameters()])
    g_want = torch.autograd.grad(want, [h, *sel.parameters()])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert 0 < float(got.recall) < 1
    # a label that is no candidate has nothing to select: changing it to another non-candidate changes nothing
    with torch.no_grad():
        cands = (h.view(B, A, L - 1, H)[0, 0, 0] @ head.t()).topk(K).indices.tolist()
    labels[0, 0, 1] = next(t for t in range(V) if t not in cands)
    base = selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0).loss
    labels[0, 0, 1] = next(t for t in range(V) if t not in cands and t != int(labels[0, 0, 1]))
    assert torch.equal(selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0).loss, base)
    # the selector alone learns to pick: its loss falls and its picks after the true predecessor get better
    h = h.detach()
    opt = torch.optim.Adam(sel.parameters(), lr=3e-2)
    first = selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0)
    for _ in range(30):
        opt.zero_grad()
        selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0).loss.backward()
        opt.step()
    last = selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0)
    assert last.loss < 0.5 * first.loss and last.correct_BAL.sum() > first.correct_BAL.sum()


def test_under_dpace_the_selector_ce_weighs_its_slots_as_the_block_ce_did():
    """weighting=dpace: each slot's selector CE weighs what that slot weighed in the block CE (D-PACE's weights, from
    the drafter's own probabilities; `BlockLoss.weights_BAL`) and the sum is divided by D-PACE's normalizer (the
    labelled blocks): equal to the slot-by-slot reference with those weights, and not decay's figure."""
    from dflash_offline.dflash2 import selector_ce_loss
    from dflash_offline.loss import block_ce_loss, reference_block_ce_loss

    sel, h, head, ids, anc, labels, prev = _selector_case()
    B, A = anc.shape
    blk = block_ce_loss(h, head, labels, weighting="dpace")
    full = torch.cat([torch.zeros(B * A, 1, H), h.detach().view(B * A, L - 1, H)], 1).view(B, A * L, H)
    torch.testing.assert_close(blk.weights_BAL, reference_block_ce_loss(full, head, labels,
                                                                        weighting="dpace").weights_BAL)
    got = selector_ce_loss(sel, h, head, labels, ids, anc, weighting="dpace", slot_w_BAL=blk.weights_BAL)
    blocks = (labels >= 0).any(-1).sum().float()
    want = reference_selector_ce(sel, h.view(B * A, L - 1, H), head, labels.view(B * A, L), prev, None,
                                 blk.weights_BAL.view(B * A, L), blocks)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    g_got, g_want = (torch.autograd.grad(x, [h, *sel.parameters()]) for x in (got.loss, want))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    decay = selector_ce_loss(sel, h, head, labels, ids, anc, gamma=4.0)
    assert abs(float(got.loss) / float(decay.loss) - 1) > 0.1  # (D-PACE's weights and normalizer are not decay's)
    with pytest.raises(ValueError, match="slot_w_BAL"):
        selector_ce_loss(sel, h, head, labels, ids, anc, weighting="dpace")


def test_a_dflash2_drafter_trains_with_dpace_its_selector_weighed_by_the_block_ce_s_weights(tmp_path, hidden_cache,
                                                                                           monkeypatch):
    """variant=dflash2 weighting=dpace through the trainer: every micro-batch's selector CE gets the weights the
    block CE used and the step's (D-PACE) normalizer; the loss stays finite and the selector leaves the identity."""
    from safetensors.torch import load_file

    from dflash_offline import dflash2, loss
    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    blocks, selectors = [], []

    def block(*args, **kw):
        out = block_ce(*args, **kw)
        blocks.append((out, kw["weighting"]))
        return out

    def selector(*args, **kw):
        selectors.append(kw)
        return selector_ce(*args, **kw)

    block_ce, selector_ce = loss.block_ce_loss, dflash2.selector_ce_loss
    monkeypatch.setattr(loss, "block_ce_loss", block)
    monkeypatch.setattr(dflash2, "selector_ce_loss", selector)
    tiny = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
                trackers="none", lr=1e-2, warmup_steps=1, steps=4, ckpt_every=4)
    run = train.run(TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / "run"), variant="dflash2",
                                   weighting="dpace", **tiny).resolve())
    assert len(blocks) == len(selectors) == 4
    for (out, weighting), kw in zip(blocks, selectors, strict=True):
        assert weighting == kw["weighting"] == "dpace" and kw["slot_w_BAL"] is out.weights_BAL
        assert torch.equal(kw["normalizer"], out.norm)
        decay = loss.slot_weights(out.weights_BAL.shape[-1], None) * out.valid_BAL
        assert not torch.allclose(out.weights_BAL, decay)  # (D-PACE's weights, not decay's)
    assert all(math.isfinite(json.loads(x)["loss"]) for x in (run / "metrics.jsonl").read_text().splitlines())
    sd = load_file(str(run / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert sd["candidate_selector.successor_codebook"].abs().sum() > 0


def test_train_a_dflash2_drafter_on_a_cache(tmp_path, hidden_cache, monkeypatch):
    """variant=dflash2 trains on the cache as it is: the loss (block CE + selector CE) falls, and so does the
    selector's own CE over the slots it is scored on while its picks get better; the checkpoint holds z-lab's DFlash2
    tensors, and both new modules have left the identity. (The selector term of the loss first grows: it counts only
    slots whose label is a candidate, and the drafter soon ranks frequent tokens high. Measured on this cache, torch
    2.13 CPU, means of the first and of the last five steps: loss 7.91 → 7.52, the selector's mean CE 2.67 → 0.53,
    its right picks 28 % → 81 %.)"""
    from safetensors.torch import load_file

    from dflash_offline import dflash2
    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    seen = []  # per step: (the selector's mean CE over its slots, its share of right picks among them)

    def recording(*args, **kw):
        out = dflash2_loss(*args, **kw)
        labelled = (args[3][:, :, 1:] >= 0).sum() * out.recall
        seen.append((float(out.loss * kw["normalizer"] / out.weight), float(out.correct_BAL.sum() / labelled)))
        return out

    dflash2_loss = dflash2.selector_ce_loss
    monkeypatch.setattr(dflash2, "selector_ce_loss", recording)
    tiny = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
                trackers="none", lr=1e-2, warmup_steps=1, steps=60, ckpt_every=60)
    run = train.run(TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / "run"), variant="dflash2",
                                selector_weight=1.0, **tiny).resolve())
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == len(seen) == 60 and sum(losses[-5:]) < 0.97 * sum(losses[:5]), losses

    def mean(xs):
        return sum(xs) / len(xs)

    ce, right = [x[0] for x in seen], [x[1] for x in seen]
    assert mean(ce[-5:]) < 0.5 * mean(ce[:5]) and mean(right[-5:]) > mean(right[:5]) + 0.3, seen
    # metrics.jsonl records the same figures (one step a line here): the selector's CE, its right picks, its recall
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["selector_ce"] for r in recs] == pytest.approx(ce, rel=1e-4)
    assert [r["selector_acc"] for r in recs] == pytest.approx(right, rel=1e-4)
    assert all(0 < r["selector_recall"] <= 1 for r in recs)
    dc = json.loads((run / "config.json").read_text())["drafter"]
    assert dc["variant"] == "dflash2"
    sd = load_file(str(run / "checkpoints" / "step-00000060" / "model.safetensors"))
    new = expected_shapes(2, dc["hidden_size"], dc["vocab_size"], 2, 16, 256)
    assert {k: tuple(sd[k].shape) for k in new} == new
    assert sd["candidate_selector.successor_codebook"].abs().sum() > 0
    assert sd["layers.0.mlp_conv.kernel_projection.weight"].abs().sum() > 0


def test_dflash2_training_settings_are_checked():
    from dflash_offline.config import ConfigError
    from dflash_offline.trainsetup import TrainConfig

    for bad in (dict(fsdp=True), dict(selector_weight=-1.0), dict(variant="dflash3")):
        with pytest.raises(ConfigError, match="variant"):
            TrainConfig.of(cache="c", run="r", **{"variant": "dflash2", **bad}).resolve()
    assert TrainConfig.of(cache="c", run="r", variant="dflash2", weighting="dpace").resolve().loss.weighting == "dpace"


def shipped_block_equals(hf, want, bids, embed, batch, b: int, a: int, L: int):
    """The shipped model's forward of row b's block a (its document's context before the anchor) equals the training
    forward's `want` there; returns (the anchor's position, its document's start)."""
    pos, doc, hidden, anc = batch
    p = int(anc[b, a])
    start = int((doc[b] == doc[b, p]).nonzero()[0])
    got = hf(position_ids=torch.cat([pos[b:b + 1, start:p], pos[b:b + 1, p:p + 1] + torch.arange(L)], 1),
             input_ids=bids[b:b + 1, a * L:(a + 1) * L], embed_tokens=embed, target_hidden=hidden[b:b + 1, start:p])
    torch.testing.assert_close(got[0], want[b, a * L:(a + 1) * L], rtol=1e-5, atol=1e-5)
    return p, start
