"""Eval on CUDA (make test-gpu): the exported drafter drafts on the GPU, decoding stays lossless on both tiny targets
in float32 and its τ per step equals dflash.py's spec_generate; draft/verify times come from CUDA events and fit in
the wall clock; `stages.evaluate` picks float32 (exact mode, TF32 off) for a small target on a GPU and, in bfloat16,
accounts for every difference as a tie or a mismatch with its margin."""

import json
import time

import pytest
import torch

from dflash_offline.speculate import (
    ExportedDrafter,
    PhaseTimer,
    greedy_generate,
    load_exported,
    speculative_generate,
)
from fixtures import democorpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda", 0)


def test_phase_timer_reads_cuda_events():
    timer = PhaseTimer(DEV)
    x = torch.randn(2048, 2048, device=DEV)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m0 = timer.mark()
    for _ in range(20):
        x = x @ x.t() / 2048
    m1 = timer.mark()
    timer.step(m0, m1)
    (ms,) = timer.spans_ms()[0]  # synchronizes
    assert 0 < ms <= 1e3 * (time.perf_counter() - t0)  # GPU time between the marks, within the wall clock


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_exported_drafter_on_cuda(tmp_path, qwen3_dir, qwen35_dir, arch):
    from test_speculate import L, exported, held_out_prompt, two_token_head
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = qwen3_dir if arch == "qwen3" else qwen35_dir
    model, artifact = load_exported(exported(tmp_path, target_dir), DEV, torch.float32)
    assert next(model.parameters()).device == DEV
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, device_map=str(DEV)).eval()
    two_token_head(target)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    drafter = ExportedDrafter(model, target)
    for i, n in ((0, 24), (1, 16)):
        prompt = held_out_prompt(tok, i)
        greedy, gst = greedy_generate(target, prompt, n, eos_ids=[])
        t0 = time.perf_counter()
        out, st = speculative_generate(target, drafter, prompt, n, eos_ids=[])
        wall_ms = 1e3 * (time.perf_counter() - t0)
        zlab = model.spec_generate(target, torch.tensor([prompt], device=DEV), max_new_tokens=n, return_stats=True)
        assert out == greedy == zlab.output_ids[0, len(prompt):].tolist()
        assert [a + 1 for a in st.accepted] == zlab.acceptance_lengths
        assert len(st.draft_ms) == len(st.verify_ms) == st.steps and len(st.tau_hist) == L
        assert all(t > 0 for t in st.draft_ms + st.verify_ms + gst.verify_ms)
        assert sum(st.draft_ms) + sum(st.verify_ms) + sum(st.rollback_ms) <= wall_ms


def test_evaluate_on_cuda_exact_and_bf16(tmp_path, hidden_cache):
    from dflash_offline.trainsetup import TrainConfig
    from stages import evaluate, train

    run = tmp_path / "run"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_anchors=8, batch_rows=2, log_every=1, trackers="none", block_size=8,
                          steps=20, ckpt_every=20).resolve())
    recs = [{**r, "category": ("a", "b")[i % 2]} for i, r in enumerate(democorpus.generate(6, 1_000_003))]
    prompts = democorpus.write_jsonl(tmp_path / "eval.jsonl", 6, records=recs)
    args = [f"--run={run}", f"--prompts={prompts}", "--num_prompts=6", "--max_new_tokens=48", "--tf_batches=1",
            "--device=cuda"]
    assert evaluate.main(args) == 0  # auto: float32 for the tiny target
    r = json.loads((run / "eval.json").read_text())
    assert r["dtype"] == "float32" and r["mode"] == "exact" and r["lossless"] and r["exact"]
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert r["device"].startswith("cuda") and r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["speedup_engine_est"] > 0
    assert set(r["by_category"]) == {"a", "b"} and len(r["accept_ge"]) == 7
    # τ replayed, drafting 16 anchors a forward (CUDA's attention with the rows' masks, float32): the decode's steps
    out = tmp_path / "replay.json"
    assert evaluate.main(args + ["--replay=1", "--check_prompts=6", "--replay_batch=16", f"--out={out}"]) == 0
    rp = json.loads(out.read_text())
    assert rp["replay_check"] == {"prompts": 6, "agree": 6} and rp["tau_emitted"] == r["tau_emitted"]
    out = tmp_path / "bf16.json"
    code = evaluate.main(args + ["--dtype=bfloat16", f"--out={out}"])
    b = json.loads(out.read_text())
    assert b["dtype"] == "bfloat16" and b["mode"] == "ties allowed" and code == (0 if b["lossless"] else 1)
    assert sum(b["tie_margin_hist"]["counts"]) == len(b["rounding_ties"]) + len(b["mismatches"])
    for i in b["rounding_ties"]:
        assert b["per_prompt"][i]["divergence"]["margin"] <= b["tie_tol"]
