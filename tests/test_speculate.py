"""Speculative decoding is lossless (== the target's greedy output) on both tiny targets, whatever the drafter proposes;
eval drafts with the exported artifact itself (its dflash.py's `draft_block`), whose τ equals dflash.py's own
`spec_generate` and whose drafts equal the training forward; `stages.evaluate` measures an export end to end, records
it, reports acceptance per position / category and timings, and fails on a difference (any in float32; beyond a
rounding tie in bfloat16)."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from dflash_offline.checkpoint import save_checkpoint
from dflash_offline.drafter import DFlashDrafter, DrafterConfig
from dflash_offline.evaluation import render_prompt
from dflash_offline.export import export
from dflash_offline.speculate import (
    ExportedDrafter,
    GenStats,
    batched_greedy,
    greedy_by_blocks,
    greedy_generate,
    load_exported,
    replay_generate,
    speculative_generate,
    summarize,
    untrained_model,
)
from dflash_offline.target import read_target_info
from dflash_offline.targetid import TargetError
from fixtures import democorpus

L = 8  # block size of the test drafters
TAPS = [1, 3]  # tapped target layers of the test drafters (both tiny targets have more than 4 layers)


@pytest.fixture(scope="module")
def targets(qwen3_dir, qwen35_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for arch, d in (("qwen3", qwen3_dir), ("qwen3_5", qwen35_dir)):
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        out[arch] = (model, AutoTokenizer.from_pretrained(str(d)))
    return out


def held_out_prompt(tok, i=0) -> list[int]:
    return render_prompt(list(democorpus.generate(i + 1, seed=1_000_003))[i]["messages"], tok)


def drafter_config(target_dir, **kw) -> DrafterConfig:
    info = read_target_info(target_dir)
    return DrafterConfig(**{"hidden_size": info.hidden_size, "intermediate_size": 64, "vocab_size": info.vocab_size,
                            "target_layer_ids": TAPS, "num_target_layers": info.num_layers, "mask_token_id": 1999,
                            "rope_theta": info.rope_theta, "rms_norm_eps": info.rms_norm_eps, "num_layers": 2,
                            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": L, **kw})


def exported(root, target_dir, std: float = 0.3, **kw):
    """An export (float32) of a run holding one checkpoint of a random drafter for `target_dir` (weights larger than
    the init, so attention patterns matter)."""
    dc = drafter_config(target_dir, **kw)
    torch.manual_seed(0)
    model = DFlashDrafter(dc)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
    cfg = {"train": {"target": str(target_dir), "cache": "", "seed": 0}, "drafter": dataclasses.asdict(dc)}
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg))
    save_checkpoint(run, 7, model, config=cfg, rng=False)
    return export(run, root / "export", dtype="float32")


def two_token_head(target):
    """Zero the target's lm_head but rows 7 and 9 = -row 7: every output (the target's, and a drafter's drafts through
    the same head) is 7 or 9, by the sign of one projection, so drafts are often accepted."""
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        live = head[7].clone()
        head.zero_()
        head[7], head[9] = live, -live


class ScriptedDrafter:
    """Proposes the reference continuation, each token replaced by a random one with probability 1 - p.

    p = 1: an oracle (τ = L); p = 0: random tokens (τ ≈ 1). Checks and records the contexts it is given.
    """

    def __init__(self, ref: list[int], p: float, vocab: int, seed: int = 0):
        self.ref, self.p, self.vocab, self.rng = ref, p, vocab, random.Random(seed)
        self.block_size, self.layer_ids = L, TAPS
        self.contexts = []

    def start(self):
        self.ctx = None

    def draft(self, ctx_new, anchor, pos, block_size):
        self.ctx = ctx_new if self.ctx is None else torch.cat([self.ctx, ctx_new], 1)
        assert self.ctx.shape[1] == pos, "context = every position before the anchor, each given once"
        assert int(anchor) == self.ref[pos], "anchor = the target's token there (lossless so far)"
        self.contexts.append(self.ctx)
        out = []
        for k in range(1, block_size):
            t = self.ref[pos + k] if pos + k < len(self.ref) else 0
            out.append(t if self.rng.random() < self.p else self.rng.randrange(self.vocab))
        return torch.tensor(out)


def check_stats(out, st, L_):
    assert 1 + sum(st.emitted) == len(out) == st.new_tokens
    assert sum(st.tau_hist) == st.steps and len(st.tau_hist) == L_
    assert st.target_forwards == 1 + st.steps + st.refeeds
    assert all(e <= n + 1 for e, n in zip(st.emitted, st.accepted, strict=True))
    assert st.emitted[:-1] == [n + 1 for n in st.accepted[:-1]]  # only the last step may be cut short
    assert len(st.draft_ms) == len(st.verify_ms) == len(st.rollback_ms) == st.steps
    assert all(t > 0 for t in st.draft_ms + st.verify_ms) and all(t >= 0 for t in st.rollback_ms)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_lossless_with_any_drafter(targets, arch):
    model, tok = targets[arch]
    vocab = model.config.vocab_size
    prompt = held_out_prompt(tok)
    N = 40
    ref, gst = greedy_generate(model, prompt, N + L, eos_ids=[])  # the oracle knows a block past the end
    assert gst.target_forwards == len(ref) == N + L and gst.tau_hist == [gst.steps] == [len(gst.verify_ms)]
    greedy = ref[:N]
    full = prompt + ref
    expected_rollback = "crop" if arch == "qwen3" else "refeed"

    # (a) random drafts: nearly nothing accepted, a rollback after nearly every step
    out, st = speculative_generate(model, ScriptedDrafter(full, 0.0, vocab), prompt, N, eos_ids=[])
    assert out == greedy
    check_stats(out, st, L)
    assert st.rollback == expected_rollback and st.tau_mean < 1.2 and st.steps >= N - 1 - 5
    assert st.refeeds == (st.steps - st.accepted.count(L - 1) if arch == "qwen3_5" else 0)

    # (b) an oracle: every block fully accepted, τ = L, no rollback
    drafter = ScriptedDrafter(full, 1.0, vocab)
    out, st = speculative_generate(model, drafter, prompt, N, eos_ids=[])
    assert out == greedy
    check_stats(out, st, L)
    assert st.accepted == [L - 1] * st.steps and st.tau_mean == L and st.refeeds == 0
    assert st.steps == -(-(N - 1) // L)  # ceil((N-1)/L) verify forwards instead of N-1

    # the context handed to the drafter = the tapped states of a single forward over the same tokens
    ctx = drafter.contexts[-1]
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([full[: ctx.shape[1]]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(ctx, torch.cat([hs[i + 1] for i in TAPS], -1), rtol=1e-4, atol=1e-4)

    # (c) a noisy oracle: partial acceptances of every length, with the automatic rollback and with refeed forced
    for rollback in ("auto", "refeed"):
        out, st = speculative_generate(model, ScriptedDrafter(full, 0.75, vocab, seed=3), prompt, N, eos_ids=[],
                                       rollback=rollback)
        assert out == greedy
        check_stats(out, st, L)
        assert len(set(st.accepted)) >= 3 and 1.5 < st.tau_mean < L
        assert (st.refeeds > 0) == (rollback == "refeed" or arch == "qwen3_5")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_eos_and_budget(targets, arch):
    model, tok = targets[arch]
    prompt = held_out_prompt(tok, 1)
    ref, _ = greedy_generate(model, prompt, 24, eos_ids=[])
    eos = ref[9]  # a token the target emits: both must stop right after its first occurrence
    greedy, _ = greedy_generate(model, prompt, 24, eos_ids=[eos])
    assert greedy == ref[: ref.index(eos) + 1]
    out, st = speculative_generate(model, ScriptedDrafter(prompt + ref, 1.0, 2000), prompt, 24, eos_ids=[eos])
    assert out == greedy
    check_stats(out, st, L)
    for budget in (1, 2, 5):
        out, st = speculative_generate(model, ScriptedDrafter(prompt + ref, 1.0, 2000), prompt, budget, eos_ids=[])
        assert out == ref[:budget]
        check_stats(out, st, L)
    # a perfect drafter cut by the budget: its last step accepted the whole block (τ as z-lab counts it) but emitted
    # only what the budget left; tau_emitted counts the tokens the verify steps gave
    budget = L + 3  # the prefill token, one full block, then 2 of the next block's L
    out, st = speculative_generate(model, ScriptedDrafter(prompt + ref, 1.0, 2000), prompt, budget, eos_ids=[])
    assert out == ref[:budget] and st.accepted == [L - 1, L - 1] and st.emitted == [L, 2]
    assert st.tau_mean == L and st.tau_emitted == (budget - 1) / 2 == summarize([st])["tau_emitted"]

def test_acceptance_per_position_and_pooling():
    a = GenStats(block_size=4, accepted=[0, 3, 1], draft_ms=[1.0, 1.0, 4.0], verify_ms=[2.0] * 3)
    b = GenStats(block_size=4, accepted=[3, 2], draft_ms=[1.0, 3.0], verify_ms=[4.0, 4.0])
    s = summarize([a, b])
    assert s["tau_hist"] == [1, 1, 1, 2] and s["steps"] == 5 and s["tau_mean"] == 14 / 5
    assert s["accept_ge"] == [4 / 5, 3 / 5, 2 / 5]  # steps accepting >= 1, 2, 3 drafts
    assert s["tau_mean"] == pytest.approx(1 + sum(s["accept_ge"]))
    assert s["draft_ms"] == 2.0 and s["verify_ms"] == 2.8  # per step, pooled over generations


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_shipped_draft_step_equals_training_forward(qwen3_dir, kind):
    """dflash.py's `draft_block`, called anchor after anchor with its context cache (as eval and spec_generate call
    it), gives the training forward's logits for each block."""
    dc = drafter_config(qwen3_dir, hidden_size=32, vocab_size=300, target_layer_ids=[0, 2], mask_token_id=299,
                        num_heads=4, head_dim=8, **({"layer_types": ["sliding_attention", "full_attention"],
                                                     "sliding_window": 5} if kind == "sliding" else {}))
    model, artifact = untrained_model(dc, qwen3_dir, seed=0)
    assert artifact["path"] is None and artifact["modeling_file"].endswith("zlab_dflash.py")
    torch.manual_seed(0)
    ref = DFlashDrafter(dc).eval()  # the trainer's step 0 with the same seed: the same weights
    g = torch.Generator().manual_seed(1)
    S = 24
    embed, head = torch.randn(300, 32, generator=g), torch.randn(300, 32, generator=g)
    hidden, ids = torch.randn(1, S, 64, generator=g), torch.randint(0, 299, (1, S), generator=g)
    anchors = torch.tensor([[3, 4, 9, 10, 17, 23]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    masks = ref.build_masks(torch.zeros(1, S, dtype=torch.long), anchors, keep, "dense")
    with torch.no_grad():
        want = ref(hidden, ids, torch.arange(S)[None], anchors, keep, embed, masks, "dense")[0] @ head.t()
    cache, seen = model.draft_cache(), 0
    for a, p in enumerate(anchors[0].tolist()):
        got = model.draft_block(hidden[:, seen:p], ids[:, p:p + 1], cache, embed, head)
        torch.testing.assert_close(got[0], want[a * L + 1:(a + 1) * L], rtol=1e-4, atol=1e-4)
        assert cache.get_seq_length() == p
        seen = p


def test_untrained_dflash2_and_dflash_baselines_of_one_seed_are_paired(qwen3_dir):
    """The untrained baselines of one seed: DFlash2's backbone is DFlash's tensor for tensor (its own modules draw
    aside), so with its identity conv and selector it drafts DFlash's blocks."""
    dc = drafter_config(qwen3_dir, hidden_size=32, vocab_size=300, target_layer_ids=[0, 2], mask_token_id=299,
                        num_heads=4, head_dim=8)
    d2 = dataclasses.replace(dc, variant="dflash2", selector_rank=8, selector_top_k=4)
    (dflash, _), (dflash2, _) = untrained_model(dc, qwen3_dir, seed=0), untrained_model(d2, qwen3_dir, seed=0)
    theirs, ours = dflash.state_dict(), dflash2.state_dict()
    assert [k for k in theirs if not torch.equal(theirs[k], ours[k])] == []
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(300, 32, generator=g), torch.randn(300, 32, generator=g)
    hidden, anchor = torch.randn(1, 12, 64, generator=g), torch.tensor([[7]])
    drafts = [m.draft_tokens(hidden, anchor, m.draft_cache(), embed, head) for m in (dflash, dflash2)]
    assert torch.equal(*drafts)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_eval_decoding_is_the_exported_spec_generate(tmp_path, targets, qwen3_dir, qwen35_dir, arch):
    """The drafter eval measures is the export loaded by AutoModel (its dflash.py), and its outputs and τ per step
    equal dflash.py's own spec_generate (which recomputes hybrid targets; eval rolls their cache back)."""
    target, tok = targets[arch]
    d = exported(tmp_path, qwen3_dir if arch == "qwen3" else qwen35_dir)
    model, artifact = load_exported(d)
    prov = json.loads((d / "dflash_export.json").read_text())
    assert artifact["path"] == str(d) and artifact["weights_sha256"] == prov["weights_sha256"] and artifact["step"] == 7
    assert type(model).__module__.startswith("transformers_modules")  # the export's own file, not the repo's
    target = type(target).from_pretrained(str(qwen3_dir if arch == "qwen3" else qwen35_dir),
                                          dtype=torch.float32).eval()
    two_token_head(target)
    drafter, taus = ExportedDrafter(model, target), []
    for i, n in ((0, 24), (1, 16)):
        prompt = held_out_prompt(tok, i)
        greedy, _ = greedy_generate(target, prompt, n, eos_ids=[])
        out, st = speculative_generate(target, drafter, prompt, n, eos_ids=[])
        zlab = model.spec_generate(target, torch.tensor([prompt]), max_new_tokens=n, return_stats=True)
        assert out == greedy == zlab.output_ids[0, len(prompt):].tolist()
        assert [a + 1 for a in st.accepted] == zlab.acceptance_lengths
        check_stats(out, st, L)
        taus += zlab.acceptance_lengths
    assert len(set(taus)) >= 3 and L in taus  # full and partial acceptances of several lengths (rollbacks)


def same_steps(replayed, decoded):
    """A replay gives a decode's steps, emitted tokens and (all but the last step's) accepted drafts."""
    (r_out, r), (d_out, d) = replayed, decoded
    assert r_out == d_out and r.emitted == d.emitted and r.steps == d.steps
    assert r.accepted[:-1] == d.accepted[:-1] and r.accepted[-1:] <= d.accepted[-1:]
    assert r.target_forwards == 1 and r.rollback == "replay" and len(r.draft_ms) == r.steps and not r.verify_ms


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_replay_takes_the_steps_of_a_real_decode(tmp_path, targets, qwen3_dir, qwen35_dir, arch):
    """`replay_generate` (one target forward over the known greedy output, the drafter stepped along it) gives the real
    decode's steps, emitted tokens and acceptance — with scripted drafts of every acceptance rate, at eos and at the
    budget, and with the shipped drafter, whose context then comes from one forward instead of the verify forwards."""
    model, tok = targets[arch]
    vocab = model.config.vocab_size
    prompt = held_out_prompt(tok, 1)
    ref, _ = greedy_generate(model, prompt, 40 + L, eos_ids=[])
    full = prompt + ref
    for p, n, eos in ((0.0, 40, []), (0.75, 40, []), (1.0, 40, []), (0.75, 23, [ref[17]]), (1.0, L + 3, []), (0.5, 1, [])):
        greedy, _ = greedy_generate(model, prompt, n, eos_ids=eos)
        decoded = speculative_generate(model, ScriptedDrafter(full, p, vocab, seed=5), prompt, n, eos_ids=eos)
        replayed = replay_generate(model, ScriptedDrafter(full, p, vocab, seed=5), prompt, greedy, n, eos_ids=eos)
        assert decoded[0] == greedy
        same_steps(replayed, decoded)
    # the budget cuts a perfect drafter's last block: the replay cannot see the drafts past the end
    st = replay_generate(model, ScriptedDrafter(full, 1.0, vocab), prompt, ref[: L + 3], L + 3, eos_ids=[])[1]
    assert st.accepted == [L - 1, 2] and st.emitted == [L, 2]
    with pytest.raises(ValueError, match="greedy output for this budget"):
        replay_generate(model, ScriptedDrafter(full, 1.0, vocab), prompt, ref[:10], 20, eos_ids=[])

    target = type(model).from_pretrained(str(qwen3_dir if arch == "qwen3" else qwen35_dir), dtype=torch.float32).eval()
    two_token_head(target)
    drafter, taus = ExportedDrafter(load_exported(exported(tmp_path, qwen3_dir if arch == "qwen3" else qwen35_dir))[0],
                                    target), []
    for i, n in ((0, 24), (1, 16), (2, 31)):
        prompt = held_out_prompt(tok, i)
        greedy, _ = greedy_generate(target, prompt, n, eos_ids=[])
        decoded = speculative_generate(target, drafter, prompt, n, eos_ids=[])
        same_steps(replay_generate(target, drafter, prompt, greedy, n, eos_ids=[]), decoded)
        taus += decoded[1].accepted
    assert len(set(taus)) >= 3  # partial acceptances of several lengths


@pytest.mark.parametrize("kind", ["dflash", "sliding-causal", "sliding-bidirectional", "dflash2"])
def test_a_replay_drafting_many_anchors_at_once_takes_the_stepwise_replays_steps(tmp_path, targets, qwen35_dir, kind,
                                                                                  monkeypatch):
    """`replay_generate(anchors_at_once=N)` drafts the anchors a walk may reach in batched forwards (each row's block
    seeing only the context before its anchor): at every anchor the drafts a decode's step makes, through the real
    lm_head, split into forwards of a few rows by the memory budget — for DFlash with full and sliding layers (a
    window shorter than the block, causal; bidirectional) and DFlash2 (its block convolution and selector walk, on
    sliding layers too) — so the replay takes the stepwise replay's steps, whatever N, at eos and at the budget."""
    from dflash_offline import speculate

    model, tok = targets["qwen3_5"]
    kw = {"dflash": {}, "sliding-causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
          "sliding-bidirectional": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 12,
                                    "block_attention": "bidirectional"},
          "dflash2": {"variant": "dflash2", "selector_rank": 8, "selector_top_k": 4, "sliding_window": 12,
                      "layer_types": ["sliding_attention", "full_attention"], "block_attention": "bidirectional"}}[kind]
    shipped = load_exported(exported(tmp_path, qwen35_dir, **kw))[0]
    drafter = ExportedDrafter(shipped, model)  # the target's own head: drafts of every token
    prompt = held_out_prompt(tok, 3)
    seq = prompt + greedy_generate(model, prompt, 20, eos_ids=[])[0]
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    hid = torch.cat([out.hidden_states[i + 1] for i in drafter.layer_ids], -1)
    anchors, stepwise, prev = list(range(len(prompt), len(seq) - 1)), [], 0
    drafter.start()
    for a in anchors:  # a decode whose every step accepts nothing: the next anchor is the next position
        stepwise.append(drafter.draft(hid[:, prev:a], torch.tensor([[seq[a]]]), a, L).tolist())
        prev = a
    c = shipped.config
    monkeypatch.setattr(speculate, "REPLAY_ELEMENTS", 3 * (len(seq) - 2 + L) * c.num_attention_heads * c.head_dim)
    drafter.start_replay(hid[:, : len(seq) - 2], torch.tensor([seq]))
    assert drafter.draft_anchors(anchors, L) == stepwise and len({tuple(d) for d in stepwise}) > len(anchors) // 2
    monkeypatch.undo()

    target = type(model).from_pretrained(str(qwen35_dir), dtype=torch.float32).eval()
    two_token_head(target)
    drafter, steps = ExportedDrafter(shipped, target), []
    for i, n, at_once in ((0, 30, 64), (1, 17, 5), (2, 24, 1)):
        prompt = held_out_prompt(tok, i)
        ref, _ = greedy_generate(target, prompt, n, eos_ids=[])
        for eos in ([], [ref[n // 2]]):
            greedy = ref[: ref.index(eos[0]) + 1] if eos else ref
            stepwise = replay_generate(target, drafter, prompt, greedy, n, eos_ids=eos)[1]
            out, batched = replay_generate(target, drafter, prompt, greedy, n, eos_ids=eos, anchors_at_once=at_once)
            assert out == greedy and batched.accepted == stepwise.accepted and batched.emitted == stepwise.emitted
            assert batched.target_forwards == 1 and not batched.draft_ms
            steps += stepwise.accepted
    # partial acceptances of several lengths: the drafts matter (DFlash2's random selector, picking among its top 4,
    # accepts fewer)
    assert len(set(steps)) >= (2 if kind == "dflash2" else 3)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_by_blocks_is_the_greedy_output(targets, arch):
    """The target-alone decode verified in blocks against a batched greedy draft is `greedy_generate`'s output token
    for token — with eos, at the budget, and with a wrong draft — in a few forwards where the draft is right."""
    model, tok = targets[arch]
    prompts = [held_out_prompt(tok, i) for i in range(4)]
    ref, _ = greedy_generate(model, prompts[0], 30, eos_ids=[])
    for n, eos in ((30, []), (30, [ref[11]]), (7, [])):
        drafts = batched_greedy(model, prompts, n, eos_ids=eos, batch=3)
        for prompt, draft in zip(prompts, drafts, strict=True):
            greedy, _ = greedy_generate(model, prompt, n, eos_ids=eos)
            out, st = greedy_by_blocks(model, prompt, draft, n, eos_ids=eos, block_size=16)
            assert out == greedy and st.rollback == "drafted"
            if draft == greedy:  # prefill + one verify per block (+ one refeed after the last, partial block)
                assert st.target_forwards <= 2 + -(-(len(greedy) - 1) // 16)
    wrong = [(t + 1) % model.config.vocab_size for t in ref]
    out, st = greedy_by_blocks(model, prompts[0], wrong, 30, eos_ids=[], block_size=16)
    assert out == ref and st.tau_mean < 1.5


def test_load_exported_refuses_a_changed_or_old_export(tmp_path, qwen3_dir):
    d = exported(tmp_path, qwen3_dir)
    code = (d / "dflash.py").read_text()
    (d / "dflash.py").write_text(code.replace("def draft_block(", "def _old_draft_block("))
    with pytest.raises(ValueError, match="dflash.py .* is not the modeling code this version ships .*changed after"):
        load_exported(d)  # loading runs it: another file than the shipped one is refused unless trusted
    with pytest.raises(ValueError, match="no draft_block"):
        load_exported(d, trust_code=True)
    (d / "dflash.py").write_text(code)
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ValueError, match="changed after the export"):
        load_exported(d)
    with pytest.raises(ValueError, match="is not a z-lab export"):
        load_exported(tmp_path / "run")


def test_untrained_drafter_lossless_on_hybrid_target(targets, qwen35_dir):
    """The shipped model with a fresh drafter's weights and its cache, on the hybrid target."""
    model, tok = targets["qwen3_5"]
    drafter = ExportedDrafter(untrained_model(drafter_config(qwen35_dir, num_layers=1), qwen35_dir, seed=0)[0], model)
    prompt = held_out_prompt(tok, 2)
    greedy, _ = greedy_generate(model, prompt, 24, eos_ids=[1988])
    out, st = speculative_generate(model, drafter, prompt, 24, eos_ids=[1988])
    assert out == greedy
    check_stats(out, st, L)


# --- stages.evaluate -------------------------------------------------------------------------------------------


def prompts_with_categories(path, n):
    recs = [{**r, "category": ("math", "words")[i % 2]} for i, r in enumerate(democorpus.generate(n, 1_000_003))]
    return democorpus.write_jsonl(path, n, records=recs)


def test_eval_prompts_the_drafter_trained_on_are_named(tmp_path, hidden_cache, chat_corpus):
    """τ on training prompts overstates the drafter: a prompts file that is a training corpus file, or the file whose
    prompts make regen answered into one (its stats say so), is named with the held-out file to pass instead; the
    held-out file itself, another file, or a run whose caches are gone are not."""
    import shutil

    from dflash_offline.evaluation import trained_on

    assert trained_on(Path(chat_corpus), hidden_cache) == f"{chat_corpus} is a file of the drafter's training corpus"
    other = tmp_path / "other.jsonl"
    other.write_text(Path(chat_corpus).read_text())  # (the same records elsewhere: not what the run records)
    assert trained_on(other, hidden_cache) is None
    assert trained_on(Path(chat_corpus), tmp_path / "gone") is None
    # a copy of the caches' manifests whose corpus is a regen output of prompts.jsonl, 1 record in 8 held out
    hm = json.loads((hidden_cache / "manifest.json").read_text())
    tokens = tmp_path / "tokens"
    shutil.copytree((hidden_cache / hm["config"]["tokens_dir"]).resolve(), tokens)
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "manifest.json").write_text(json.dumps({**hm, "config": {**hm["config"],
                                                                                    "tokens_dir": "../tokens"}}))
    regen_out, prompts, held = tmp_path / "regen.jsonl", tmp_path / "prompts.jsonl", tmp_path / "held.jsonl"
    for f in (regen_out, prompts, held):
        f.write_text(Path(chat_corpus).read_text())
    tm = json.loads((tokens / "manifest.json").read_text())
    (tokens / "manifest.json").write_text(json.dumps({**tm, "config": {**tm["config"], "corpus": [str(regen_out)]}}))
    (tmp_path / "regen.jsonl.stats.json").write_text(json.dumps({"config": {
        "corpus": [str(prompts)], "num_docs": 0, "heldout": {"every": 8, "out": str(held)}}}))
    assert trained_on(prompts, tmp_path / "hidden") == (
        f"{regen_out}, which the drafter trained on, holds the target's answers to the prompts of {prompts} (all its "
        f"records but 1 in 8, which make regen held out into {held} (pass that file))")
    assert trained_on(held, tmp_path / "hidden") is None


def test_evaluate_measures_the_export(tmp_path, hidden_cache, capfd, monkeypatch):
    from dflash_offline.config import ConfigError
    from dflash_offline.trainsetup import TrainConfig
    from stages import evaluate, train

    run = tmp_path / "run"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_anchors=8, batch_rows=2, log_every=1, trackers="none", block_size=8,
                          steps=2, ckpt_every=2).resolve())
    prompts = prompts_with_categories(tmp_path / "eval.jsonl", 3)
    args = [f"--run={run}", f"--prompts={prompts}", "--num_prompts=3", "--max_new_tokens=12", "--tf_batches=1",
            "--tf_rows=2"]
    assert evaluate.main(args) == 0  # no --export: the run's latest checkpoint is exported into RUN/eval-export
    r = json.loads((run / "eval.json").read_text())
    prov = json.loads((run / "eval-export" / "dflash_export.json").read_text())
    art = r["artifact"]
    assert art["path"] == str((run / "eval-export").resolve()) and art["weights_sha256"] == prov["weights_sha256"]
    assert r["step"] == art["step"] == prov["step"] == 2 and not r["untrained"]
    assert r["dtype"] == "float32" and r["mode"] == "exact" and r["lossless"] and r["exact"]
    assert r["num_prompts"] == 3 and r["block_size"] == 8 and len(r["tau_hist"]) == 8
    assert sum(r["tau_hist"]) == r["verify_steps"] > 0 and 1 <= r["tau_mean"] <= 8
    assert len(r["accept_ge"]) == 7 and r["tau_mean"] == pytest.approx(1 + sum(r["accept_ge"]))
    assert set(r["by_category"]) == {"math", "words"}
    assert [r["by_category"][c]["prompts"] for c in ("math", "words")] == [2, 1]
    assert sum(v["verify_steps"] for v in r["by_category"].values()) == r["verify_steps"]
    assert [p["category"] for p in r["per_prompt"]] == ["math", "words", "math"]
    assert r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["target_ms_per_token"] > 0
    assert r["speedup_engine_est"] == pytest.approx(r["tau_mean"] / (1 + r["draft_ms"] / r["verify_ms"]))
    assert r["rollback"] == "refeed" and r["speedup"] > 0 and r["speedup_step_est"] > 0
    tf = r["teacher_forced"]
    assert tf["batches"] == 1 and not tf["held_out"] and 1 <= tf["sim_tau"] <= 8 and len(tf["acc"]) == 7
    assert all(p["equal"] for p in r["per_prompt"]) and r["prompts_trained_on"] is None
    assert r["template_settings"] == [None]  # (the template's defaults)

    # the target-alone decodes are kept in the run (RUN/eval-baselines/<key>.json) and the run's later evaluations
    # reuse them (the same outputs, so the same τ); --baseline=off decodes the target alone again and keeps nothing
    kept_file = Path(r["baseline"]["file"])
    assert kept_file.parent == run / "eval-baselines" and r["baseline"]["reused"] is False
    assert r["baseline"]["prompts"] == 3
    # an existing export is measured as it is; a new directory receives an export first; another run's is refused
    out = tmp_path / "e.json"
    before = (run / "eval-export" / "model.safetensors").stat().st_mtime_ns
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}"]) == 0
    assert (run / "eval-export" / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads(out.read_text())["tau_hist"] == r["tau_hist"]
    assert json.loads(out.read_text())["baseline"]["reused"] is True
    kept = kept_file.stat().st_mtime_ns
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 "--baseline=off"]) == 0
    off = json.loads(out.read_text())
    assert off["baseline"] is None and off["tau_hist"] == r["tau_hist"]
    assert kept_file.stat().st_mtime_ns == kept
    # a one-off evaluation of other prompts (a shorter budget) keeps its decodes beside them: the run's are not lost
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 "--max_new_tokens=6"]) == 0
    assert json.loads(out.read_text())["baseline"]["file"] != str(kept_file)
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}"]) == 0
    assert json.loads(out.read_text())["baseline"] == {"file": str(kept_file), "reused": True, "prompts": 3}
    # … and the folder keeps the KEEP_BASELINES most recently used: a third key drops the one-off's, not the reused
    from dflash_offline import evaluation

    monkeypatch.setattr(evaluation, "KEEP_BASELINES", 2)
    assert len(list(kept_file.parent.glob("*.json"))) == 2
    (kept_file.parent / "mine.json").write_text("{}")  # (not a key's file: never removed)
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 "--max_new_tokens=5"]) == 0
    left = sorted(kept_file.parent.glob("*.json"))
    assert left == sorted([kept_file, Path(json.loads(out.read_text())["baseline"]["file"]),
                           kept_file.parent / "mine.json"]), left
    # --template_kwargs naming enable_thinking otherwise than the training corpus was rendered: said, not silent
    run_cfg = (run / "config.json").read_text()
    (run / "config.json").write_text(json.dumps({**json.loads(run_cfg), "template_kwargs": {"enable_thinking": False}}))
    capfd.readouterr()
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 '--template_kwargs={"enable_thinking": true}']) == 0
    assert ("WARNING: --template_kwargs enable_thinking=True renders the prompts otherwise than the drafter's "
            "training corpus was rendered (enable_thinking=False)") in capfd.readouterr().err
    assert json.loads(out.read_text())["template_settings"] == [{"enable_thinking": True}]
    (run / "config.json").write_text(run_cfg)
    assert evaluate.main(args + [f"--export={tmp_path / 'new'}", "--tf_batches=0", f"--out={out}"]) == 0
    assert json.loads(out.read_text())["artifact"]["weights_sha256"] == prov["weights_sha256"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((run / "config.json").read_text())
    with pytest.raises(ValueError, match="is an export of run"):
        evaluate.main([f"--run={other}", f"--export={run / 'eval-export'}", f"--prompts={prompts}"])
    with pytest.raises(ValueError, match="holds step 2"):
        evaluate.main(args + [f"--export={run / 'eval-export'}", "--step=1"])
    # the eval target must be the run's (Qwen3.5- and Qwen3.6-27B share one shape): a copy of it elsewhere is the same
    # target; one that differs (here its config) is refused before anything loads, naming the run's
    import shutil

    trained_for = json.loads((run / "config.json").read_text())["target"]
    twin = tmp_path / "twin"
    shutil.copytree(trained_for, twin)
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 f"--target={twin}"]) == 0
    assert json.loads(out.read_text())["tau_hist"] == r["tau_hist"]
    (twin / "config.json").write_text(json.dumps({**json.loads((twin / "config.json").read_text()), "note": "other"}))
    with pytest.raises(TargetError, match=f"eval target {twin} is not the target {run} was trained for "
                                          f"\\({trained_for}; config_sha256"):
        evaluate.main(args + [f"--target={twin}"])
    # loading an export runs its dflash.py: an edited one is refused in one line, --trust_code=1 runs it
    code = run / "eval-export" / "dflash.py"
    shipped = code.read_text()
    code.write_text(shipped + "# edited\n")
    edited = args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}"]
    with pytest.raises(ValueError, match="not the modeling code this version ships .*changed after.*--trust_code=1"):
        evaluate.main(edited)
    assert evaluate.main(edited + ["--trust_code=1"]) == 0
    assert json.loads(out.read_text())["artifact"]["modeling_sha256"] != prov["modeling_sha256"]
    # a replay drafting many anchors at once calls the modeling code's forward with its own masks: this version's
    # code only, and in float32 only (refused before the target loads)
    with pytest.raises(ConfigError, match="replay_batch drafts through this version's modeling code"):
        evaluate.main(edited + ["--trust_code=1", "--replay=1", "--replay_batch=4"])
    code.write_text(shipped)
    with pytest.raises(ConfigError, match="replay_batch drafts in float32 only"):
        evaluate.main(edited + ["--dtype=bfloat16", "--replay=1", "--replay_batch=4"])

    # the untrained drafter on one prompt only (--spec_prompts=1): the baseline file still holds all three target-alone
    # decodes, and a trained evaluation reuses them
    base = tmp_path / "baseline.json"
    assert evaluate.main(args + ["--untrained=1", "--tf_batches=0", "--spec_prompts=1", f"--baseline={base}"]) == 0
    u = json.loads((run / "eval-untrained.json").read_text())
    assert u["untrained"] and u["lossless"] and u["exact"] and u["teacher_forced"]["batches"] == 0
    assert u["artifact"]["path"] is None and u["step"] == 0
    assert u["num_prompts"] == len(u["per_prompt"]) == 1 and u["baseline"] == {"file": str(base), "reused": False,
                                                                             "prompts": 3}
    decodes = json.loads(base.read_text())["decodes"]
    # the two baseline-only prompts were verified in blocks (untimed); a trained evaluation decoding them for real
    # times them token by token again, with the same tokens
    assert [d["stats"]["rollback"] for d in decodes] == ["", "drafted", "drafted"]
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 f"--baseline={base}"]) == 0
    again = json.loads(out.read_text())
    assert again["baseline"]["reused"] and again["num_prompts"] == 3 and again["tau_hist"] == r["tau_hist"]
    # --timed_alone=2 (the testbed's untrained evaluation, its check prompts): the baseline holds the first two
    # prompts' target-alone decodes token by token, the same tokens, so a replay decoding them for real reuses them
    # where it decoded them again itself (the 2-token warm-up aside)
    from dflash_offline import speculate

    timed = tmp_path / "timed.json"
    assert evaluate.main(args + ["--untrained=1", "--tf_batches=0", "--spec_prompts=1", "--timed_alone=2",
                                 f"--baseline={timed}"]) == 0
    timed_decodes = json.loads(timed.read_text())["decodes"]
    assert [d["stats"]["rollback"] for d in timed_decodes] == ["", "", "drafted"]
    assert [d["ids"] for d in timed_decodes] == [d["ids"] for d in decodes]
    alone_decodes, greedy = [], speculate.greedy_generate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculate, "greedy_generate", lambda *a, **k: alone_decodes.append(a[2]) or greedy(*a, **k))
        for made, redone in ((base, 1), (timed, 0)):  # (`base` holds the first prompt's token by token: spec_prompts=1)
            alone_decodes.clear()
            assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                         f"--baseline={made}", "--replay=1", "--check_prompts=2"]) == 0
            rp = json.loads(out.read_text())
            assert [n for n in alone_decodes if n != 2] == [12] * redone, (made, alone_decodes)
            assert rp["lossless"] and rp["replay_check"] == {"prompts": 2, "agree": 2}
            assert rp["tau_emitted"] == r["tau_emitted"]
            assert not any("baseline_parts_at" in q for q in rp["per_prompt"])
    # --baseline_only (the testbed's, beside its extraction): the file the untrained evaluation makes, made with the
    # run's settings or, before any run exists, from its target, the prompts and the corpus's template settings
    from dflash_offline.evaluation import run_info

    ri = run_info(run)
    only = [f"--prompts={prompts}", "--num_prompts=3", "--max_new_tokens=12", "--timed_alone=2", "--baseline_only=1"]
    for i, how in enumerate(([f"--run={run}"], [f"--target={ri['target']}",
                                                f"--template_kwargs={json.dumps(ri['template_kwargs'])}"])):
        made = tmp_path / f"only{i}.json"
        assert evaluate.main([*how, *only, f"--baseline={made}"]) == 0
        assert json.loads(made.read_text())["key"] == json.loads(timed.read_text())["key"]
        assert [(d["ids"], d["stats"]["rollback"]) for d in json.loads(made.read_text())["decodes"]] == \
            [(d["ids"], d["stats"]["rollback"]) for d in timed_decodes]
    stamp = made.stat().st_mtime_ns  # (made again for the same key: kept as it is)
    assert evaluate.main([*how, *only, f"--baseline={made}"]) == 0 and made.stat().st_mtime_ns == stamp
    assert "already there" in capfd.readouterr().out
    with pytest.raises(ConfigError, match="baseline_only without --run needs --target="):
        evaluate.main([*only, f"--baseline={made}"])
    with pytest.raises(ConfigError, match="--baseline=off leaves it nothing to do"):
        evaluate.main([f"--run={run}", *only, "--baseline=off"])
    with pytest.raises(ConfigError, match=r"missing required eval setting\(s\): --run \(make RUN=\)$"):
        evaluate.main([f"--prompts={prompts}"])
    # a reference read from the baseline that this process's target decodes otherwise (made in another process, on
    # another machine, under other kernel choices) is decoded again here before the real decode is judged against it
    data = json.loads(timed.read_text())
    tampered = data["decodes"][0]["ids"]
    tampered[3] = 5 if tampered[3] != 5 else 6
    timed.write_text(json.dumps(data))
    assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                 f"--baseline={timed}", "--replay=1", "--check_prompts=2"]) == 0
    rp = json.loads(out.read_text())
    assert rp["lossless"] and [q.get("baseline_parts_at") for q in rp["per_prompt"]] == [3, None, None]
    # --timed_alone only where the baseline is written: a file read is kept as it is, and off writes none
    alone_decodes.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculate, "greedy_generate", lambda *a, **k: alone_decodes.append(a[2]) or greedy(*a, **k))
        assert evaluate.main(args + ["--untrained=1", "--tf_batches=0", "--spec_prompts=1", "--timed_alone=3",
                                     f"--baseline={base}"]) == 0
        assert evaluate.main(args + ["--untrained=1", "--tf_batches=0", "--spec_prompts=1", "--timed_alone=3",
                                     "--baseline=off"]) == 0
    assert [n for n in alone_decodes if n != 2] == [12]  # (the one prompt decoded with the drafter: off)

    # τ replayed on the baseline's greedy outputs: the decode's τ; two prompts also decoded for real (the lossless
    # check and the speed figures come from them), one not at all (no speed figures); drafting 4 anchors at once
    for check, batch in ((2, 0), (0, 0), (2, 4)):
        assert evaluate.main(args + [f"--export={run / 'eval-export'}", "--tf_batches=0", f"--out={out}",
                                     f"--baseline={base}", "--replay=1", f"--check_prompts={check}",
                                     f"--replay_batch={batch}"]) == 0
        rp = json.loads(out.read_text())
        assert rp["tau_from"] == "replay" and rp["tau_emitted"] == r["tau_emitted"]
        assert rp["verify_steps"] == r["verify_steps"] and rp["new_tokens"] == r["new_tokens"]
        assert rp["replay_check"] == {"prompts": check, "agree": check} and rp["lossless_prompts"] == check
        assert [p["emitted"] for p in rp["per_prompt"]] == [p["emitted"] for p in r["per_prompt"]]
        assert (rp["speedup"] is None) == (check == 0) and (rp["verify_ms"] is None) == (check == 0)
    for arg in ("--check_prompts=1", "--replay_batch=4"):
        with pytest.raises(ConfigError, match="need --replay=1"):
            evaluate.main(args + [arg])

    # a prompts file with a bad line: one error naming file:line, before the target loads
    from dflash_offline import evalrun

    bad = tmp_path / "bad.jsonl"
    good = prompts.read_text().splitlines()[0]
    for line, want in (('{"messages": [{"role": "user"', "invalid_json: .* at column 30;"),
                       ('{"messages": [{"role": "user"}]}', r"non_string_content: messages\[0\].content is NoneType")):
        bad.write_text(f"{good}\n\n{line}\n")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(evalrun, "load_target", lambda *a: pytest.fail("the target loaded before the prompts were read"))
            with pytest.raises(ValueError, match=rf"^{bad}:3: {want}.*fix or remove the line"):
                evaluate.main(args + [f"--prompts={bad}", f"--export={run / 'eval-export'}"])
    # a template setting the target's template does not read (a typo): refused by name, before the target loads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evalrun, "load_target", lambda *a: pytest.fail("the target loaded before the settings were checked"))
        with pytest.raises(ValueError, match=r"eval.template_kwargs: the chat template of .* does not read "
                                             r"reasoning_efort"):
            evaluate.main(args + ['--template_kwargs={"reasoning_efort": "low"}', f"--export={run / 'eval-export'}"])

    # the training cache deleted (23 TB for a 27B run) or the run read from elsewhere: eval finds the target the run
    # recorded; only the teacher-forced estimate needs the cache, and says so before anything loads
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["target"] == str(Path(recorded["target"]).resolve()) and Path(recorded["target"]).is_dir()
    gone = dict(recorded, train=dict(recorded["train"], cache=str(tmp_path / "gone")), cache_dir=str(tmp_path / "gone"))
    (run / "config.json").write_text(json.dumps(gone))
    quick = [f"--run={run}", f"--prompts={prompts}", "--num_prompts=1", "--max_new_tokens=4",
             f"--export={run / 'eval-export'}", f"--out={tmp_path / 'gone.json'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evalrun, "load_target", lambda *a: pytest.fail("the target loaded before the cache was looked for"))
        with pytest.raises(ValueError, match=r"reads the run's training cache .*gone, which is gone: pass "
                                             r"--tf_batches=0"):
            evaluate.main(quick)
    assert evaluate.main(quick + ["--tf_batches=0"]) == 0 and json.loads((tmp_path / "gone.json").read_text())["lossless"]
    # the cache gone, the eval target is checked against the fingerprint the run recorded
    with pytest.raises(TargetError, match=f"eval target {twin} is not the target {run} was trained for"):
        evaluate.main(quick + ["--tf_batches=0", f"--target={twin}"])
    (run / "config.json").write_text(json.dumps(dict(gone, target=str(twin))))  # its own target, changed in place
    with pytest.raises(TargetError, match=f"target {twin} has changed since {run} was trained for it \\(config_sha256 "
                                          f".* in {run}/config.json\\): .* put them back"):
        evaluate.main(quick + ["--tf_batches=0"])
    older = {k: v for k, v in gone.items() if k not in ("target", "target_id")}  # a run made before it recorded them
    (run / "config.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"names no target and its training cache .* is gone: pass --target="):
        evaluate.main(quick + ["--tf_batches=0"])
    capfd.readouterr()
    assert evaluate.main(quick + ["--tf_batches=0", f"--target={recorded['target']}"]) == 0
    assert f"{run} records no fingerprint of its target and its cache is gone" in "".join(capfd.readouterr())


def count_selector_walks(monkeypatch) -> dict:
    """From now on, the exported drafters' drafting steps (`ExportedDrafter.draft`) are counted, with the classes
    that drafted and their candidate selectors' walks: {"drafts", "walks", "classes"}."""
    from dflash_offline import speculate

    seen = {"drafts": 0, "walks": 0, "classes": set()}
    draft = speculate.ExportedDrafter.draft

    def counting(self, *a, **kw):
        sel = self.model.candidate_selector
        if not getattr(sel, "counted", False):
            walk = sel.walk
            sel.walk = lambda *x, **y: seen.update(walks=seen["walks"] + 1) or walk(*x, **y)
            sel.counted = True
        seen["drafts"] += 1
        seen["classes"].add(type(self.model).__name__)
        return draft(self, *a, **kw)

    monkeypatch.setattr(speculate.ExportedDrafter, "draft", counting)
    return seen


def test_evaluate_a_dflash2_run_drafts_with_the_selector_losslessly(tmp_path, hidden_cache, monkeypatch):
    """A tiny DFlash2 run trained, exported and evaluated end to end: the export loads as DFlash2DraftModel, every
    draft is its selector's walk (`draft_tokens`, as the engines draft), the decodes are lossless, the replay takes
    the decodes' steps, and the teacher-forced estimate runs on the same weights."""
    from dflash_offline.trainsetup import TrainConfig
    from stages import evaluate, train

    run = tmp_path / "run"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_anchors=8, batch_rows=2, log_every=1, trackers="none", block_size=8,
                          steps=2, ckpt_every=2, variant="dflash2", selector_rank=8, selector_top_k=4).resolve())
    seen = count_selector_walks(monkeypatch)
    prompts = prompts_with_categories(tmp_path / "eval.jsonl", 3)
    assert evaluate.main([f"--run={run}", f"--prompts={prompts}", "--num_prompts=3", "--max_new_tokens=12",
                          "--tf_batches=1", "--tf_rows=2", "--replay=1", "--check_prompts=3"]) == 0
    r = json.loads((run / "eval.json").read_text())
    cfg = json.loads((run / "eval-export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and seen["classes"] == {"DFlash2DraftModel"}
    assert r["lossless"] and r["exact"] and all(p["equal"] for p in r["per_prompt"])
    assert r["replay_check"] == {"prompts": 3, "agree": 3} and r["lossless_prompts"] == 3
    assert seen["drafts"] == seen["walks"] > 0 and sum(r["tau_hist"]) == r["verify_steps"] > 0
    assert r["block_size"] == 8 and r["teacher_forced"]["batches"] == 1


def untrained_eval_args(tmp_path, hidden_cache, n: int) -> tuple[list[str], Path, Path]:
    """stages.evaluate's arguments for an untrained drafter of the test shapes on `n` demo prompts (6 new tokens, no
    teacher-forced estimate), its JSON out and the prompts file."""
    run = tmp_path / "run"
    run.mkdir()
    dc = {"hidden_size": 64, "intermediate_size": 64, "vocab_size": 2048, "num_target_layers": 8,
          "target_layer_ids": json.loads((hidden_cache / "manifest.json").read_text())["config"]["layer_ids"],
          "mask_token_id": 1999, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": L}
    (run / "config.json").write_text(json.dumps({"train": {"cache": str(hidden_cache), "target": "", "seed": 0},
                                                 "drafter": dc}))
    prompts = democorpus.write_jsonl(tmp_path / "eval.jsonl", n, seed=1_000_003)
    out = tmp_path / "e.json"
    return ([f"--run={run}", f"--prompts={prompts}", f"--num_prompts={n}", "--max_new_tokens=6", "--tf_batches=0",
             "--untrained=1", f"--out={out}"], out, prompts)


def test_evaluate_fails_on_a_difference_in_float32_and_counts_ties_in_bfloat16(tmp_path, hidden_cache, monkeypatch):
    """A broken decoder (last token changed) must be caught: in float32 any difference fails (exit 1, lossless false
    in the JSON); in bfloat16 a difference within `tie_tol` of the target's top logit is a tie, beyond it a failure."""
    from dflash_offline import speculate
    from stages import evaluate

    real = speculate.speculative_generate

    def broken(*a, **kw):
        out, st = real(*a, **kw)
        return out[:-1] + [(out[-1] + 1) % 1900], st

    monkeypatch.setattr(speculate, "speculative_generate", broken)
    args, out, _ = untrained_eval_args(tmp_path, hidden_cache, 1)
    assert evaluate.main(args + ["--tie_tol=1e9"]) == 1  # float32 (auto on a CPU): tie_tol does not apply
    r = json.loads(out.read_text())
    assert r["dtype"] == "float32" and r["mode"] == "exact" and r["tie_tol"] is None
    assert not r["lossless"] and not r["exact"] and r["mismatches"] == [0] and r["rounding_ties"] == []
    div = r["per_prompt"][0]["divergence"]
    assert div["at"] == 5 and div["margin"] > 0 and not div["tie"] and sum(r["tie_margin_hist"]["counts"]) == 1

    assert evaluate.main(args + ["--dtype=bfloat16", "--tie_tol=1e9"]) == 0
    r = json.loads(out.read_text())
    assert r["dtype"] == "bfloat16" and r["mode"] == "ties allowed" and r["lossless"] and not r["exact"]
    assert r["rounding_ties"] == [0] and r["per_prompt"][0]["divergence"]["tie"]
    assert sum(r["tie_margin_hist"]["counts"]) == 1
    assert evaluate.main(args + ["--dtype=bfloat16", "--tie_tol=0"]) == 1
    assert json.loads(out.read_text())["mismatches"] == [0]


def test_evaluate_refuses_prompts_the_target_answers_at_once_instead_of_reporting_tau_nan(tmp_path, hidden_cache,
                                                                                        monkeypatch):
    """Every answer ended at its first token (every id an end of turn here: a target that answers nothing, as the
    short testbed's did on an H100): no verify step, τ undefined. The evaluation says so, naming the prompts file,
    instead of writing τ = nan; one more token a prompt and it measures."""
    from dflash_offline import evalrun
    from stages import evaluate

    args, out, prompts = untrained_eval_args(tmp_path, hidden_cache, 2)
    real = evalrun.eos_ids
    monkeypatch.setattr(evalrun, "eos_ids", lambda target, tok: list(range(2048)))
    with pytest.raises(ValueError, match=f"{prompts}: the target ended its answer to every one of the 2 prompts"):
        evaluate.main(args)
    assert not out.exists()
    monkeypatch.setattr(evalrun, "eos_ids", real)
    assert evaluate.main(args) == 0 and json.loads(out.read_text())["verify_steps"] > 0
    from dflash_offline.config import ConfigError

    # one new token is the prefill's: refused before anything loads
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 2"):
        evaluate.main(args + ["--max_new_tokens=1"])


def test_a_category_whose_answers_all_end_at_once_has_no_tau_in_the_report_not_nan():
    """Overall τ is refused without a verify step; a category of prompts whose every answer ended at its first token
    reports τ None (valid JSON), shown as "—", while the others keep theirs."""
    from dflash_offline.evaluation import by_category, tau_text
    from dflash_offline.speculate import GenStats

    stats = [GenStats(block_size=4, accepted=[2, 0], emitted=[3, 1]), GenStats(block_size=4)]
    cats = by_category(stats, [{"category": "math"}, {"category": "words"}])
    assert cats["math"]["tau_mean"] == 2.0 and cats["math"]["verify_steps"] == 2
    assert cats["words"] == {"prompts": 1, "verify_steps": 0, "tau_mean": None, "tau_emitted": None,
                             "accept_ge": None}
    json.dumps(cats, allow_nan=False)
    assert (tau_text(cats["math"]["tau_mean"]), tau_text(cats["words"]["tau_mean"])) == ("2.00", "—")
