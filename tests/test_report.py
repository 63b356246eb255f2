"""stages.report: PNGs and index.md from a realistic metrics.jsonl (a resumed GPU run with a cut last line)."""

import json
import math
import random
import struct
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from dflash_offline import runlog  # noqa: E402
from stages import report  # noqa: E402


def fake_metrics(run: Path, steps: int = 600, log_every: int = 5, L: int = 15, gpu: bool = True,
                 seed: int = 0) -> Path:
    """What a DFlash run on an H200 logs: loss falling from ~11, later slots less accurate, warm-up then cosine lr,
    a slow compiled first step, one recompile, flat reserved memory; killed half way and resumed from an earlier
    checkpoint (9 steps logged twice), then killed mid-write at the end."""
    rng = random.Random(seed)
    run.mkdir(parents=True, exist_ok=True)

    def rec(step):
        prog = 1 - math.exp(-step / 150)
        acc = [min(0.97, max(0.0, 0.85 * 0.93 ** k * prog + rng.gauss(0, 0.015))) for k in range(L)]
        sim = 1 + sum(math.prod(acc[: k + 1]) for k in range(L))
        warm = 30
        lr = 6e-4 * (step / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm))))
        r = {"step": step, "loss": 2.4 + 8.7 * math.exp(-step / 90) * math.exp(rng.gauss(0, 0.05)),
             "acc": [round(a, 4) for a in acc], "sim_tau": sim, "block_tau": 1 + 0.93 * (sim - 1),
             "lr": lr, "grad_norm": 0.4 + 2.5 * math.exp(-step / 60) + abs(rng.gauss(0, 0.08)),
             "tok_per_s": (9_000 if step == log_every else 182_000 * (1 + rng.gauss(0, 0.02))),
             "ms_per_step": 720 * (20 if step == log_every else 1 + rng.gauss(0, 0.02)),
             "flop_frac": 0.02 if step == log_every else 0.36 + rng.gauss(0, 0.005),
             "data_wait_frac": max(0.0, 0.004 + rng.gauss(0, 0.002) + (0.05 if step == cut + 10 * log_every else 0)),
             "recompiles": 1 if step >= 0.7 * steps else 0, "time": 1.8e9 + step}
        if gpu:
            r["reserved_gb"] = 61.0 if step == log_every else 96.4
            r["peak_gb"] = 58.2 if step == log_every else 88.9
        return r

    cut = steps // 2 // log_every * log_every  # killed here, resumed from a checkpoint 9 log records earlier
    log = [rec(s) for s in range(log_every, cut + 1, log_every)]
    log += [rec(s) for s in range(max(log_every, cut - 8 * log_every), steps + 1, log_every)]
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log) + f'{{"step": {steps + log_every}, "loss": 2.')
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_report_of_a_gpu_run(tmp_path):
    run = tmp_path / "run"
    fake_metrics(run)
    accept_ge = [0.9 * 0.85 ** k for k in range(15)]
    ev = {"step": 600, "tau_mean": 1 + sum(accept_ge), "tau_hist": [3, 9, 20], "speedup": 3.2, "lossless": True,
          "num_prompts": 80, "verify_steps": 2400, "accept_ge": accept_ge, "draft_ms": 2.4, "verify_ms": 21.0,
          "speedup_engine_est": 4.8, "artifact": {"path": "/x/export", "weights_sha256": "ab" * 32},
          "by_category": {c: {"prompts": 20, "verify_steps": 600, "tau_mean": t, "accept_ge": accept_ge}
                          for c, t in (("chat", 4.1), ("code", 6.9), ("math", 7.7), ("tool-use", 5.2))},
          "teacher_forced": {"sim_tau": 3.6, "held_out": True, "acc": [0.8, 0.7]}, "per_prompt": [{"tau_mean": 6}]}
    (run / "eval.json").write_text(json.dumps(ev))
    (run / "eval-untrained.json").write_text(json.dumps({**ev, "step": 0, "tau_mean": 1.02,
                                                         "accept_ge": [0.02] + [0.0] * 14}))
    out = report.main([f"--run={run}"])
    assert out == run / "report"
    names = ["loss.png", "accuracy.png", "accuracy_final.png", "tau.png", "throughput.png", "memory.png", "eval.png"]
    for name in names:
        w, h = png_size(out / name)
        assert 800 <= w <= 2000 and 500 <= h <= 1200, (name, w, h)
        assert (out / name).stat().st_size > 20_000, name  # something was drawn
    index = (out / "index.md").read_text()
    for name in names:
        assert f"]({name})" in index
    assert "| last logged step | 600 |" in index and f"| real τ (eval.json) | {ev['tau_mean']:.3f} |" in index
    assert "| speed-up over the target alone (eval.json) | ×3.20 |" in index
    assert "| draft / verify ms per step (eval.json) | 2.40 / 21.00 |" in index
    assert "| engine speed-up estimate τ / (1 + draft/verify) (eval.json) | ×4.80 |" in index
    assert "| artifact.path | /x/export |" in index and "by_category" not in index
    assert "| lossless | True |" in index and "| teacher_forced.sim_tau | 3.6 |" in index and "per_prompt" not in index
    assert "logged twice" in index and "unreadable line" in index
    assert "| recompiles | 1 |" in index and "GPU memory reserved / peak (GiB) | 96.40 / 88.90" in index


def test_report_of_a_cpu_run_without_eval(tmp_path):
    run = tmp_path / "cpu"
    fake_metrics(run, steps=40, log_every=4, L=7, gpu=False)
    out = report.run(run)
    assert not (out / "memory.png").exists()  # no GPU memory logged: no memory figure
    for name in ["loss.png", "accuracy.png", "accuracy_final.png", "tau.png", "throughput.png"]:
        png_size(out / name)
    assert "real τ (eval.json)" not in (out / "index.md").read_text()
    (run / "eval.json").write_text(json.dumps({"tau_mean": 2.5, "speedup": 1.1}))  # an eval.json without acceptance
    out = report.run(run)  # per position: tau.png shows its τ, there is no eval.png
    assert not (out / "eval.png").exists() and "| real τ (eval.json) | 2.500 |" in (out / "index.md").read_text()
    (run / "eval.json").write_text(json.dumps({"tau_mean": 2.5, "accept_ge": [0.8, 0.5, 0.2]}))  # no categories
    w, h = png_size(report.run(run) / "eval.png")
    assert 800 <= w <= 2000 and 500 <= h <= 1200


def test_reads_dedupes_and_refuses(tmp_path):
    path = fake_metrics(tmp_path / "r", steps=310, log_every=5)
    with open(path, "a") as f:  # a diverged step and a slot without labels
        f.write('\n{"step": 315, "loss": NaN, "acc": [NaN, 0.5], "sim_tau": 1.0}\n')
    recs, notes = runlog.read_metrics(path)
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)) and steps[-1] == 315 and len(notes) == 3 and "non-finite" in notes[2]
    assert math.isnan(runlog.ema([1.0, math.nan, 3.0], 3)[1]) and runlog.ema([1.0, math.nan, 3.0], 3)[2] == 2.0
    assert runlog.tail_median(recs, "tok_per_s") > 150_000  # the compile step does not count
    with pytest.raises(ValueError, match="does not exist"):
        report.run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics yet"):
        report.run(tmp_path / "empty")
