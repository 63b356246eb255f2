"""The benchmarks' CPU smoke modes run end to end and report what the GPU runs report (so they do not rot between
GPU runs): ours and the baseline in one invocation, a ratio, JSON output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_offline.trainsetup import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def run_bench(module: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), DFLASH_NO_BAR="1")
    p = subprocess.run([sys.executable, "-m", module, "--tiny", f"--workdir={tmp_path / 'w'}", f"--out={out}", *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def test_bench_extract_tiny(tmp_path):
    res, stdout = run_bench("bench.extract", tmp_path, "--shards=3")
    assert res["ours"]["row_tok_per_s"] > 0 and res["plain_hf"]["row_tok_per_s"] > 0
    assert 0 < res["ours"]["busy_frac"] <= 1
    assert res["ours"]["steady_row_tok_per_s"] > 0
    assert "ratio ours / plain" in stdout and "steady state tok/s" in stdout


def test_bench_extract_refuses_a_run_the_disk_cannot_hold(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DFLASH_NO_BAR="1")
    p = subprocess.run([sys.executable, "-m", "bench.extract", "--tiny", f"--workdir={tmp_path / 'w'}",
                        "--shards=100000000"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode != 0 and "free" in p.stderr and "need" in p.stderr, p.stderr[-2000:]


def test_gpu_sampler_averages_the_samples_of_a_time_range():
    from bench.gpu import GpuSampler

    s = GpuSampler.__new__(GpuSampler)  # no NVML here: fill in samples by hand
    s.samples = [(10.0, 1500.0, 600.0), (11.0, 1700.0, 700.0), (12.0, 1980.0, 100.0)]
    assert s.between(9.5, 11.5) == {"sm_mhz": 1600.0, "sm_mhz_min": 1500.0, "power_w": 650.0}
    assert s.between(20.0, 30.0) == {}


@pytest.mark.parametrize("rows", ["bench", "chat"])
def test_bench_train_tiny_with_profile_and_accumulation(tmp_path, rows):
    chunk = 60 if rows == "chat" else None  # 4 blocks of 15 scored slots per lm_head chunk: the tiny run has 2
    weighting = "dpace" if rows == "chat" else "decay"  # (D-PACE's epilogue, run twice a chunk, in the timed step)
    res, stdout = run_bench("bench.train", tmp_path, "--steps=8", "--log_every=2", "--profile_steps=2", "--accum=2",
                            f"--rows={rows}", f"--weighting={weighting}",
                            *([f"--loss_chunk_tokens={chunk}"] if chunk else []))
    ours = res["ours"]
    assert ours["weighting"] == weighting
    chunk = chunk or TrainConfig.of(cache="").loss.loss_chunk_tokens  # the trainer's default
    assert res["rows"] == rows and ours["loss_chunk_tokens"] == chunk
    assert f"| rows, attn, loss logits, TF32, loss chunk tokens | {rows}, dense, fp32, False, {chunk} |" in stdout
    assert ours["loss_logits"] == "fp32" and ours["tf32"] is False  # (the CPU: no TF32)
    assert ours["tok_per_s"] > 0 and res["baseline"]["tok_per_s"] > 0 and ours["recompiles"] == 0
    assert "ours / baseline" in stdout and ours["profile"] and "training steps" in ours["profile"]


def test_bench_train_chat_rows_are_packed_chat():
    """--rows=chat: several documents per row (positions restart), each a prompt without loss then an answer with
    loss; rows from the packer's steady state, not only whole-row documents."""
    import numpy as np
    import torch

    from bench.train import chat_token_rows

    a = chat_token_rows(0, 8, 2048, torch.Generator().manual_seed(0), vocab=1000)
    assert a["input_ids"].shape == (8, 2048) and int(a["input_ids"].max()) < 1000
    docs = [int(d.max()) + 1 for d in a["doc_ids"]]
    assert sum(d > 1 for d in docs) >= 6, docs  # not the packer's first rows (one whole-row document each)
    for i in range(8):
        for d in range(docs[i]):
            at = a["doc_ids"][i] == d
            n, lm, pos = int(at.sum()), a["loss_mask"][i][at], a["position_ids"][i][at]
            assert (pos == np.arange(n)).all()
            assert not lm[: int(np.ceil(0.3 * n))].any() and lm[int(np.ceil(0.3 * n)):].all(), (i, d)
        assert not a["loss_mask"][i][a["doc_ids"][i] < 0].any()


@pytest.mark.parametrize("rows", ["2"])
def test_bench_extract_layers_tiny(tmp_path, rows):
    res, stdout = run_bench("bench.extract_layers", tmp_path, f"--batch_rows={rows}", "--reps=1")
    r = res["rows"][rows]
    assert r["est tok/s hf"] > 0 and r["est tok/s reference/eager"] > 0 and r["segments"] >= int(rows)
    assert "per layer" in stdout


def test_bench_train_attention_tiny(tmp_path):
    out = tmp_path / "attn.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "bench.train_attention", "--tiny",
                        "--variants=default,rows safe,joint kv32,split,split kv32", "--reps=1", f"--out={out}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert {(r["variant"], r["mask"], r["rows"]) for r in res} == {
        (v, m, k) for v in ("default", "rows safe", "joint kv32") for m in ("bounds", "docs") for k in ("bench", "chat")
    } | {(v, "split", k) for v in ("split", "split kv32") for k in ("bench", "chat")}
    assert all(r["ms_fwd"] > 0 and 0 < r["density"] < 1 for r in res)
    # every formulation computes the attention of the DFlash mask: fp32 SDPA with the dense mask
    assert all(r["max_abs_diff"] < 1e-4 for r in res), [(r["variant"], r["max_abs_diff"]) for r in res]


def test_bench_train_loss_tiny(tmp_path):
    out = tmp_path / "loss.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "bench.train_loss", "--tiny", f"--out={out}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["loss"]) == {"eager chunk 4096", "eager chunk 8192"} and all(v["ms"] > 0 for v in res["loss"].values())
    assert res["epilogue"]["eager"]["ms"] > 0 and "epilogue alone" in p.stdout


def test_trace_gaps_finds_device_idle_and_the_host_work_meanwhile(tmp_path):
    """Two streams overlapping, one 300 µs hole while the host runs `aten::nonzero`: one gap, the busy time right."""
    from bench.trace_gaps import device_gaps, host_ops_during

    ev = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 50, "dur": 100},  # other stream, overlapping
          {"ph": "X", "cat": "kernel", "name": "b", "ts": 450, "dur": 50},
          {"ph": "X", "cat": "kernel", "name": "c", "ts": 505, "dur": 10},  # a 5 µs hole: below the threshold
          {"ph": "X", "cat": "cpu_op", "name": "aten::nonzero", "ts": 140, "dur": 290},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 20}]
    gaps, busy, span = device_gaps(ev, 20.0)
    assert gaps == [(150, 300, "copy", "b")] and busy == 150 + 50 + 10 and span == 515
    assert host_ops_during(ev, 150, 450) == ["aten::nonzero (280)"]


def test_bench_train_tiny_on_a_projected_fp8_cache(tmp_path):
    """`--project_dims=k --quant=fp8`: ours on a bf16 cache of the same shapes, then on the encoded one, whose trainer
    reads k values a tap (its fc reads k × taps); the table gives the encoded / bf16-cache rate."""
    res, stdout = run_bench("bench.train", tmp_path, "--steps=4", "--log_every=2", "--project_dims=32", "--quant=fp8",
                            "--skip_baseline")
    assert res["project_dims"] == 32 and res["quant"] == "fp8" and "baseline" not in res
    for key in ("ours", "ours_encoded", "ours_again"):  # bf16 cache, encoded, bf16 cache again (A, B, A)
        assert res[key]["tok_per_s"] > 0 and res[key]["recompiles"] == 0
    cfg = json.loads((tmp_path / "w" / "run-encoded" / "config.json").read_text())
    assert cfg["drafter"]["tap_width"] == 32 and cfg["projection"]["dims"] == 32
    ref = json.loads((tmp_path / "w" / "run" / "config.json").read_text())
    assert ref["drafter"]["tap_width"] == 0 and "projection" not in ref
    want = res["ours_encoded"]["tok_per_s"] / ((res["ours"]["tok_per_s"] + res["ours_again"]["tok_per_s"]) / 2)
    assert f"| fp8 k=32 cache / bf16 cache (its two runs): tok/s | | {want:.3f} | |" in stdout
    drift = res["ours_again"]["tok_per_s"] / res["ours"]["tok_per_s"]
    assert f"| the first run again / the first: tok/s (drift over the call) | | | {drift:.3f} |" in stdout


def test_bench_train_tiny_times_dflash2_against_dflash_at_a_recipe_s_shapes(tmp_path):
    """--recipe=manifests/qwen3.8-27b-dflash2.toml: the recipe's drafter (block 8, every layer sliding over 2048,
    bidirectional in the block, γ 4, the conv and selector settings) at the tiny sizes, timed as DFlash, as DFlash2,
    then as DFlash again (A, B, A); the table gives DFlash2 / DFlash against the mean of the DFlash runs."""
    res, stdout = run_bench("bench.train", tmp_path, "--steps=4", "--log_every=2", "--skip_baseline",
                            f"--recipe={REPO / 'manifests' / 'qwen3.8-27b-dflash2.toml'}")
    assert [res[k]["variant"] for k in ("ours", "ours_dflash2", "ours_again")] == ["dflash", "dflash2", "dflash"]
    assert "baseline" not in res and res["shape"]["block"] == 8
    for name in ("run", "run-dflash2", "run-again"):
        cfg = json.loads((tmp_path / "w" / name / "config.json").read_text())
        d = cfg["drafter"]
        assert (d["block_size"], d["block_attention"], d["sliding_window"]) == (8, "bidirectional", 2048), name
        assert d["layer_types"] == ["sliding_attention"] * 2 and d["hidden_size"] == 64, name  # (the tiny sizes)
        assert cfg["train"]["gamma"] == 4.0 and res["ours"]["recompiles"] == 0
    assert (d["selector_rank"], d["selector_top_k"]) == (256, 16)
    ref = (res["ours"]["tok_per_s"] + res["ours_again"]["tok_per_s"]) / 2
    assert f"| DFlash2 / DFlash (its two runs): tok/s, peak GB | | {res['ours_dflash2']['tok_per_s'] / ref:.3f}, " \
           in stdout
    assert "| drafter: variant, block, layers | dflash, 8, 2 | dflash2, 8, 2 | dflash, 8, 2 |" in stdout


def test_bench_resident_times_each_threads_count_cold_and_warm_and_leaves_nothing(tmp_path):
    """bench.resident on the CPU: a fake cache of 4 rows (2,048 tokens, 5 taps of 768) read with 1 and 2 threads, cold
    and warm: every read holds the same bytes on as many threads as asked (at most the shards), its folder removed;
    a folder that holds files is refused, not removed."""
    from bench import resident

    res = resident.main([f"--dir={tmp_path / 'b'}", "--rows=4", "--shards=2", "--threads=1,2", "--repeats=1",
                         "--device=cpu", f"--out={tmp_path / 'r.json'}"])
    runs = res["runs"]
    assert [(r["threads_asked"], r["state"]) for r in runs] == [(1, "cold"), (1, "warm"), (2, "cold"), (2, "warm")]
    assert len({r["bytes"] for r in runs}) == 1 and all(r["threads"] == r["threads_asked"] for r in runs)
    assert json.loads((tmp_path / "r.json").read_text())["runs"] == runs and not (tmp_path / "b").exists()
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("x")
    with pytest.raises(SystemExit, match="holds files"):
        resident.main([f"--dir={tmp_path / 'keep'}", "--rows=4", "--shards=2", "--device=cpu"])
    assert (tmp_path / "keep" / "mine.txt").is_file()
