"""DFlash2 (`DrafterConfig.variant="dflash2"`): identity at init (= DFlash bit for bit), z-lab's tensor names and
shapes, a convolution that stays inside its block, the training forward equal to the shipped `DFlash2DraftModel`
(forward and selector walk), and a compiled forward equal to the eager one without recompiles."""

import dataclasses
import time

import pytest
import torch
from test_drafter import A, H, L, V, config, forward, model_and_embed, packed_batch

from dflash_offline.anchors import block_input_ids
from dflash_offline.dflash2 import BlockConv
from dflash_offline.export import zlab_config
from dflash_offline.zlab_dflash import DFlash2DraftModel

SHAPE = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
D2 = dict(variant="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def dflash2(seed=0, std=0.0):
    """A DFlash2 drafter (with every parameter moved by N(0, std) when std > 0) and the embedding table."""
    model, embed = model_and_embed(config(**SHAPE, **D2), seed)
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
    """The shipped modeling class built from the drafter's config and holding its weights (strict load)."""
    from transformers import Qwen3Config

    dc = model.cfg
    tgt = {"max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": None}
    cfg = zlab_config(dc, tgt, "float32")
    cfg["dflash_config"].update({k: getattr(dc, k) for k in D2 if k != "variant"})
    hf = DFlash2DraftModel(Qwen3Config(**cfg)).eval()
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
            p = int(anc[b, a])
            start = int((doc[b] == doc[b, p]).nonzero()[0])
            got = hf(position_ids=torch.cat([pos[b:b + 1, start:p], pos[b:b + 1, p:p + 1] + torch.arange(L)], 1),
                     input_ids=bids[b:b + 1, a * L:(a + 1) * L], embed_tokens=embed,
                     target_hidden=hidden[b:b + 1, start:p])
            torch.testing.assert_close(got[0], want[b, a * L:(a + 1) * L], rtol=1e-5, atol=1e-5)
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
    t0 = time.time()
    for seed in (0, 1):
        ids, pos, doc, lm, hidden, anc, keep = packed_batch(seed)
        masks = model.build_masks(doc, anc, keep, "dense")
        args = (hidden, ids, pos, anc, keep, embed, masks)
        with torch._dynamo.config.patch(error_on_recompile=seed == 1):
            got = compiled(*args, attn="dense", scored_only=True)
        want = model(*args, attn="dense", scored_only=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.shape == (2, A * (L - 1), H)
    if time.time() - t0 > 120:
        pytest.fail(f"compiling took {time.time() - t0:.0f} s")


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


def test_export_refuses_a_dflash2_run_it_cannot_describe(tmp_path, qwen3_dir):
    """Export writes the DFlash format; a DFlash2 run's tensors would pass its checks under a config.json naming
    DFlashDraftModel, which engines would load without the convolutions and the selector: refused."""
    from test_export import fake_run

    from dflash_offline.export import ExportError, export

    run, _ = fake_run(tmp_path / "run", qwen3_dir, variant="dflash2", selector_rank=8)
    with pytest.raises(ExportError, match="dflash2 drafter"):
        export(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_spec_generate_with_the_selector_is_lossless(tmp_path, qwen3_dir):
    """The shipped DFlash2 drafts with its selector walk inside spec_generate; the output is the target's greedy
    one, and with an lm_head of one live row and the selector at its identity drafts agree, so blocks of several
    tokens are accepted."""
    from test_export import fake_run, greedy
    from transformers import AutoModelForCausalLM

    _, model = fake_run(tmp_path / "run", qwen3_dir, variant="dflash2", selector_rank=8)
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
