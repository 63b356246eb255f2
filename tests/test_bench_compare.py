"""`bench.train_compare` on the CPU (float8 emulated): each variant in a process of its own, bf16 first and last,
every ratio against the mean of the two bf16 runs, and a drift above 3 % called untrustworthy."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.train_compare import drift, options, ratios, run_order, summary

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"variant", "precision", "loss_logits", "drafter", "tok_per_s", "ms_per_step", "sm_mhz", "power_w", "peak_gb",
          "recompiles", "pid"}


def compare(tmp_path, *args: str):
    """`bench.train_compare` run as a user runs it (tiny, 2 steps a run): its results JSON and stdout."""
    out = tmp_path / "compare.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               DFLASH_NO_BAR="1")
    p = subprocess.run([sys.executable, "-m", "bench.train_compare", *args, "--tiny", "--steps=2", "--log_every=1",
                        f"--workdir={tmp_path / 'w'}", f"--out={out}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p


def test_compare_runs_each_variant_in_its_own_process_between_two_bf16_runs(tmp_path):
    res, p = compare(tmp_path, "--variants=fp8,bf16")
    runs = res["runs"]
    assert [r["variant"] for r in runs] == res["order"] == ["bf16", "fp8", "bf16"]
    assert [(r["precision"], r["loss_logits"]) for r in runs] == [("bf16", "fp32"), ("fp8", "fp32"), ("bf16", "fp32")]
    assert len({r["pid"] for r in runs}) == 3  # three processes
    assert all(FIELDS <= set(r) and r["tok_per_s"] > 0 and r["recompiles"] == 0 for r in runs)
    # (HEAD when the compare started: others may commit in this checkout meanwhile)
    git = subprocess.run(["git", "merge-base", "--is-ancestor", res["commit"], "HEAD"], cwd=REPO)
    assert len(res["commit"]) >= 7 and git.returncode == 0, res["commit"]
    assert res["device"] == "cpu" and res["torch"] == torch.__version__
    assert res["shape"]["anchors"] == 16 and res["failed"] == []
    a, f, b = (r["tok_per_s"] for r in runs)
    assert res["ratios"] == {"fp8": {"tok_per_s": pytest.approx(f / ((a + b) / 2), rel=1e-12), "per_clock": None,
                                     "peak_gb": None}}  # (the CPU: no clock, no peak)
    assert res["drift"] == pytest.approx(abs(a - b) / ((a + b) / 2), rel=1e-12)
    assert res["drift_ok"] == (res["drift"] <= 0.03)
    assert "| fp8 | " in p.stdout and "bf16 drift over the call" in p.stdout
    assert ("NOT TRUSTWORTHY" in p.stdout) == (not res["drift_ok"])


def test_drift_over_three_percent_is_not_trustworthy():
    assert drift(100.0, 102.9) == (pytest.approx(2.9 / 101.45), True)
    assert drift(102.9, 100.0)[1] and drift(100.0, 100.0) == (0.0, True)
    assert drift(100.0, 103.1) == (pytest.approx(3.1 / 101.55), False)
    assert not drift(103.1, 100.0)[1] and not drift(10_053.0, 8_239.0)[1]  # (bench.train's A, B, A in one process)


def test_ratios_are_against_the_mean_of_the_two_bf16_runs_also_per_clock():
    def run(variant, tok, mhz, peak):
        return {"variant": variant, "tok_per_s": tok, "sm_mhz": mhz, "peak_gb": peak}

    runs = [run("bf16", 10_000.0, 1600.0, 40.0), run("fp8", 13_000.0, 1500.0, 38.0),
            run("fp8+fp8head", 14_000.0, None, 36.0), run("bf16", 9_000.0, 1400.0, 42.0)]
    got = ratios(runs)
    assert got["fp8"]["tok_per_s"] == pytest.approx(13_000 / 9_500)
    assert got["fp8"]["per_clock"] == pytest.approx((13_000 / 1500) / ((10_000 / 1600 + 9_000 / 1400) / 2))
    assert got["fp8"]["peak_gb"] == pytest.approx(38 / 41)
    assert got["fp8+fp8head"]["per_clock"] is None  # (a run without GPU samples)
    assert summary(runs)["drift"] == pytest.approx(1_000 / 9_500) and summary(runs)["drift_ok"] is False
    assert summary(runs[:3]) == {"ratios": None, "drift": None, "drift_ok": None}  # the last bf16 run failed


def test_run_order_puts_bf16_first_and_last():
    assert run_order(["bf16", "fp8", "fp8+fp8head"]) == ["bf16", "fp8", "fp8+fp8head", "bf16"]
    assert run_order(["fp8+fp8head", "fp8", "fp8"]) == ["bf16", "fp8+fp8head", "fp8", "bf16"]
    with pytest.raises(ValueError, match="unknown fp4 in 'fp4'; known: bf16, fp8, fp8head"):
        run_order(["fp4"])
    with pytest.raises(ValueError, match=r"unknown fp8-rowwise in 'fp8-rowwise'; known: bf16, fp8, fp8head, dflash, "
                                         r"dflash2 \(joined by \+\)$"):
        run_order(["fp8-rowwise"])  # (rowwise float8 scaling is no trainer option: docs/benchmarks.md)
    with pytest.raises(ValueError, match="besides bf16"):
        run_order(["bf16"])


def test_a_variant_is_settings_joined_by_plus_and_any_variant_can_be_the_reference():
    """fp8+fp8head means what it meant as a name; the drafter joins like the rest; a later part overrides an
    earlier one; the reference runs first and last whatever it is, and is checked like a variant."""
    assert options("fp8+fp8head") == {"precision": "fp8", "loss_logits": "fp8"}
    assert options("fp8+fp8head+dflash2") == {"precision": "fp8", "loss_logits": "fp8", "variant": "dflash2"}
    assert options("fp8head+fp8") == options("fp8+fp8head")  # (in any order)
    assert options("fp8") == {"precision": "fp8", "loss_logits": "fp32"}  # (fp32 logits unless fp8head)
    assert options("dflash") == {"variant": "dflash", "loss_logits": "fp32"}  # (precision as bench.train's default)
    for clash in ("bf16+fp8", "dflash+dflash2", "fp8+fp8"):
        with pytest.raises(ValueError, match="both set"):
            options(clash)
    # variants that run alike are one (its first spelling), and one like the reference is the reference
    assert run_order(["fp8+fp8head", "fp8head+fp8", "bf16"]) == ["bf16", "fp8+fp8head", "bf16"]
    ref = "fp8+fp8head+dflash"
    assert run_order(["fp8+fp8head+dflash2", ref], ref) == [ref, "fp8+fp8head+dflash2", ref]
    with pytest.raises(ValueError, match="^--reference: unknown dflash3 in 'fp8\\+dflash3'"):
        run_order(["bf16"], "fp8+dflash3")
    with pytest.raises(ValueError, match="besides fp8head\\+dflash\\+fp8"):
        run_order([ref], "fp8head+dflash+fp8")
    with pytest.raises(ValueError, match=f"besides {re.escape(ref)}"):
        run_order([ref], ref)


def test_compare_times_dflash2_against_dflash_as_reference_at_a_recipe_s_drafter(tmp_path):
    """--reference=bf16+dflash --variants=bf16+dflash2 --recipe=...: the recipe's drafter (the Qwen3.6-27B recipe's
    DFlash2 at the tiny sizes) as DFlash, as DFlash2, as DFlash again, each a process; the ratio against DFlash's
    two runs."""
    res, p = compare(tmp_path, "--reference=bf16+dflash", "--variants=bf16+dflash2",
                     f"--recipe={REPO / 'manifests' / 'qwen3.6-27b.toml'}", "--weighting=dpace")
    runs = res["runs"]
    assert res["reference"] == "bf16+dflash" and res["order"] == ["bf16+dflash", "bf16+dflash2", "bf16+dflash"]
    assert [r["drafter"] for r in runs] == ["dflash", "dflash2", "dflash"] and len({r["pid"] for r in runs}) == 3
    assert all(r["bench_train"]["weighting"] == "dpace" and r["precision"] == "bf16" for r in runs)
    a, x, b = (r["tok_per_s"] for r in runs)
    assert res["ratios"]["bf16+dflash2"]["tok_per_s"] == pytest.approx(x / ((a + b) / 2), rel=1e-12)
    assert "| over the mean of the two bf16+dflash runs |" in p.stdout and "bf16+dflash drift over" in p.stdout


def test_compare_refuses_an_unknown_variant_before_any_run(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.train_compare", "--variants=fp8+fp4", "--tiny",
                        f"--workdir={tmp_path / 'w'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown fp4 in 'fp8+fp4'" in p.stderr and not (tmp_path / "w").exists()
    # bench.train's --variant is no abbreviation of --variants here: refused as set by the compare
    p = subprocess.run([sys.executable, "-m", "bench.train_compare", "--variant=dflash2", "--tiny",
                        f"--workdir={tmp_path / 'w'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--variant=dflash2 is set per variant" in p.stderr and not (tmp_path / "w").exists()
