"""Speculative decoding is lossless (== the target's greedy output) on both tiny targets, whatever the drafter proposes;
the serving drafter equals the training forward; `stages.evaluate` runs end to end on a tiny trained run."""

import json
import random

import pytest
import torch

from dflash_offline import democorpus
from dflash_offline.drafter import DFlashDrafter, DrafterConfig
from dflash_offline.speculate import Drafter, greedy_generate, speculative_generate
from stages.evaluate import render_prompt

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


class ScriptedDrafter:
    """Proposes the reference continuation, each token replaced by a random one with probability 1 - p.

    p = 1: an oracle (τ = L); p = 0: random tokens (τ ≈ 1). Records the contexts it is given.
    """

    def __init__(self, ref: list[int], p: float, vocab: int, seed: int = 0):
        self.ref, self.p, self.vocab, self.rng = ref, p, vocab, random.Random(seed)
        self.block_size, self.layer_ids = L, TAPS
        self.calls = []

    def draft(self, ctx_1nK, ids_1n1, block_size, cache=None):
        n = ids_1n1.shape[1] - 1
        assert ctx_1nK.shape[1] == n, "context = every position before the anchor"
        assert ids_1n1[0].tolist() == self.ref[: n + 1], "ids = the emitted sequence (lossless so far)"
        self.calls.append(ctx_1nK)
        out = []
        for k in range(1, block_size):
            t = self.ref[n + k] if n + k < len(self.ref) else 0
            out.append(t if self.rng.random() < self.p else self.rng.randrange(self.vocab))
        return torch.tensor(out)


def check_stats(out, st, L_):
    assert 1 + sum(st.emitted) == len(out) == st.new_tokens
    assert sum(st.tau_hist) == st.steps and len(st.tau_hist) == L_
    assert st.target_forwards == 1 + st.steps + st.refeeds
    assert all(e <= n + 1 for e, n in zip(st.emitted, st.accepted, strict=True))
    assert st.emitted[:-1] == [n + 1 for n in st.accepted[:-1]]  # only the last step may be cut short


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_lossless_with_any_drafter(targets, arch):
    model, tok = targets[arch]
    vocab = model.config.vocab_size
    prompt = held_out_prompt(tok)
    N = 40
    ref, gst = greedy_generate(model, prompt, N + L, eos_ids=[])  # the oracle knows a block past the end
    assert gst.target_forwards == len(ref) == N + L and gst.tau_hist == [gst.steps]
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
    ctx = drafter.calls[-1]
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


def tiny_drafter(layer_types=None, sliding_window=None) -> Drafter:
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, vocab_size=300, target_layer_ids=[0, 2],
                        num_target_layers=4, mask_token_id=299, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, block_size=L, layer_types=layer_types, sliding_window=sliding_window)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    return Drafter(model, torch.randn(300, 32), torch.randn(300, 32))


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_serving_drafter_equals_training_forward(kind):
    """The cached single-anchor path == the reference single-anchor path == the training forward over the full row."""
    d = tiny_drafter(*((["sliding_attention", "full_attention"], 5) if kind == "sliding" else ()))
    S = 24
    g = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(1, S, 64, generator=g), torch.randint(0, 299, (1, S), generator=g)
    anchors = torch.tensor([[3, 4, 9, 10, 17, 23]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    masks = d.model.build_masks(torch.zeros(1, S, dtype=torch.long), anchors, keep, "dense")
    with torch.no_grad():
        train_h = d.model(hidden, ids, torch.arange(S)[None], anchors, keep, d.embed, masks, "dense")[0]
    cache = d.new_cache()
    for a, p in enumerate(anchors[0].tolist()):
        want = train_h[a * L:(a + 1) * L]
        ref = d.block_hidden(hidden[:, :p], ids[:, : p + 1])
        cached = d.block_hidden(hidden[:, :p], ids[:, : p + 1], cache)
        torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cached, want, rtol=1e-5, atol=1e-5)
        drafts = d.draft(hidden[:, :p], ids[:, : p + 1])
        assert drafts.shape == (L - 1,) and torch.equal(drafts, (want[1:] @ d.lm_head.t()).argmax(-1))
    assert cache.length == anchors[0, -1]


def test_drafter_lossless_on_hybrid_target(targets, qwen35_dir):
    """A real (untrained) DFlash drafter with its cache, on the hybrid target."""
    model, tok = targets["qwen3_5"]
    info = model.config
    cfg = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=64, vocab_size=info.vocab_size,
                        target_layer_ids=TAPS, num_target_layers=info.num_hidden_layers, mask_token_id=1999,
                        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, block_size=L)
    drafter = Drafter.untrained(cfg, qwen35_dir, seed=0)
    prompt = held_out_prompt(tok, 2)
    greedy, _ = greedy_generate(model, prompt, 24, eos_ids=[1988])
    out, st = speculative_generate(model, drafter, prompt, 24, eos_ids=[1988])
    assert out == greedy
    check_stats(out, st, L)


def test_evaluate_cli(tmp_path, hidden_cache):
    from dflash_offline.config import TrainConfig
    from stages import evaluate, train

    run = tmp_path / "run"
    train.run(TrainConfig(cache=str(hidden_cache), run=str(run), num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_anchors=8, batch_rows=2, log_every=1, trackers="none", block_size=8,
                          steps=2, ckpt_every=2).resolve())
    prompts = democorpus.write_jsonl(tmp_path / "eval.jsonl", 3, seed=1_000_003)
    args = [f"--run={run}", f"--prompts={prompts}", "--num_prompts=2", "--max_new_tokens=12", "--tf_batches=1",
            "--tf_rows=2"]
    assert evaluate.main(args) == 0
    r = json.loads((run / "eval.json").read_text())
    assert r["lossless"] and r["num_prompts"] == 2 and r["step"] == 2 and not r["untrained"]
    assert r["block_size"] == 8 and len(r["tau_hist"]) == 8 and sum(r["tau_hist"]) == r["verify_steps"] > 0
    assert r["rollback"] == "refeed" and r["speedup"] > 0 and 1 <= r["tau_mean"] <= 8
    tf = r["teacher_forced"]
    assert tf["batches"] == 1 and not tf["held_out"] and 1 <= tf["sim_tau"] <= 8 and len(tf["acc"]) == 7
    assert all(p["equal"] for p in r["per_prompt"])
    assert evaluate.main(args + ["--untrained=1", "--tf_batches=0"]) == 0
    u = json.loads((run / "eval-untrained.json").read_text())
    assert u["untrained"] and u["lossless"] and u["exact"] and u["teacher_forced"]["batches"] == 0


def test_evaluate_fails_on_a_mismatch(tmp_path, hidden_cache, monkeypatch):
    """A broken decoder (last token changed) must be caught: exit status 1, lossless false in the JSON."""
    from dflash_offline import speculate
    from stages import evaluate

    real = speculate.speculative_generate

    def broken(*a, **kw):
        out, st = real(*a, **kw)
        return out[:-1] + [(out[-1] + 1) % 1900], st

    monkeypatch.setattr(speculate, "speculative_generate", broken)
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"cache": str(hidden_cache), "target": "", "seed": 0},
                                                 "drafter": tiny_config(hidden_cache)}))
    prompts = democorpus.write_jsonl(tmp_path / "eval.jsonl", 1, seed=1_000_003)
    out = tmp_path / "e.json"
    assert evaluate.main([f"--run={run}", f"--prompts={prompts}", "--num_prompts=1", "--max_new_tokens=6",
                          "--tf_batches=0", "--untrained=1", f"--out={out}"]) == 1
    r = json.loads(out.read_text())
    assert not r["lossless"] and r["mismatches"] == [0] and r["per_prompt"][0]["divergence"]["at"] == 5


def tiny_config(cache) -> dict:
    from dflash_offline.manifest import read_manifest

    m = read_manifest(cache)
    return {"hidden_size": 64, "intermediate_size": 64, "vocab_size": 2048, "target_layer_ids": m["config"]["layer_ids"],
            "num_target_layers": 8, "mask_token_id": 1999, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 16, "block_size": L}
