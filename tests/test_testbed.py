"""The testbed (make testbed) on the CPU at its micro preset: the source selection, the chat rendering the target is
trained on, the whole pipeline's logic (phases, resume, the reused target-alone baseline, A/B arms with their own
cache) — the GPU run itself is tests/test_testbed_gpu.py."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_offline import dataset
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.config import ConfigError
from testbed import ab as testbed_ab
from testbed import cli, commands, config, runs, scheduler, sources, target, worker
from testbed.commands import Job
from testbed.runs import Paths

REPO = Path(__file__).resolve().parents[1]


def _pkg(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _source(n_lines: int, tag: str = "x") -> str:
    return "".join(f"{tag}_{i} = {i}\n" for i in range(n_lines))


def test_selection_is_deterministic_held_out_by_name_and_content_addressed(tmp_path):
    files = {f"mod{i}/f{i}.py": _source(20 + i) for i in range(80)}
    files["bad.py"] = "\udcff"  # not UTF-8 once written with surrogateescape below
    a = _pkg(tmp_path / "a", {k: v for k, v in files.items() if k != "bad.py"})
    (a / "bad.py").write_bytes(b"x = '\xff'\n")
    (a / "notes.txt").write_text("not python")
    fl = sources.select(roots={"pkg": a}, heldout_every=8)
    names = [f.name for f in fl.train + fl.heldout]
    assert "pkg/bad.py" not in names and all(n.endswith(".py") for n in names)
    assert len(names) == 80 and fl.heldout and not {f.name for f in fl.train} & {f.name for f in fl.heldout}
    # held out by the name alone: the same names are held out when the contents change
    b = _pkg(tmp_path / "b", {k: v + "# changed\n" for k, v in files.items() if k != "bad.py"})
    fl2 = sources.select(roots={"pkg": b}, heldout_every=8)
    assert [f.name for f in fl2.heldout] == [f.name for f in fl.heldout]
    assert fl2.digest != fl.digest  # … and the identity follows the contents
    assert sources.select(roots={"pkg": a}, heldout_every=8).digest == fl.digest
    # a byte budget takes files in name-hash order, not walk order
    small = sources.select(roots={"pkg": a}, heldout_every=8, max_bytes=2000)
    assert 0 < sum(f.size for f in small.train) <= 2000 and len(small.train) < len(fl.train)


def test_records_continue_a_file_and_skip_chat_markers():
    text = _source(300)
    recs = [sources.record("pkg/m.py", c) for c in sources.chunks(text)]
    assert len(recs) == 3 and all(r is not None for r in recs)
    user, answer = recs[0]["messages"][0]["content"], recs[0]["messages"][1]["content"]
    assert user == "pkg/m.py\n" + "".join(text.splitlines(True)[: sources.PROMPT_LINES])
    assert user[len("pkg/m.py\n"):] + answer == "".join(text.splitlines(True)[: sources.CHUNK_LINES])
    assert recs[0]["category"] == "pkg"
    marked = text.replace("x_5 = 5", "s = '<|im_end|>'")
    assert sources.record("pkg/m.py", next(sources.chunks(marked))) is None
    assert sources.record("pkg/m.py", _source(5).splitlines(True)) is None  # too short


def test_a_license_header_is_not_a_prompt(tmp_path):
    header = "#!/usr/bin/env python\n# Copyright 2024 Someone\n#\n# Licensed under the Apache License\n\n"
    f = tmp_path / "m.py"
    f.write_text(header + _source(40))
    (rec,) = sources.records([sources.SourceFile("pkg/m.py", f, "0", f.stat().st_size)], first_only=True)
    assert rec["messages"][0]["content"].startswith("pkg/m.py\nx_0 = 0\n")


def test_looping_answers_are_told_apart():
    loop = "def f():\n" + "    return x + 1  # again\n" * 20
    assert sources.looping(loop) and not sources.looping(_source(40)) and not sources.looping("short")
    # a short answer (an evaluation's 64 tokens) is judged on its last quarter, not on 128 characters it lacks
    short_loop = "def g(a):\n" + "    a = a + 1\n" * 12
    assert len(short_loop) < 256 and sources.looping(short_loop) and not sources.looping(_source(12))


def test_the_evaluation_prompts_are_the_first_whose_greedy_answer_neither_loops_nor_stops_short(tmp_path):
    from testbed.runs import choose_eval_prompts

    cands = [{"messages": [{"role": "user", "content": f"f{i}.py\n"}, {"role": "assistant", "content": "x"}]}
             for i in range(7)]
    loop, fine = "    y = y * 2\n" * 12, _source(12)
    answers = [{"messages": [cands[i]["messages"][0], {"role": "assistant", "content": loop if i in (0, 2) else fine}],
                "regen": {"index": i, "new_tokens": [1 if i == 3 else 40]}} for i in range(7)]
    c, g, out = tmp_path / "c.jsonl", tmp_path / "g.jsonl", tmp_path / "e.jsonl"
    c.write_text("".join(json.dumps(x) + "\n" for x in cands))
    g.write_text("".join(json.dumps(x) + "\n" for x in answers))
    got = choose_eval_prompts(c, g, out, 3, budget=48)
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == ["f1.py\n", "f4.py\n",
                                                                                              "f5.py\n"]
    assert got == {"candidates": 7, "candidates_looping": round(2 / 7, 4), "candidates_short": round(1 / 7, 4),
                   "chosen": 3, "chosen_looping": 0, "chosen_short": 0}
    got = choose_eval_prompts(c, g, out, 7, budget=48)  # too few: the others fill in, counted
    assert (got["chosen_looping"], got["chosen_short"]) == (2, 1)
    with pytest.raises(ValueError, match="eval_prompts"):
        choose_eval_prompts(c, g, out, 8, budget=48)
    # a target that ends every answer at once (too little trained: the short preset on an H100 reported τ = nan) is
    # refused before anything is extracted or trained
    for a in answers:
        a["regen"]["new_tokens"] = [0]
    g.write_text("".join(json.dumps(x) + "\n" for x in answers))
    with pytest.raises(ValueError, match="answers none of the 3 evaluation prompts.*--target_s"):
        choose_eval_prompts(c, g, out, 3, budget=48)
    answers[6]["regen"]["new_tokens"] = [1]  # one answer to measure on: τ is defined, and it is taken before the
    g.write_text("".join(json.dumps(x) + "\n" for x in answers))  # empty ones that come earlier
    assert choose_eval_prompts(c, g, out, 3, budget=48)["chosen_short"] == 3
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == ["f6.py\n", "f0.py\n",
                                                                                              "f1.py\n"]
    # the untrained drafter is evaluated on the file's first `first` prompts: the answered go first, so it has one
    assert choose_eval_prompts(c, g, out, 3, budget=48, first=1)["chosen"] == 3
    for a in answers:  # … and where the file's first are usable, they come before any fallback, in candidate order
        a["regen"]["new_tokens"] = [40] if a["regen"]["index"] in (5, 6) else [0]
    g.write_text("".join(json.dumps(x) + "\n" for x in answers))
    choose_eval_prompts(c, g, out, 4, budget=48, first=2)
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == [
        "f5.py\n", "f6.py\n", "f0.py\n", "f1.py\n"]


def test_a_baseline_is_reused_only_for_the_same_key(tmp_path):
    from dflash_offline.evaluation import read_baseline, write_baseline
    from dflash_offline.speculate import GenStats

    path, key = tmp_path / "b.json", {"target": {"w": "1"}, "max_new_tokens": 8, "dtype": "float32"}
    assert read_baseline(path, key, print) is None
    st = GenStats(block_size=1, prompt_tokens=3, new_tokens=2, accepted=[0], emitted=[1], verify_ms=[1.5],
                  target_forwards=2, seconds=0.25)
    write_baseline(path, key, [[5, 6]], [st])
    (ids, got), = read_baseline(path, key, print)
    assert ids == [5, 6] and got == st
    assert read_baseline(path, {**key, "max_new_tokens": 9}, print) is None
    assert read_baseline(path, {**key, "target": {"w": "2"}}, print) is None


def test_the_baseline_key_names_the_cpu_threads_and_the_kernel_packages(qwen35_dir):
    """What changes the target's greedy numbers is in the key: the CPU thread count (float32 sums) and the kernel
    packages transformers picks up when installed (fla, causal_conv1d, flash_attn)."""
    import types

    import torch

    from dflash_offline.evaluation import baseline_key

    cfg, threads = types.SimpleNamespace(max_new_tokens=8), torch.get_num_threads()
    try:
        keys = []
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.append(baseline_key(cfg, qwen35_dir, [{"ids": [1, 2]}], [0], "float32", torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)
    assert keys[0] != keys[1] and keys[0]["device"] == "cpu (1 threads)" and keys[0]["autotune_pin"] is None
    assert set(keys[0]["kernels"]) == {"flash-linear-attention", "fla-core", "causal-conv1d", "flash-attn"}


def test_render_is_the_chat_template(qwen35_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen35_dir)
    rec = sources.record("pkg/m.py", _source(40).splitlines(True))
    assert target.render(rec) == tok.apply_chat_template(rec["messages"], tokenize=False)


def test_the_ab_interval_is_paired_over_prompts_and_holds_the_seeds_noise():
    from testbed.report import ab_table
    from testbed.stats import arm_rows, delta_ci

    steps = [5, 9, 13, 7, 11, 6, 8, 10] * 4
    base = [2.0 + 6 * (i % 4) for i in range(len(steps))]  # prompts differ far more than the arms do
    counts = lambda taus: [(t * s, s) for t, s in zip(taus, steps, strict=True)]  # noqa: E731
    b = [counts(base), counts(base)]
    a = [counts([t + 0.2 for t in base]), counts([t + 0.2 for t in base])]
    lo, hi = delta_ci(a, b)
    assert 0.19 < lo <= hi < 0.21  # paired: the per-prompt shift is all that varies
    lo, hi = delta_ci(b, b)
    assert lo == hi == 0
    noisy = [counts([t + (0.5 if i % 2 else -0.5) for i, t in enumerate(base)])] * 2
    lo, hi = delta_ci(noisy, b)
    assert lo < 0 < hi
    # two seeds of one arm that differ by ±1 everywhere (training noise): pooled, they cancel, and an interval over
    # the prompts alone would be a narrow band around 0; resampling the seeds too gives the band the noise has
    seedy = [counts([t + 1 for t in base]), counts([t - 1 for t in base])]
    lo, hi = delta_ci(seedy, b)
    assert lo < -0.5 and hi > 0.5
    ev = lambda counts, tau, ok=True: {"tau": tau, "counts": counts, "lossless": ok, "mismatches": [] if ok else [3],  # noqa: E731
                                       "prompts": "p", "tokens": 64}
    rows = arm_rows(["", "x=1"], {"": [(ev(b[0], 3.0), 0.5), (ev(b[1], 3.2), 0.4)],
                                  "x=1": [(ev(a[0], 3.3), 0.5), (ev(a[1], 3.3, False), 0.5)]})
    assert rows[0]["delta_ci95"] is None and rows[1]["delta_ci95"][0] > 0
    assert rows[0]["spread"] == pytest.approx(0.2) and rows[0]["tau_mean_of_seeds"] == pytest.approx(3.1)
    # τ of an arm pools its seeds' tokens and steps, as the interval does: Δ is that difference, inside the interval
    pooled = sum(t * s for t, s in zip(base, steps, strict=True)) / sum(steps)
    assert rows[0]["tau_pooled"] == pytest.approx(pooled) and rows[1]["tau_pooled"] == pytest.approx(pooled + 0.2)
    assert rows[1]["delta_vs_first"] == pytest.approx(0.2)
    assert rows[1]["delta_ci95"][0] <= rows[1]["delta_vs_first"] <= rows[1]["delta_ci95"][1]
    assert rows[1]["lossless"] == [True, False] and "| NO: prompts [[], [3]] |" in ab_table({"arms": rows})
    # evaluations of other prompts (or budgets) cannot be paired: refused, not truncated
    other = {**ev(a[0][:16], 3.3), "prompts": "q"}
    with pytest.raises(ValueError, match="decoded different prompts or token budgets"):
        arm_rows(["", "x=1"], {"": [(ev(b[0], 3.0), 0.5)], "x=1": [(other, 0.5)]})
    with pytest.raises(ValueError, match="same prompts"):
        delta_ci([a[0][:16]], b[:1])


def test_arms_are_ranked_only_when_the_null_arm_holds_0_and_the_known_bad_arm_lies_below():
    from testbed.report import ab_table
    from testbed.stats import NULL_ARM, judge

    def rows(null_ci, bad_ci, null_delta=0.02, seed_sd=0.05):
        r = [{"arm": "(recipe)", "delta_ci95": None, "delta_vs_first": 0.0},
             {"arm": "quant=fp4", "delta_ci95": (-0.1, 0.2), "delta_vs_first": 0.05},
             {"arm": "gamma=inf", "delta_ci95": (-0.6, -0.2), "delta_vs_first": -0.4},
             {"arm": "steps=150", "delta_ci95": bad_ci, "delta_vs_first": -1.0},
             {"arm": NULL_ARM, "delta_ci95": null_ci, "delta_vs_first": null_delta}]
        return [{**x, "taus": [1.0, 1.1], "tau_pooled": 1.0, "spread": 0.1, "delta_pct": 0.0, "lossless": [True] * 2,
                 "mismatches": [[], []], "loss": [0.1], "seed_sd_pooled": seed_sd} for x in r]

    ok = rows((-0.15, 0.15), (-1.4, -0.6))
    ok.insert(3, {**ok[1], "arm": "noisy", "delta_ci95": (-0.7, 0.02), "delta_vs_first": -0.35})
    j = judge(ok, NULL_ARM, "steps=150")
    assert j["discriminating"] and [r.get("verdict") for r in ok[1:4]] == ["parity", "worse", "inconclusive"]
    assert ok[1]["within_null"] is True and "within_null" not in ok[2] and ok[3]["within_null"] is False
    ok.pop(3)
    assert ok[3]["verdict"] == "known-bad check: passed" and ok[4]["verdict"] == "null check: passed"
    assert "arms ranked" in ab_table({"arms": ok, "judgement": j})
    for null_ci, bad_ci, culprit in (((0.05, 0.3), (-1.4, -0.6), "null"), ((-0.15, 0.15), (-1.2, 0.1), "bad"),
                                     ((-0.15, 0.15), None, "bad")):
        r = rows(null_ci, bad_ci)
        if bad_ci is None:
            r = [x for x in r if x["arm"] != "steps=150"]  # (its drafters failed: no row)
        j = judge(r, NULL_ARM, "steps=150")
        assert not j["discriminating"] and j["why_not"][0].startswith(f"the {culprit} arm")
        assert ("rerun with --seeds=3 (SEEDS=); in the same --dir every drafter done is kept" in j["why_not"][0]) == (culprit == "null")
        assert {x.get("verdict") for x in r[1:3]} == {"unranked"} and "within_null" not in r[1]
        assert "NOT DISCRIMINATING, arms not ranked" in ab_table({"arms": r, "judgement": j})

    # the parity band is the null arm's reach either side of 0, not of the null arm's own Δ (noise): a null arm at
    # +0.10 (−0.05 … +0.25) calls an arm at −0.12 at parity and one at +0.20 inconclusive, as it would at Δ 0
    r = rows((-0.05, 0.25), (-1.4, -0.6), null_delta=0.10)
    r[1].update(delta_ci95=(-0.30, 0.06), delta_vs_first=-0.12)
    r[2].update(delta_ci95=(-0.01, 0.41), delta_vs_first=0.20)
    assert judge(r, NULL_ARM, "steps=150")["discriminating"]
    assert [r[1]["verdict"], r[2]["verdict"]] == ["parity", "inconclusive"]

    # a drafter whose output differs from the target's is FAILED, whatever its τ; a lossy check arm ranks nothing
    r = rows((-0.15, 0.15), (-1.4, -0.6))
    r[1]["lossless"] = [True, False]
    assert judge(r, NULL_ARM, "steps=150")["discriminating"] and r[1]["verdict"] == "FAILED"
    for lossy in (3, 4):
        r = rows((-0.15, 0.15), (-1.4, -0.6))
        r[lossy]["lossless"] = [False, True]
        j = judge(r, NULL_ARM, "steps=150")
        assert not j["discriminating"] and "is not lossless" in j["why_not"][0] and r[1]["verdict"] == "unranked"
        assert r[lossy]["verdict"].endswith("check: FAILED")

    # a lossy first arm (every arm is compared with it) ranks nothing; a lossy arm is FAILED, ranked or not
    r = rows((-0.15, 0.15), (-1.4, -0.6))
    r[0]["lossless"], r[2]["lossless"] = [False, True], [True, False]
    j = judge(r, NULL_ARM, "steps=150")
    assert not j["discriminating"] and j["why_not"][0].startswith("the first arm ((recipe)) is not lossless")
    assert [r[1]["verdict"], r[2]["verdict"]] == ["unranked", "FAILED"]
    # an arm without an interval (no verify step to resample) is said so, the null arm's too
    r = rows((-0.15, 0.15), (-1.4, -0.6))
    r[1]["delta_ci95"] = None
    assert judge(r, NULL_ARM, "steps=150")["discriminating"] and r[1]["verdict"] == "no interval"
    r = rows(None, (-1.4, -0.6))
    assert "the null arm ((recipe, other seeds)): no interval" in judge(r, NULL_ARM, "steps=150")["why_not"][0]

    # one seed per arm: no estimate of the training noise, so no interval holds it: not ranked, whatever the checks say
    r = rows((-0.15, 0.15), (-1.4, -0.6), seed_sd=None)
    j = judge(r, NULL_ARM, "steps=150")
    assert not j["discriminating"] and j["checks"]["null"]["passed"] and j["checks"]["bad"]["passed"]
    assert j["why_not"] == ["one seed per arm: the seeds' variance is unknown, so no interval holds the training "
                            "noise; rerun with --seeds=2 or more (SEEDS=); in the same --dir every drafter done is kept"]
    assert r[1]["verdict"] == "unranked"


def test_a_call_killed_before_the_target_phase_ended_still_counts_and_a_results_file_holds_the_seconds_up_to_it(
        tmp_path):
    from testbed import report

    p = Paths(str(tmp_path))
    p.root.mkdir(parents=True, exist_ok=True)
    p.wall.write_text(json.dumps([{"start": 1.0, "seconds": 140.0, "sweep": None, "arms": None}]))  # (no state.json)
    tag = cli.sweep_tag(config.TestbedConfig(sweep="encodings,fp8", label="seeds"))
    report.heartbeat(p, tag, every_s=0.05)
    time.sleep(0.3)
    report.beat_now(last=True)
    calls = report.read_wall(p)
    assert calls[0]["seconds"] == 140.0 and calls[1]["sweep"] == "seeds" and calls[1]["seconds"] >= 0.3
    time.sleep(0.3)  # (no beat after the last)
    assert report.read_wall(p) == calls and report.wall_seconds(p) == round(140.0 + calls[1]["seconds"], 1)
    assert report.sweep_seconds(calls, tag)["one_sweep"] is True


def test_a_sweeps_table_keeps_the_known_bad_arm_out_of_the_seeds_variance(tmp_path):
    """The sweep's rows (what `ab` ranks) from its runs' evaluations: the seeds' sd the arms' intervals use is the
    recipe's, the null arm's and the other arms' — not the known-bad arm's, whose two seeds here differ by 2 τ."""
    from testbed.stats import pooled_seed_var

    cfg, p = config.TestbedConfig(dir=str(tmp_path), seeds=2), Paths(str(tmp_path))
    arms = ["", "quant=fp8"]
    null, bad = testbed_ab.check_arms(cfg, arms[0])
    jobs, _ = testbed_ab.sweep_jobs(cfg, p, [*arms, bad], null, bad)
    shift = {"": (0.1, -0.1), "quant=fp8": (0.3, 0.1), null: (0.0, 0.2), bad: (-3.0, -1.0)}
    steps, counts = [5, 9, 13, 7] * 4, {}
    for j in jobs:
        d = shift[j.arm][sum(x.arm == j.arm for x in jobs[: jobs.index(j)])]
        taus = [4.0 + d + (i % 3) for i in range(len(steps))]
        counts.setdefault(j.arm, []).append([(t * n, n) for t, n in zip(taus, steps, strict=True)])
        j.run.mkdir(parents=True)
        (j.run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
        (j.run / "eval.json").write_text(json.dumps({
            "tau_mean": 4.0, "lossless": True, "prompt_ids_sha256": "p", "max_new_tokens": 64,
            "per_prompt": [{"tau_mean": t, "steps": n, "emitted": t * n} for t, n in zip(taus, steps, strict=True)]}))
    rows = testbed_ab.sweep_rows([*arms, bad, null], jobs, bad)
    want = pooled_seed_var([counts[a] for a in (*arms, null)])[0] ** 0.5
    assert [r["arm"] for r in rows] == ["(recipe)", "quant=fp8", bad, null]
    assert all(r["seed_sd_pooled"] == pytest.approx(want) for r in rows) and want < 0.2
    assert rows[1]["seeds"] == testbed_ab.arm_seeds(cfg, "quant=fp8") and rows[1]["loss"] == [0.5, 0.5]


def test_a_sweeps_seconds_are_one_sweeps_only_when_no_invocation_ran_other_arms():
    """`one_sweep`: a sum of device seconds is a sweep's cold cost only where no invocation on DIR ran other arms
    (another sweep's drafters); the arms tell sweeps apart, not the label; an untagged invocation leaves it unknown."""
    from testbed.report import sweep_seconds

    tag = lambda **k: cli.sweep_tag(config.TestbedConfig(**k))  # noqa: E731
    assert tag() == {"sweep": None, "arms": None}
    ab = tag(arms=";quant=fp8;gamma=5")
    assert ab["sweep"] == "ab" and ab["arms"] == tag(arms="; gamma=5;quant=fp8 ", label="x")["arms"]  # any order
    assert ab["arms"] != tag(arms="quant=fp8;;gamma=5")["arms"] != tag(arms=";quant=fp4")["arms"]  # other first arm
    call = lambda t, s: {"start": 0.0, "seconds": s, **t}  # noqa: E731
    base, other = call(tag(), 100.04), call(tag(arms=";quant=fp4"), 50.0)
    assert sweep_seconds([base, call(ab, 20.03), call(ab, 30.0)], ab) == {
        "one_sweep": True, "device_seconds_by_sweep": {"(testbed alone)": 100.0, f"ab ({ab['arms']})": 50.0}}
    assert sweep_seconds([base, other, call(ab, 20.0)], ab)["one_sweep"] is False
    assert sweep_seconds([base, call(tag(arms=";quant=fp8;gamma=5", label="again"), 9.0)], ab)["one_sweep"] is True
    assert sweep_seconds([{"start": 0.0, "seconds": 5.0}, call(ab, 20.0)], ab) == {
        "one_sweep": None, "device_seconds_by_sweep": {"(untagged)": 5.0, f"ab ({ab['arms']})": 20.0}}


def test_the_known_bad_arms_seeds_stay_out_of_the_seeds_variance_the_intervals_use():
    """The known-bad arm learns in another regime; its seeds' spread is not the arms' training noise."""
    from testbed.stats import arm_rows, pooled_seed_var

    steps = [5, 9, 13, 7, 11, 6, 8, 10] * 4
    counts = lambda shift: [((2.0 + 6 * (i % 4) + shift) * s, s) for i, s in enumerate(steps)]  # noqa: E731
    ev = lambda c: ({"tau": 0.0, "counts": c, "lossless": True, "mismatches": [], "prompts": "p", "tokens": 64}, 0.1)  # noqa: E731
    arms = {"": [counts(0.1), counts(-0.1)], "x=1": [counts(0.3), counts(0.1)], "steps=1": [counts(-3), counts(-1)]}
    results = {a: [ev(c) for c in cs] for a, cs in arms.items()}
    rows = arm_rows(list(arms), results, apart=("steps=1",))
    apart = pooled_seed_var([arms[""], arms["x=1"]])[0] ** 0.5
    assert rows[0]["seed_sd_pooled"] == pytest.approx(apart) and apart == pytest.approx(0.1414, abs=1e-3)
    pooled = arm_rows(list(arms), results)
    assert pooled[0]["seed_sd_pooled"] > 5 * apart  # (pooled, its ±1 spread would widen every arm's interval)
    assert rows[1]["delta_ci95"][1] - rows[1]["delta_ci95"][0] < (pooled[1]["delta_ci95"][1] - pooled[1]["delta_ci95"][0]) / 3


def test_a_sweep_rerun_with_more_seeds_keeps_every_drafter_it_made():
    """What a failed null check advises (rerun with one seed more) costs only the new drafters: every run of the sweep
    at N seeds is a run of the sweep at N + 1 with the same training arguments (a run is keyed by its settings and
    seed; an arm's i-th seed does not depend on how many there are: `ab.arm_seeds`)."""
    from testbed.commands import train_args

    def sweep(seeds: int) -> dict:
        cfg, p = config.TestbedConfig(dir="d", seeds=seeds), Paths("d")
        arms = ["", "quant=fp8", "gamma=5"]
        null, bad = testbed_ab.check_arms(cfg, arms[0])
        jobs, _ = testbed_ab.sweep_jobs(cfg, p, [*arms, bad], null, bad)
        return {j.run: train_args(cfg, j.run, j.cache, j.seed, j.settings) for j in jobs}

    for n in (1, 2, 3):
        now, more = sweep(n), sweep(n + 1)
        assert len(now) == 5 * n and len(more) == 5 * (n + 1)
        assert {run: more.get(run) for run in now} == now, n


def test_the_interval_holds_95_percent_of_null_differences_with_the_seeds_variance_pooled_over_arms():
    """Simulated sweeps (11 arms × 2 seeds, 64 prompts, seed-to-seed noise of 0.3 τ): with the seed variance pooled
    over the arms, ≈ 5 % of true-zero differences fall outside the interval; an interval that only resampled each
    arm's two seeds let ≈ 23 % out."""
    import random

    from testbed.stats import delta_ci, pooled_seed_var

    rng, outside, reps = random.Random(1), 0, 40
    for r in range(reps):
        base = [rng.uniform(1.5, 8) for _ in range(64)]
        steps = [rng.randint(8, 40) for _ in range(64)]

        def arm(base, steps):
            return [[((t + e + rng.gauss(0, 0.3)) * n, n) for t, n in zip(base, steps, strict=True)]
                    for e in (rng.gauss(0, 0.3), rng.gauss(0, 0.3))]

        arms = [arm(base, steps) for _ in range(11)]
        lo, hi = delta_ci(arms[1], arms[0], draws=200, seed=r, seed_var=pooled_seed_var(arms))
        outside += not lo <= 0 <= hi
    assert outside <= 0.15 * reps


def test_every_arm_trains_under_seeds_of_its_own_kept_by_more_seeds_and_other_sweeps(tmp_path):
    """No two arms (the null and known-bad arms included) share a seed: shared seeds share training noise, which the
    interval's pooled seed variance takes as independent. The recipe keeps the first seeds (its first is the testbed's
    own drafter); an arm's seeds follow from its settings, in any order, so that --seeds=3 keeps seeds 0–1's drafters
    and another sweep (or --summarize with other arms) finds the same arm's runs."""
    p = Paths(str(tmp_path))
    arms = ["", "quant=fp8", "precision=fp8 loss_logits=fp8", "steps=150"]

    def seeds(cfg, arms):
        jobs, _ = testbed_ab.sweep_jobs(cfg, p, list(arms), "(recipe, other seeds)", "steps=150")
        return {(j.arm, j.seed) for j in jobs}, jobs

    two, jobs = seeds(config.TestbedConfig(seeds=2), arms)
    by_arm = {}
    for arm, seed in two:
        by_arm.setdefault(arm, set()).add(seed)
    assert len(by_arm) == 5 and all(len(v) == 2 for v in by_arm.values())  # 4 arms and the null arm
    assert sum(len(v) for v in by_arm.values()) == len(set().union(*by_arm.values())) == 10  # no seed shared
    assert by_arm[""] == {0, 1} and jobs[0].run == p.run("", 0)
    assert all(j.run.name == f"seed{j.seed}" for j in jobs)
    three, _ = seeds(config.TestbedConfig(seeds=3), arms)
    assert two < three and len(three) == 15
    other, _ = seeds(config.TestbedConfig(seeds=2), ["", "loss_logits=fp8 precision=fp8", "quant=fp4", "steps=150"])
    assert {s for a, s in other if a == "loss_logits=fp8 precision=fp8"} == by_arm["precision=fp8 loss_logits=fp8"]
    assert {s for a, s in other if a == "quant=fp4"}.isdisjoint(set().union(*by_arm.values()))
    moved, _ = seeds(config.TestbedConfig(seeds=2, seed=5), arms)  # (--seed moves every arm's)
    assert {s for a, s in moved if a == ""} == {5, 6} and not {s for _, s in moved} & {s for _, s in two}


def test_the_null_check_holds_5_percent_only_when_no_two_arms_share_a_seed():
    """Why every arm trains under seeds of its own (`ab.arm_seeds`): simulated sweeps (10 arms × 2 seeds and the null
    arm, 64 prompts; a seed's effect of sd 0.06 τ, an arm's own of 0.02, prompt noise 0.05) in which the arms share
    seeds 0–1 — the same initial weights and batch order, so the same seed effect — and the null arm alone has seeds
    2–3: its interval, whose seed term pools the arms' pairs as independent, misses 0 in ≈ 15 % of sweeps. With every
    arm's seeds its own, ≈ 3 %."""
    import random

    from testbed.stats import delta_ci, pooled_seed_var

    def misses(shared: bool, reps: int = 300) -> float:
        rng, outside = random.Random(1), 0
        for r in range(reps):
            base = [rng.uniform(1.5, 8) for _ in range(64)]
            steps = [rng.randint(8, 40) for _ in range(64)]
            effect = [rng.gauss(0, 0.06) for _ in range(4)]

            def arm(seeds, base=base, steps=steps, effect=effect):
                return [[((t + (effect[sd] if shared else rng.gauss(0, 0.06)) + own + rng.gauss(0, 0.05)) * n, n)
                         for t, n in zip(base, steps, strict=True)] for sd in seeds for own in [rng.gauss(0, 0.02)]]

            arms = [arm([0, 1]) for _ in range(10)]
            null = arm([2, 3])
            lo, hi = delta_ci(null, arms[0], draws=100, seed=r, seed_var=pooled_seed_var([*arms, null]))
            outside += not lo <= 0 <= hi
        return outside / reps

    assert misses(shared=True) >= 0.10 and misses(shared=False) <= 0.08


def test_the_checks_follow_the_first_arm(tmp_path):
    cfg = config.TestbedConfig(train_steps=600)
    assert testbed_ab.check_arms(cfg, "") == ("(recipe, other seeds)", "steps=150")
    assert testbed_ab.check_arms(cfg, "gamma=5 quant=fp8") == ("(gamma=5 quant=fp8, other seeds)",
                                                          "quant=fp8 gamma=5 steps=150")
    assert testbed_ab.check_arms(cfg, "steps=400")[1] == "steps=100"
    assert testbed_ab.check_arms(config.TestbedConfig(train_args="steps=40"), "")[1] == "steps=10"
    assert testbed_ab.check_arms(config.TestbedConfig(), "")[1] == "steps=150"  # the recipe's 600
    (tmp_path / "r.toml").write_text("[train]\nlr = 1e-3\n")  # a recipe that leaves the steps to training's default
    assert testbed_ab.check_arms(config.TestbedConfig(drafter_recipe=str(tmp_path / "r.toml")), "")[1] == "steps=250"


def test_only_an_arm_that_encodes_or_projects_the_base_states_derives_its_cache_from_them():
    """(a derivation the source cannot give — the same key, taps it lacks — would fail the arm's cache)"""
    assert [commands.derived(runs.parse_arm(a)[0]) for a in ("quant=fp8", "project_dims=32 quant=fp4",
                                                               "project_dims=32 project_rows=8")] == [True] * 3
    assert not any(commands.derived(runs.parse_arm(a)[0]) for a in ("quant=bf16", "project_rows=8", "layer_ids=1,3",
                                                                     "quant=fp8 layer_ids=1,3", "project_dims=0"))


def test_arms_are_checked_before_anything_runs():
    assert runs.parse_arm("quant=fp8 gamma=5") == ({"quant": "fp8"}, {"gamma": "5"})
    assert runs.parse_arm("") == ({}, {})
    with pytest.raises(ConfigError, match="num_anchors"):
        runs.parse_arm("num_anchor=256")
    with pytest.raises(ConfigError, match="not key=value"):
        runs.parse_arm("gamma")
    with pytest.raises(ConfigError, match="'fp8_recipe' is no extract or train setting: the choice of float8 scaling "
                                          "was removed .*: precision=fp8 scales tensorwise"):
        runs.parse_arm("precision=fp8 fp8_recipe=rowwise")


def test_the_full_testbed_is_refused_at_once_without_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="preset=micro"):
        cli.main([f"--dir={tmp_path / 'tb'}"])
    assert not (tmp_path / "tb" / "state.json").exists()


def _testbed(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", "--preset=micro", f"--dir={root}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def untimed(report: dict) -> dict:
    """An evaluation's report without what differs between two evaluations of the same drafter: its timings, when
    it was written, where (`out`), and the baseline's reuse."""
    if isinstance(report, dict):
        return {k: untimed(v) for k, v in report.items()
                if k not in ("time", "out", "baseline", "reused") and not k.endswith(("_ms", "_s", "ms_per_token"))
                and "speedup" not in k}
    return [untimed(x) for x in report] if isinstance(report, list) else report


def _eval_requests(tmp_path, request):
    """(a refused request, one that fails unexpectedly) of stages.evaluate."""
    broken = tmp_path / "broken"  # a run whose config.json holds nothing: a KeyError
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    return [f"--run={tmp_path / 'none'}"], [f"--run={broken}"]


def _train_requests(tmp_path, request):
    """(a refused request, one that fails unexpectedly) of stages.train."""
    (tmp_path / "file").touch()  # a run directory under a file: a NotADirectoryError
    return ([f"--cache={tmp_path / 'none'}", f"--run={tmp_path / 'r'}"],
            [f"--cache={request.getfixturevalue('hidden_cache')}", f"--run={tmp_path / 'file' / 'run'}"])


@pytest.mark.parametrize("module, client, requests", [("testbed.evalworker", worker.Worker, _eval_requests),
                                                      ("testbed.trainworker", worker.Workers, _train_requests)])
def test_a_worker_answers_each_request_and_keeps_serving_after_a_refused_one(tmp_path, request, module, client,
                                                                              requests):
    """testbed.evalworker and testbed.trainworker, through the clients the testbed uses (`commands.EVAL_WORKER`, one
    process; `commands.TRAIN_WORKERS`, one per request in flight): each request's output goes into its log, the
    answer is the exit status `python -m stages.<name>` would have (2: a refused input), and the process serves the
    next request; after an unexpected error (1, its traceback logged) that process ends and the next request gets a
    new one; a request with another environment gets a process of its own (`Workers` keeps the other for later, and
    `discard` ends the idle ones of one environment); closing ends them all."""
    refused, broken = requests(tmp_path, request)
    w = client(module)

    def pids():
        return {x.proc.pid for x in (w.idle if isinstance(w, worker.Workers) else [w]) if x.proc is not None}

    try:
        assert w.run(["--bogus=1"], tmp_path / "a.log") == 2
        assert "--bogus" in (tmp_path / "a.log").read_text()
        (pid,) = pids()
        assert w.run(refused, tmp_path / "b.log") == 2  # a ValueError: one line
        assert pids() == {pid} and "error:" in (tmp_path / "b.log").read_text()
        assert w.run(broken, tmp_path / "c.log") == 1
        assert "Traceback" in (tmp_path / "c.log").read_text() and not pids()  # that process has ended
        assert w.run(["--bogus=1"], tmp_path / "d.log") == 2  # the next request: a new process answers it
        (pid,) = pids() - {pid}
        assert w.run(["--bogus=1"], tmp_path / "e.log", {"DFLASH_TEST_WORKER": "1"}) == 2
        assert pids() - {pid} and (pid in pids()) == (client is worker.Workers)
        assert w.run(["--bogus=1"], tmp_path / "f.log") == 2 and (pid in pids()) == (client is worker.Workers)
        procs = [x.proc for x in (w.idle if isinstance(w, worker.Workers) else [w])]
        if client is worker.Workers:  # the leader's environment, once done: its process ends, the others stay
            other = pids() - {pid}
            w.discard({"DFLASH_TEST_WORKER": "1"})
            assert other and pids() == {pid} and all(p.returncode == 0 for p in procs if p.pid in other)
    finally:
        w.close()
    assert all(p.returncode == 0 for p in procs) and not pids()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_the_evaluation_worker_started_ahead_has_its_imports_done_before_the_first_request(tmp_path, monkeypatch):
    """`Worker.start` (the testbed starts the evaluation worker beside its first training): the process imports torch
    and the evaluation's modules before any request comes, and serves the requests after (no second start); a start
    for another environment, or after the process died, gets a new one; one never asked is not waited for."""
    for name in ("DFLASH_AUTOTUNE_PIN", "DFLASH_AUTOTUNE_RECORD"):  # (pinning imports torch before `load`)
        monkeypatch.delenv(name, raising=False)
    w = worker.Worker("testbed.evalworker")

    def torch_loaded() -> bool:
        assert w.proc.poll() is None, "the worker ended before any request"
        return "libtorch" in Path(f"/proc/{w.proc.pid}/maps").read_text()

    try:
        w.start({})
        pid, t0 = w.proc.pid, time.monotonic()
        while not torch_loaded() and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        assert torch_loaded()  # (no request sent yet)
        w.start({})
        assert w.proc.pid == pid and w.run(["--bogus=1"], tmp_path / "a.log") == 2 and w.proc.pid == pid
        w.start({"DFLASH_TEST_WORKER": "1"})
        assert w.proc.pid != pid and w.env == {"DFLASH_TEST_WORKER": "1"}
        pid = w.proc.pid
        w.proc.kill()
        w.proc.wait()
        w.start({"DFLASH_TEST_WORKER": "1"})
        assert w.proc.pid != pid and w.run(["--bogus=1"], tmp_path / "b.log", {"DFLASH_TEST_WORKER": "1"}) == 2
        w.start({})  # never asked: closing it does not wait for its imports
        proc, t0 = w.proc, time.monotonic()
        w.close()
        assert proc.returncode is not None and time.monotonic() - t0 < 10
        w.start({})
        with w.lock:  # a request in flight (the target-alone decodes made ahead): a start does not wait behind it
            t0 = time.monotonic()
            w.start({"DFLASH_TEST_WORKER": "2"})
            assert time.monotonic() - t0 < 1 and w.env == {}
        proc = w.proc  # ended at once (the phase beside it failed); the next request starts another
        w.terminate()
        assert proc.poll() is not None and w.run(["--bogus=1"], tmp_path / "c.log") == 2 and w.proc.pid != proc.pid
    finally:
        w.close()
    # a pool's process started ahead (the first training's) is the one its first request with that environment takes
    pool = worker.Workers("testbed.trainworker")
    try:
        pool.start({})
        pool.start({})
        assert len(pool.idle) == 1 and pool.idle[0].proc is not None
        pid = pool.idle[0].proc.pid
        assert pool.run(["--bogus=1"], tmp_path / "d.log") == 2 and [w.proc.pid for w in pool.idle] == [pid]
    finally:
        pool.close()


def test_a_drafter_trained_in_the_training_worker_equals_its_twin_trained_in_a_process_of_its_own(tmp_path,
                                                                                                  hidden_cache):
    """testbed.trainworker trains the same drafter as `python -m stages.train` (same seed, cache and settings): equal
    weights — the second drafter of one worker, after one with other settings (seed, steps, learning rate) of the
    same shapes, compiled (a first drafter: the micro testbed's worker-vs-process rerun below): it compiles its own
    graphs as a process of its own does (kept from the first run, it would have compiled none, and a sweep's drafters
    would add up to dynamo's recompile limit). The third differs from the second only in its seed, run and steps (an
    arm's further seed): it runs the second's compiled graphs (its warm-up compiles none, where its twin's compiles
    them) and still trains its twin's weights, recompiling nothing. The second and third train with the cache
    resident (the testbed's `--resident=1`: the bench switch the worker takes out of its request; the third on the
    rows the second read), their twins stream it: the same batches, so the same weights."""
    import torch
    from safetensors.torch import load_file

    tiny = [f"--cache={hidden_cache}", "--compile=on", "--num_layers=2", "--num_heads=4", "--num_kv_heads=2",
            "--head_dim=16", "--num_anchors=8", "--batch_rows=2", "--log_every=1", "--trackers=none"]
    drafters = {"first": (2, ["--seed=1", "--steps=2", "--ckpt_every=2", "--lr=1e-3"]),
                "second": (3, ["--seed=0", "--steps=3", "--ckpt_every=3", "--lr=3e-3"]),
                "third": (2, ["--seed=2", "--steps=2", "--ckpt_every=3", "--lr=3e-3"])}
    from testbed.trainworker import RESIDENT

    w = worker.Worker("testbed.trainworker")
    try:
        for name, (_, args) in drafters.items():
            bench = [RESIDENT] if name != "first" else []
            assert w.run([*tiny, *args, f"--run={tmp_path / 'worker' / name}", *bench],
                         tmp_path / "worker" / f"{name}.log") == 0
    finally:
        w.close()
    assert "the cache resident on the device" in (tmp_path / "worker" / "second.log").read_text()
    assert "the cache resident" not in (tmp_path / "worker" / "first.log").read_text()
    # the third, on the same cache, trains on the rows the second read (`dataset.keep_resident_rows`)
    held = [name for name in drafters if "still on the device from the last training: none read" in
            (tmp_path / "worker" / f"{name}.log").read_text()]
    assert held == ["third"], held
    read = {name: len(re.findall(r"the cache read onto cpu: [\d.]+ GB in [\d.]+s \([\d.]+ GB/s; allocating [\d.]+s, "
                                 r"the files read and checked [\d.]+s, copied [\d.]+s; \d+ thread\(s\)\)",
                                 (tmp_path / "worker" / f"{name}.log").read_text())) for name in drafters}
    assert read == {"first": 0, "second": 1, "third": 0}, read  # (the first streams; the third reads nothing)
    kept = [re.findall(r"\[worker\] the last training's (\d+) compiled graphs kept",
                       (tmp_path / "worker" / f"{name}.log").read_text()) for name in drafters]
    assert kept[:2] == [[], []] and int(kept[2][0]) > 0, kept  # (the third says it runs the second's graphs)
    for name in ("second", "third"):  # (the state a first one may leave is what it checks)
        steps, args = drafters[name]
        r = subprocess.run([sys.executable, "-m", "stages.train", *tiny, *args, f"--run={tmp_path / 'alone' / name}"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        (tmp_path / "alone" / f"{name}.log").write_text(r.stdout + r.stderr)
        a, b = (load_file(tmp_path / where / name / "checkpoints" / f"step-{steps:08d}" / "model.safetensors")
                for where in ("worker", "alone"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        graphs, recompiles = ([re.findall(pattern, (tmp_path / where / f"{name}.log").read_text())
                               for where in ("worker", "alone")]
                              for pattern in (r"warm-up step compiled (\d+) graphs", r"recompiles (\d+);"))
        assert int(graphs[1][0]) > 0 and graphs[0] == (graphs[1] if name == "second" else ["0"]), (name, graphs)
        assert recompiles == [["0"], ["0"]], (name, recompiles)


def test_the_training_worker_gives_kept_rows_back_before_a_training_on_another_cache_or_streamed(monkeypatch):
    """A resident training on the cache of the last resident one keeps its rows; one on another cache, or one that
    streams, starts after they are given back (not at its first batch, beside its model)."""
    from stages import train
    from testbed import trainworker as tw

    released, kept = [], []
    monkeypatch.setattr(tw, "_last", {"graphs": None, "count": 0, "rows": None})
    monkeypatch.setattr(train, "main", lambda argv, bench: 0)
    monkeypatch.setattr(dataset, "keep_resident_rows", lambda on=True: kept.append(on))
    monkeypatch.setattr(dataset, "release_kept_rows", lambda: released.append(len(seen)))
    main, seen = tw.load(), []
    for argv in (["--cache=a", tw.RESIDENT], ["--cache=a", tw.RESIDENT, "--seed=1"], ["--cache=b", tw.RESIDENT],
                 ["--cache=b"], ["--cache=b", tw.RESIDENT], ["--cache=b", tw.RESIDENT, "--steps=2"]):
        assert main(argv) == 0
        seen.append(argv)
    assert kept == [True] and released == [0, 2, 3, 4]


def test_the_training_worker_keeps_compiled_graphs_only_for_an_arms_further_seed_whose_last_run_ended_well(
        monkeypatch):
    """Graphs are kept for a training that differs from the last one only in its run, seed, steps or resume; another
    setting resets them, and so does a last training that did not end with status 0 or whose warm-up compiled graphs
    beside kept ones (dynamo's guards rejected them: kept again, a function's graphs would pile up towards dynamo's
    recompile limit, past which it runs eager)."""
    import torch

    from stages import train
    from testbed import trainworker as tw

    resets, outcome = [], {}
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(tw, "_last", {"graphs": None, "count": 0})

    def fake_main(argv, bench):  # a training: its exit status, and the graphs its warm-up compiles
        from torch._dynamo.utils import counters

        counters["stats"]["unique_graphs"] += outcome["graphs"]
        return outcome["rc"]

    monkeypatch.setattr(train, "main", fake_main)
    monkeypatch.setattr(dataset, "keep_resident_rows", lambda on=True: None)  # (this process keeps no rows after)
    main = tw.load()
    base = ["--cache=c", "--lr=1e-3"]
    seed = [[*base, f"--run=r{i}", f"--seed={i}", f"--steps={100 * i}", "--resume=0"] for i in range(6)]
    assert len({tw.graph_identity(a) for a in seed}) == 1 and tw.graph_identity([*base, "--lr=2e-3"]) != \
        tw.graph_identity(seed[0])
    for argv, rc, graphs, reset in [(seed[0], 0, 7, True), (seed[1], 0, 0, False), (seed[2], 0, 0, False),
                                    ([*base, "--lr=2e-3"], 0, 7, True), (seed[3], 0, 7, True),
                                    (seed[4], 2, 0, False),  # refused: the next resets
                                    (seed[5], 0, 7, True), (seed[0], 0, 3, False),  # kept but rejected: the next resets
                                    (seed[1], 0, 3, True), (seed[2], 0, 0, False)]:
        outcome.update(rc=rc, graphs=graphs)
        n = len(resets)
        assert main(argv) == rc and (len(resets) > n) == reset, (argv, rc, graphs)


def test_the_training_worker_compiles_into_the_private_caches_whatever_it_imports_ahead(tmp_path):
    """The training worker imports Inductor ahead (`worker.import_ahead`), whose import sets a default cache directory
    into the environment where none is: the worker fixes the private compile caches first (as `stages.train` does),
    so its trainings and the stand-ins compiled in it share the caches a training in a process of its own uses."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env["DFLASH_COMPILE_CACHE"] = str(tmp_path)
    code = ("import os; from testbed import trainworker; trainworker.load(); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR']); print(os.environ['TRITON_CACHE_DIR'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(tmp_path / "inductor-rank0"), str(tmp_path / "triton-rank0")]


def test_a_testbed_stopped_by_sigterm_ends_the_processes_it_started(tmp_path):
    """`python -m testbed` under SIGTERM (a `kill`, a scheduler's stop): it ends at once, exit 143, and so do the
    processes it started — a stage beside it, a worker, a stage it waits for (`worker.end_children`) — which went
    on using the GPU without it before (a regeneration, a request in flight); a thread that starts the next process
    once one ended (the stand-ins) starts none."""
    import signal

    code = f"""
import subprocess, sys, time
from pathlib import Path
from testbed import cli, commands, worker
cli.end_on_sigterm()
beside = commands.Background("timeit", "-n", "1", "import time; time.sleep(120)", log_file=Path({str(tmp_path)!r}) / "b.log")
w = worker.Worker("testbed.evalworker")
w.start({{}})
waited = worker.start_child([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(beside.proc.pid, w.proc.pid, waited.pid, flush=True)
def again():  # (as a thread that starts the next stand-in once one ended)
    import threading
    while True:
        try:
            p = worker.start_child([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except RuntimeError:
            return
        print("next", p.pid, flush=True)
        p.wait()
import threading
threading.Thread(target=again, daemon=True).start()
time.sleep(0.5)
print("ready", flush=True)
waited.wait()
"""
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    line = parent.stdout.readline()
    while line.startswith("[testbed"):  # (Background says what it started)
        line = parent.stdout.readline()
    pids = [int(x) for x in line.split()]
    assert len(pids) == 3, parent.stderr.read()

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    while not (line := parent.stdout.readline()).startswith("ready"):
        pids.append(int(line.split()[1]))
    assert all(alive(pid) for pid in pids) and len(pids) == 4
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 143
    assert "stopped by SIGTERM, with the 4 process(es) it had running" in parent.stderr.read()
    pids += [int(line.split()[1]) for line in parent.stdout.read().splitlines() if line.startswith("next")]
    t0 = time.monotonic()
    while any(alive(pid) for pid in pids) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def test_a_stage_beside_names_its_log_when_it_fails_and_ends_when_stopped(tmp_path):
    """commands.Background (the evaluation candidates answered beside the corpus's regeneration): a failure raises
    with the stage and its log named; `stop` ends one still running (the phase beside it failed) within seconds."""
    bad = commands.Background("no_such_module_here", "--x=1", log_file=tmp_path / "logs" / "bad.log")
    with pytest.raises(RuntimeError, match=r"no_such_module_here .*exit status 1 .*bad\.log"):
        bad.wait()
    assert "No module named" in (tmp_path / "logs" / "bad.log").read_text()
    ok = commands.Background("timeit", "-n", "1", "pass", log_file=tmp_path / "ok.log")
    assert ok.wait() > 0 and ok.ended >= ok.started and "loop" in (tmp_path / "ok.log").read_text()
    slow = commands.Background("timeit", "-n", "1", "import time; time.sleep(120)", log_file=tmp_path / "slow.log")
    with pytest.raises(RuntimeError, match=r"timeit .*still running after 0\.5s .*slow\.log"):
        slow.wait(timeout=0.5)  # (the extraction waits so long for the kernel check run ahead, then goes on)
    t0 = time.perf_counter()
    slow.stop()
    assert slow.proc.poll() is not None and time.perf_counter() - t0 < 30


def test_micro_testbed_runs_every_phase_resumes_and_ab(tmp_path):
    import torch
    from safetensors.torch import load_file

    root = tmp_path / "tb"
    r = _testbed(root, "--kernels_ahead=on")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((root / "testbed.json").read_text())
    # the extraction's kernel check ran ahead, beside the regeneration, as a dry run that wrote nothing
    assert "dry run ok" in (root / "logs" / "kernels-ahead.log").read_text() and "kernel check ahead: done" in r.stdout
    assert not (root / "logs" / "kernels-ahead").exists()
    assert set(res["seconds"]) == {"target", "regen", "extract", "train", "export", "eval"}
    assert res["lossless"] is True and res["tau_trained"] >= 1 and res["tau_untrained"] >= 1
    assert res["regen"]["written"] == 12 and res["train"]["steps"] == 6 and res["extract"]["rows"] > 0
    kept = [v["kept_min"] for _, v in sorted(res["extract"]["projection"].items(), key=lambda kv: int(kv[0]))]
    assert kept == sorted(kept) and kept[-1] > 1 - 1e-9 and len(kept) >= 2  # the full width keeps everything
    # the eval prompts come from held-out files only: the first ones whose greedy answer does not loop
    held = {json.loads(x)["messages"][0]["content"].split("\n", 1)[0]
            for x in (root / "corpus" / "eval.jsonl").read_text().splitlines()}
    assert len(held) == 3 and res["regen"]["eval_prompts"]["candidates"] == 12
    assert res["regen"]["sampling"]["temperature"] == 0.8 and 0 <= res["looping_frac_eval"] <= 1
    # the candidates were answered beside the corpus's regeneration, not after it
    greedy, corpus = res["regen"]["eval_prompts"], res["regen"]["corpus"]
    assert greedy["start"] < corpus["end"] and corpus["start"] < greedy["end"], (greedy, corpus)
    assert "regenerating" in (root / "logs" / "regen-eval-candidates.log").read_text()
    files = json.loads((root / "target" / "files.json").read_text())
    assert held and not held & {n for n, _ in files["files"][: files["train_files"]]}
    # the target-alone decodes were made ahead, asked for as the extraction started (the evaluation worker's first
    # request: `stages.evaluate --baseline_only=1`, no run yet), and the untrained evaluation reused them
    run = root / "runs" / "base" / "seed0"
    phases = json.loads((root / "state.json").read_text())["phases"]
    made = phases["eval"]["baseline_ahead"]
    assert made["error"] is None and made["start"] <= phases["extract"]["start"] and made["end"] >= made["start"]
    assert "the target-alone decodes of 3 prompts written (2 token by token)" in Path(made["log"]).read_text()
    untrained = json.loads((run / "eval-untrained.json").read_text())  # (2 prompts with the drafter, 3 alone)
    assert untrained["baseline"] == {"file": str(root / "baseline-12.json"), "reused": True, "prompts": 3}
    assert untrained["num_prompts"] == 2 and json.loads((run / "eval.json").read_text())["num_prompts"] == 3
    assert json.loads((run / "eval.json").read_text())["baseline"]["reused"] is True
    # the evaluations ran in one process of their own (testbed.evalworker): the trained one reports what
    # `python -m stages.evaluate` reports as a process of its own, timings aside
    cfg = config.apply_preset(config.TestbedConfig(dir=str(root), preset="micro", device="cpu"), [])
    args = commands.evaluate_args(cfg, Paths(root), run, "cpu", False, 0)
    alone = subprocess.run([sys.executable, "-m", "stages.evaluate", *args, f"--out={root / 'alone.json'}"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert untimed(json.loads((root / "alone.json").read_text())) == untimed(json.loads((run / "eval.json").read_text()))
    # in an A/B (τ by replay) the untrained drafter too replays only `untrained_prompts` prompts, and reuses the
    # baseline of every prompt (its drafts at 8 anchors a forward: --replay_batch)
    args = commands.evaluate_args(dataclasses.replace(cfg, arms=";gamma=5", replay_batch=8), Paths(root), run, "cpu",
                                  True)
    assert "--replay_batch=8" in args
    # … and the baseline it makes holds the check prompts' target-alone decodes token by token (the arms' firsts'
    # real decodes reuse them: tests/test_speculate.py), the others' verified in blocks
    assert f"--timed_alone={cfg.check_prompts}" in args and cfg.check_prompts == 2
    assert not any(a.startswith("--timed_alone") for a in commands.evaluate_args(
        dataclasses.replace(cfg, arms=";gamma=5"), Paths(root), run, "cpu", False, 2))
    replayed = subprocess.run([sys.executable, "-m", "stages.evaluate", *args, f"--out={root / 'untrained.json'}"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    replayed = json.loads((root / "untrained.json").read_text())
    assert replayed["tau_from"] == "replay" and replayed["num_prompts"] == cfg.untrained_prompts == 2
    assert replayed["baseline"] == {"file": str(root / "baseline-12.json"), "reused": True, "prompts": 3}
    # the decodes made ahead are those the untrained evaluation makes itself where it finds none (the same key: the
    # prompts rendered as the corpus was; the same tokens)
    own = [a if not a.startswith("--baseline=") else f"--baseline={root / 'own-baseline.json'}" for a in
           commands.evaluate_args(cfg, Paths(root), run, "cpu", True)]
    made = subprocess.run([sys.executable, "-m", "stages.evaluate", *own, f"--out={root / 'own.json'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    ahead, itself = (json.loads((root / name).read_text()) for name in ("baseline-12.json", "own-baseline.json"))
    assert ahead["key"] == itself["key"] and [d["ids"] for d in ahead["decodes"]] == [d["ids"] for d in itself["decodes"]]
    assert [d["stats"]["rollback"] == "drafted" for d in ahead["decodes"]] == \
        [d["stats"]["rollback"] == "drafted" for d in itself["decodes"]]

    # a rerun does nothing; from_phase=train redoes the drafter only (target and cache untouched)
    stamps = {p: p.stat().st_mtime_ns for p in [root / "target" / "model.safetensors", root / "regen.jsonl",
                                                root / "cache" / "hidden" / "manifest.json"]}
    r = _testbed(root)
    assert r.returncode == 0 and "stages.train" not in r.stdout
    # interrupted after the drafters finished but before the phases were recorded: a rerun records them, trains nothing
    st = json.loads((root / "state.json").read_text())
    for name in ("train", "export", "eval"):
        st["phases"].pop(name)
    (root / "state.json").write_text(json.dumps(st))
    r = _testbed(root)
    assert r.returncode == 0 and "stages.train" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((root / "state.json").read_text())["phases"]["eval"]["trained"]["tau_mean"] >= 1
    # (the drafter was trained in the training worker; trained again in a process of its own, it is the same drafter
    # and its evaluation reports the same)
    weights = lambda: load_file(sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors")  # noqa: E731
    in_worker, evaluated = weights(), untimed(json.loads((run / "eval.json").read_text()))
    r = _testbed(root, "--from_phase=train", "--train_worker=0")
    assert r.returncode == 0 and "stages.train" in r.stdout and "stages.extract" not in r.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    again = weights()
    assert again.keys() == in_worker.keys() and all(torch.equal(again[k], in_worker[k]) for k in again)
    assert untimed(json.loads((run / "eval.json").read_text())) == evaluated
    # … and its evaluations reuse the target-alone decodes made the first time
    assert json.loads((run / "eval.json").read_text())["baseline"]["reused"] is True
    assert json.loads((run / "eval-untrained.json").read_text())["baseline"]["reused"] is True

    # A/B: the recipe's arm reuses the base run; an fp8 arm gets its own cache from the same target and corpus; an
    # arm whose drafter or cache fails is reported (exit 1) and the others are not lost; each arm trains under seeds
    # of its own (the recipe's: the first seed, its base run)
    own = lambda arm, null=False: testbed_ab.arm_seeds(config.TestbedConfig(seeds=1), arm, null)[0]  # noqa: E731
    null_run = root / "runs" / "base" / f"seed{own('', null=True)}"
    fp8_run, bad_run = (root / "runs" / d / f"seed{own(a)}" for d, a in (("quantfp8", "quant=fp8"), ("steps1", "steps=1")))
    bogus = [f"runs/quantbogus/seed{own('quant=bogus')}", f"runs/weightingbogus/seed{own('weighting=bogus')}"]
    r = _testbed(root, "--arms=;quant=fp8;weighting=bogus;quant=bogus;project_dims=32 quant=fp4", "--seeds=1",
                 "--label=t", "--parallel=2", "--derive_caches=1", f"--results={root / 'sweep.json'}")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    ab = json.loads((root / "ab" / "t.json").read_text())
    # the checks ride along: the known-bad arm (a quarter of the 6 steps) and the null arm (the recipe under seed 1)
    assert [a["arm"] for a in ab["arms"]] == ["(recipe)", "quant=fp8", "project_dims=32 quant=fp4", "steps=1",
                                              "(recipe, other seeds)"]
    assert (null_run / "eval.json").is_file()
    assert json.loads((bad_run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
    assert set(ab["judgement"]["checks"]) == {"null", "bad"}
    res = json.loads((root / "sweep.json").read_text())
    assert [a["label"] for a in res["arms"]] == ["(recipe)", "quant=fp8", "project_dims=32 quant=fp4"]
    assert res["null_arm"]["label"] == "(recipe, other seeds)" and res["bad_arm"]["label"] == "steps=1"
    assert res["device_seconds"] > 0 and res["looping_frac_eval"] is not None and res["commit"]
    # every invocation on DIR counts, each told by the sweep it ran: the testbed's own calls above and this one
    tag = cli.sweep_tag(config.TestbedConfig(arms=";quant=fp8;weighting=bogus;quant=bogus;project_dims=32 quant=fp4",
                                             label="t"))
    assert res["one_sweep"] is True and res["invocations"][-1]["sweep"] == "t" and res["invocations"][-1]["arms"]
    assert set(res["device_seconds_by_sweep"]) == {"(testbed alone)", f"t ({tag['arms']})"}
    assert sum(res["device_seconds_by_sweep"].values()) == pytest.approx(res["device_seconds"], abs=0.1)
    assert {"ci_low", "ci_high", "delta", "spread", "lossless", "tau_pooled"} <= set(res["arms"][1])
    assert res["arms"][1]["seeds"] == [own("quant=fp8")] and res["null_arm"]["seeds"] == [own("", null=True)]
    # the projected fp4 cache's drafter, folded at export, decodes losslessly through the served modeling code
    # (τ replayed on the target-alone decodes; each arm's first drafter also decodes 2 of the 3 prompts for real and
    # the replay took the decode's steps there; the null arm's drafters only replay)
    # (--derive_caches=1: the arms' caches are derived from the base cache's bf16 states, not extracted again)
    assert res["derive_caches"] is True and res["derived_caches"] == ["hidden-project_dims32-quantfp4", "hidden-quantfp8"]
    for arm in ("quantfp8", "project_dims32-quantfp4"):
        assert read_manifest(root / "cache" / f"hidden-{arm}")["config"]["extract"]["from_cache"] == str(
            (root / "cache" / "hidden").resolve())
    proj_run = root / "runs" / "project_dims32-quantfp4" / f"seed{own('project_dims=32 quant=fp4')}"
    proj = json.loads((proj_run / "eval.json").read_text())
    assert proj["lossless"] is True and proj["num_prompts"] == 3 and proj["lossless_prompts"] == 2
    assert proj["tau_from"] == "replay" and proj["replay_check"] == {"prompts": 2, "agree": 2}
    assert json.loads((null_run / "eval.json").read_text())["replay_check"]["prompts"] == 0
    assert res["tau_from"] == "replay" and res["replay_check"] == {"drafters": 2, "prompts": 4, "agree": 4}
    # (the recipe's seed 0 is the testbed's own drafter, reused: all 3 prompts were decoded for real)
    assert [a["decoded_for_real"] for a in res["arms"]] == [3, 2, 2] and res["null_arm"]["decoded_for_real"] == 0
    assert res["bad_arm"]["decoded_for_real"] == 0  # (the recipe's graphs at fewer steps: the recipe's first checks)
    assert "the replay took the decode's steps on 4/4" in r.stdout
    assert sorted(ab["failed"]) == bogus
    assert "could not be extracted" in ab["failed"][bogus[0]]
    assert f"FAILED {bogus[1]}" in r.stdout
    fp8 = json.loads((root / "cache" / "hidden-quantfp8" / "manifest.json").read_text())
    assert fp8["producer"]["quant"] == "fp8" and runs.cache_complete(root / "cache" / "hidden-quantfp8")
    assert (fp8_run / "eval.json").is_file()
    assert "| quant=fp8 |" in r.stdout

    # --summarize ranks what was evaluated, running nothing: the sweep's own verdicts; an arm missing a drafter's
    # evaluation (a stopped sweep) is left out and named
    arms = "--arms=;quant=fp8;project_dims=32 quant=fp4"
    stamps = {f: f.stat().st_mtime_ns for f in (root / "runs").rglob("*") if f.is_file()}
    r = _testbed(root, arms, "--seeds=1", "--label=s", "--summarize=1", f"--results={root / 'summary.json'}")
    # (exit 1 as the sweep's own: at micro sizes every τ is 1, so the known-bad arm cannot fall below the recipe)
    assert r.returncode == 1 and "NOT DISCRIMINATING" in r.stdout and "stages." not in r.stdout, r.stdout[-3000:]
    again = json.loads((root / "summary.json").read_text())
    for k in ("arms", "null_arm", "bad_arm", "discriminating", "replay_check", "tau_from"):
        assert again[k] == res[k], k
    assert again["device_seconds"] == res["device_seconds"] and again["incomplete"] == {}
    assert again["one_sweep"] is False  # (other arms than sweep t's, whose seconds the sum holds: no one sweep's cost)
    r = _testbed(root, arms, "--seeds=1", "--label=s", "--summarize=1", "--checks=0", f"--results={root / 'summary.json'}")
    unchecked = json.loads((root / "summary.json").read_text())  # (the file's keys stay: no checks, no check arms)
    assert unchecked["null_arm"] is None and unchecked["bad_arm"] is None and unchecked["discriminating"] is None
    (fp8_run / "eval.json").unlink()
    r = _testbed(root, arms, "--seeds=1", "--label=s", "--summarize=1", f"--results={root / 'summary.json'}")
    again = json.loads((root / "summary.json").read_text())
    assert [a["label"] for a in again["arms"]] == ["(recipe)", "project_dims=32 quant=fp4"]
    assert again["incomplete"] == {"quant=fp8": "0 of 1 drafters evaluated"}
    assert "not ranked: quant=fp8 (0 of 1 drafters evaluated)" in r.stdout
    assert {f: f.stat().st_mtime_ns for f in (root / "runs").rglob("*") if f.is_file()} == {
        f: t for f, t in stamps.items() if f.name != "eval.json" or "quantfp8" not in str(f)}
    # --stop_after_s: the drafter that would not end in time is not started (exit 3: a rerun resumes), the rest ranked
    r = _testbed(root, "--arms=;quant=fp8", "--seeds=1", "--label=stop", "--stop_after_s=1")
    assert r.returncode == 3 and "stages.train" not in r.stdout and "a rerun resumes" in r.stdout, r.stdout[-3000:]
    assert json.loads((root / "ab" / "stop.json").read_text())["deferred"] == [str(fp8_run.relative_to(root))]
    assert not (fp8_run / "eval.json").exists()


def _fake_stages(monkeypatch, fail: dict):
    """the scheduler's train/export and evaluate replaced: `fail[run name]` = a list of errors its successive
    trainings raise ("oom": out of GPU memory in its log; "bad": any other failure); evaluations write eval JSONs."""
    calls = []

    def train_export(cfg, run, cache, seed, settings, env, log_dir):
        calls.append(run.parent.name + "/" + run.name)
        (run / "logs").mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text("{}")
        kind = (fail.get(run.parent.name) or [None]).pop(0) if fail.get(run.parent.name) else None
        if kind:
            (run / "logs" / "train.log").write_text("torch.OutOfMemoryError: CUDA out of memory." if kind == "oom"
                                                     else "ValueError: something else")
            raise RuntimeError(f"stages.train ... failed with exit status 1 (log: {run / 'logs' / 'train.log'})")
        (run / "logs" / "train.log").write_text("done")
        return {"train": 0.0, "export": 0.0}

    def evaluate(cfg, p, run, dev, untrained, log_file, env, check=0):
        name = "eval-untrained.json" if untrained else "eval.json"
        ok = "lossy" not in str(run)
        (run / name).write_text(json.dumps({"tau_mean": 1.0 if untrained else 2.0, "per_prompt": [], "lossless": ok,
                                            "mismatches": [] if ok else [1]}))
        p.baseline(cfg.eval_tokens).write_text("{}")
        return 0.0

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "evaluate", evaluate)
    monkeypatch.setattr(scheduler, "evaluations_ahead", lambda cfg, env: None)  # (no evaluation worker to start)
    return calls


def test_the_drafters_start_the_evaluation_worker_ahead_with_the_environment_their_evaluations_get(tmp_path,
                                                                                                     monkeypatch):
    """run_drafters starts the evaluation worker before the first training (`commands.evaluations_ahead`), with the
    environment every evaluation then passes (another would start a second process), and not when every drafter is
    evaluated already; `--eval_worker=0` starts none."""
    _fake_stages(monkeypatch, {})
    ahead, envs, fake_eval = [], [], scheduler.evaluate
    monkeypatch.setattr(scheduler, "evaluations_ahead", lambda cfg, env: ahead.append((cfg.eval_worker, dict(env))))

    def evaluate(cfg, p, run, dev, untrained, log_file, env, check=0):
        envs.append(dict(env))
        return fake_eval(cfg, p, run, dev, untrained, log_file, env, check)

    monkeypatch.setattr(scheduler, "evaluate", evaluate)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b"])
    scheduler.run_drafters(cfg, p, "cpu", jobs, 2, jobs[0].run)  # (2 at a time: an environment of their own)
    assert len(ahead) == 1 and ahead[0][1] and envs and all(e == ahead[0][1] for e in envs), (ahead, envs)
    scheduler.run_drafters(cfg, p, "cpu", jobs, 2, jobs[0].run)  # every drafter evaluated: nothing to start
    assert len(ahead) == 1
    calls = []
    monkeypatch.setattr(commands.EVAL_WORKER, "start", lambda env=None: calls.append(env))
    commands.evaluations_ahead(dataclasses.replace(cfg, eval_worker=False), {})
    commands.evaluations_ahead(cfg, {"X": "1"})
    assert calls == [{"X": "1"}]


def _timed_stages(monkeypatch, train_s: float, eval_s: float) -> list:
    """`_fake_stages` taking time: each training `train_s` seconds, each evaluation `eval_s` (the untrained one 0.05),
    one evaluation at a time as in the evaluation worker, its seconds returned as `stage`'s are; returns the trainings'
    (start time, run name), in order."""
    import threading
    import time

    _fake_stages(monkeypatch, {})
    fake_train, fake_eval, lock, started = scheduler.train_export, scheduler.evaluate, threading.Lock(), []

    def train_export(cfg, run, *a, **k):
        started.append((time.monotonic(), run.parent.name))
        time.sleep(train_s)
        return fake_train(cfg, run, *a, **k)

    def evaluate(cfg, p, run, dev, untrained, *a, **k):
        with lock:
            t0 = time.perf_counter()
            time.sleep(0.05 if untrained else eval_s)
            fake_eval(cfg, p, run, dev, untrained, *a, **k)
            return time.perf_counter() - t0

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "evaluate", evaluate)
    return started


def test_a_first_arm_whose_own_cache_cannot_be_extracted_fails_the_sweep_at_once(tmp_path, monkeypatch):
    """The first arm's first drafter is the testbed's own, on that arm's cache: when the cache cannot be extracted,
    the untrained evaluation (waiting for that run's training to start) and the other drafters (waiting for it) must
    not wait forever — the sweep fails with the cache's error."""
    import threading

    from testbed import phases

    calls = _fake_stages(monkeypatch, {})
    monkeypatch.setattr(scheduler, "extract", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no room left")))
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    runs.write_state(p, {"phases": {name: {"seconds": 1.0} for name in ("target", "regen", "extract")}})
    jobs = [Job("q", p.run("q", 0), p.hidden("q"), 0, {}), Job("q", p.run("q", 1), p.hidden("q"), 1, {}),
            Job("r", p.run("r", 0), p.hidden(), 0, {"gamma": 5.0})]
    out = {}

    def sweep():
        try:
            phases.testbed(cfg, p, "cpu", None, jobs, 1, {"q": {"quant": "fp4"}})
        except Exception as e:  # noqa: BLE001
            out["error"] = str(e)

    th = threading.Thread(target=sweep, daemon=True)
    th.start()
    th.join(30)
    assert not th.is_alive(), "the sweep waits forever on a base run that never starts"
    assert "no room left" in out["error"] and "q/seed0" not in calls


def _jobs(p, names):
    return [Job(n, p.run("" if n == "base" else n, 0), p.hidden(), 0, {}) for n in names]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_drafter_out_of_gpu_memory_is_tried_again_after_the_others(tmp_path, monkeypatch, overlap):
    calls = _fake_stages(monkeypatch, {"b": ["oom"], "c": ["bad"]})
    cfg, p = config.TestbedConfig(dir=str(tmp_path), overlap_eval=overlap), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c"])
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 2, jobs[0].run)
    assert calls.count("b/seed0") == 2 and calls.count("c/seed0") == 1 and calls[-1] == "b/seed0"
    assert "error" not in times[p.run("b", 0)] and (p.run("b", 0) / "eval.json").is_file()
    assert "something" not in times[p.run("c", 0)]["error"] and "exit status 1" in times[p.run("c", 0)]["error"]
    assert (p.run("", 0) / "eval-untrained.json").is_file()


def test_the_other_drafters_start_once_the_first_has_compiled_its_first_step(tmp_path, monkeypatch):
    """The first job compiles alone (the others would compile the same graphs at once, each with a share of the CPUs);
    its first step is read from its status file, never from one a killed earlier run left there."""
    import time

    _fake_stages(monkeypatch, {})
    started, stepped = {}, {}
    fake = scheduler.train_export

    def train_export(cfg, run, cache, seed, settings, env, log_dir):
        started[run.parent.name] = time.time()
        if run.parent.name == "base":
            time.sleep(1.5)  # compiling
            stepped["base"] = time.time()
            (run / "status-rank0.json").write_text(json.dumps({"done": 1, "updated_at": time.time()}))
            time.sleep(1.0)
        return fake(cfg, run, cache, seed, settings, env, log_dir)

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "WARM_POLL_S", 0.05)  # (the status file read once a second: up to 1 s late)
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b"])
    jobs[0].run.mkdir(parents=True)  # a run killed after its training: same settings (kept), its status says 600
    (jobs[0].run / runs.JOB_FILE).write_text(json.dumps(commands.job_identity(cfg, p, jobs[0])))
    (jobs[0].run / "status-rank0.json").write_text(json.dumps({"done": 600, "updated_at": time.time() - 60}))
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 3, jobs[0].run)
    assert min(started["a"], started["b"]) >= stepped["base"]
    assert started["a"] < stepped["base"] + 0.9  # … and not only once it finished
    assert times[jobs[1].run]["wait_warm"] > 1.0


def test_a_first_drafter_that_fails_before_training_does_not_hold_the_others(tmp_path, monkeypatch):
    import time

    _fake_stages(monkeypatch, {})
    monkeypatch.setattr(scheduler, "WARM_WAIT_S", 60)
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = [Job("x", p.run("x", 0), tmp_path / "no-cache", 0, {})] + _jobs(p, ["a", "b"])

    def broken(c):
        raise RuntimeError("its cache could not be extracted")

    monkeypatch.setattr(scheduler, "fresh_run", lambda cfg, p, j: broken(j) if j.arm == "x" else None)
    t0 = time.time()
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 2, None)
    assert time.time() - t0 < 30 and "could not be extracted" in times[jobs[0].run]["error"]
    assert (p.run("a", 0) / "eval.json").is_file() and (p.run("b", 0) / "eval.json").is_file()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_base_drafter_stops_the_jobs_not_yet_started(tmp_path, monkeypatch, overlap):
    calls = _fake_stages(monkeypatch, {"base": ["bad"]})
    cfg, p = config.TestbedConfig(dir=str(tmp_path), overlap_eval=overlap), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c"])
    with pytest.raises(RuntimeError, match="exit status 1"):
        scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    assert calls == ["base/seed0"]  # nothing else started (one at a time: the others were queued)


def test_sweep_presets_combine_without_repeating_an_arm():
    arms = testbed_ab.sweep_arms("options,encodings,fp8", cuda=True)
    assert arms[0] == "" and len(arms) == len(set(arms))
    assert {"gamma=5", "quant=fp4", "project_dims=384 quant=fp8", "precision=fp8 loss_logits=fp8"} <= set(arms)
    assert arms.count("quant=fp8") == 1
    assert not any("precision=fp8" in a for a in testbed_ab.sweep_arms("fp8", cuda=False))
    for a in arms:
        testbed_runs_parse = runs.parse_arm(a)  # every preset arm is a valid setting
        assert isinstance(testbed_runs_parse, tuple)
    assert config.TestbedConfig(sweep="options,fp8").resolve().sweep == "options,fp8"
    with pytest.raises(ConfigError, match="testbed.sweep"):
        config.TestbedConfig(sweep="options,bogus").resolve()
    with pytest.raises(ConfigError, match="keep train_worker=1"):  # the resident switch goes through the worker
        config.TestbedConfig(resident=True, train_worker=False).resolve()
    assert config.TestbedConfig(label="dflash2-fp4+equal_compute.v2").resolve().label == "dflash2-fp4+equal_compute.v2"
    for label in ("a/b", "../x", ".hidden", "two words", "x" * 101):  # (a path would write the A/B record elsewhere)
        with pytest.raises(ConfigError, match=r"testbed.label=.*letters, digits"):
            config.TestbedConfig(label=label).resolve()
    with pytest.raises(ConfigError, match="eval_tokens must be >= 2"):  # (before the target trains, not at eval)
        config.TestbedConfig(eval_tokens=1).resolve()
    for bad in ({"untrained_prompts": -1}, {"replay_batch": -1}):
        with pytest.raises(ConfigError, match="check_prompts and replay_batch must be >= 0"):
            config.TestbedConfig(**bad).resolve()


def test_a_label_spelt_with_a_tilde_is_refused_in_a_second_not_made_a_home_path(tmp_path):
    r = subprocess.run([sys.executable, "-m", "testbed", f"--dir={tmp_path}", "--label=~/x", "--arms=gamma=5"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 2 and f"testbed.label={tmp_path}/x" in r.stderr, r.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # (nothing made)


def recipe_configs(ext: dict, train: dict):
    """(ExtractConfig, TrainConfig) of manifests/testbed.toml with an arm's settings, as the stages apply them."""
    from dflash_offline.config import ExtractConfig, config_from_argv
    from dflash_offline.trainsetup import TrainConfig

    recipe = str(REPO / "manifests" / "testbed.toml")
    return (config_from_argv(ExtractConfig, "extract", [f"--recipe={recipe}", *(f"--{k}={v}" for k, v in
                                                                              ext.items())], ""),
            config_from_argv(TrainConfig, "train", [f"--recipe={recipe}", "--cache=x", *(f"--{k}={v}" for k, v in
                                                                                       train.items())], ""))


def test_every_preset_arm_resolves_against_the_testbed_recipe():
    """Each sweep arm's settings, applied to manifests/testbed.toml as the stages apply them, make a valid [extract] /
    [train] config (a typo or a bad value in a preset fails here, not after the testbed's phases on a GPU)."""
    from dflash_offline.config import as_dict
    from testbed.target import DIMS

    configs = recipe_configs
    base = configs({}, {})
    for arm in testbed_ab.sweep_arms(",".join(config.SWEEPS), cuda=True):
        ext, train = runs.parse_arm(arm)
        e, t = configs(ext, train)
        assert e.project_dims <= DIMS["hidden_size"], arm
        for k in ext:  # each setting took effect: the arm is not the recipe under another name
            assert getattr(e, k) != getattr(base[0], k), (arm, k)
        for k in train:
            assert as_dict(t)[k] != as_dict(base[1])[k], (arm, k)  # (flat: each key in its group)


def test_the_dflash2_arm_is_the_recipe_as_dflash2_at_the_same_budget():
    """`--sweep=dflash2` / `--arms=";variant=dflash2"`: the arm's settings change the recipe's variant only (block 16,
    γ 7, 512 anchors, 600 steps × 4 rows: the same budget), build a DFlash2 drafter at the testbed's width (its conv
    groups divide 768, its selector spans the testbed's vocabulary) and at the micro preset's, and its checks follow
    it; a block-8 pair (DFlash and DFlash2 both at DFlash2's published block) is expressible as arms too."""
    import torch

    from dflash_offline.config import as_dict
    from dflash_offline.drafter import DFlashDrafter, DrafterConfig
    from testbed.target import DIMS

    assert config.SWEEPS["dflash2"] == ["", "variant=dflash2"]
    ext, train = runs.parse_arm("variant=dflash2")
    assert (ext, train) == ({}, {"variant": "dflash2"})
    base, arm = as_dict(recipe_configs({}, {})[1]), as_dict(recipe_configs(ext, train)[1].resolve())
    assert {k for k in arm if arm[k] != base[k]} == {"variant"}
    assert (arm["block_size"], arm["gamma"], arm["num_anchors"], arm["steps"]) == (16, 7.0, 512, 600)
    for hidden, vocab in ((DIMS["hidden_size"], config.TestbedConfig().vocab), (64, config.PRESETS["micro"]["vocab"])):
        with torch.device("meta"):
            model = DFlashDrafter(DrafterConfig(
                hidden_size=hidden, intermediate_size=128, vocab_size=vocab, target_layer_ids=[1, 3, 5, 7, 9],
                num_target_layers=12, mask_token_id=vocab - 1, num_layers=arm["num_layers"], num_heads=4,
                num_kv_heads=2, head_dim=16, block_size=arm["block_size"], variant=arm["variant"],
                conv_kernel_size=arm["conv_kernel_size"], conv_group_size=arm["conv_group_size"],
                selector_rank=arm["selector_rank"], selector_top_k=arm["selector_top_k"]))
        assert model.candidate_selector.successor_codebook.shape == (vocab, 256)
    assert testbed_ab.check_arms(config.TestbedConfig(), "variant=dflash2") == (
        "(variant=dflash2, other seeds)", "variant=dflash2 steps=150")
    pair = [runs.parse_arm(a)[1] for a in ("block_size=8 gamma=4", "variant=dflash2 block_size=8 gamma=4")]
    assert [as_dict(recipe_configs({}, t)[1].resolve())["block_size"] for t in pair] == [8, 8]


@pytest.mark.parametrize("worker", [True, False])
def test_an_evaluation_that_exits_1_without_its_json_is_a_failure_not_a_result(tmp_path, monkeypatch, worker):
    """stages.evaluate exits 1 both when the output is not lossless (its JSON says so) and on an uncaught error:
    a JSON left from an earlier evaluation must not pass for this one's (in the evaluation worker or a process)."""
    cfg, p = config.TestbedConfig(dir=str(tmp_path), eval_worker=worker), Paths(str(tmp_path))
    run = p.run("", 0)
    run.mkdir(parents=True)
    (run / "eval.json").write_text("{}")  # an earlier evaluation's
    monkeypatch.setattr(commands, "run_child", lambda *a, **k: 1)  # exits 1 (accepted) and writes nothing
    monkeypatch.setattr(commands.EVAL_WORKER, "run", lambda *a, **k: 1)
    with pytest.raises(RuntimeError, match=r"failed without writing .*eval.json \(log: .*eval.log\)"):
        commands.evaluate(cfg, p, run, "cpu", False, run / "logs" / "eval.log", {})
    assert not (run / "eval.json").exists()


def test_a_run_made_from_other_settings_or_code_is_made_again_and_an_equal_one_reused(tmp_path, monkeypatch):
    """A drafter's run records what it was made from (training arguments, recipe, cache key, prompts, code): a later
    A/B with other settings (here fewer steps) or code trains it again instead of reporting the old evaluation; the
    same settings reuse it and say so."""
    from testbed import runs as testbed_runs

    calls = _fake_stages(monkeypatch, {})
    p = Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a"])
    scheduler.run_drafters(config.TestbedConfig(dir=str(tmp_path)), p, "cpu", jobs, 1, jobs[0].run)
    assert calls == ["base/seed0", "a/seed0"]
    times = scheduler.run_drafters(config.TestbedConfig(dir=str(tmp_path)), p, "cpu", jobs, 1, jobs[0].run)
    assert calls == ["base/seed0", "a/seed0"] and times[jobs[1].run] == {"reused": 1.0}
    (jobs[1].run / "checkpoints").mkdir()  # (a stale run's files go with it)
    scheduler.run_drafters(config.TestbedConfig(dir=str(tmp_path), train_steps=300), p, "cpu", jobs, 1, jobs[0].run)
    assert calls[2:] == ["base/seed0", "a/seed0"] and not (jobs[1].run / "checkpoints").exists()
    assert "--steps=300" in json.loads((jobs[1].run / testbed_runs.JOB_FILE).read_text())["train"]
    monkeypatch.setattr(testbed_runs, "drafter_code_digest", lambda: "other code")
    monkeypatch.setattr(commands, "drafter_code_digest", lambda: "other code")
    scheduler.run_drafters(config.TestbedConfig(dir=str(tmp_path), train_steps=300), p, "cpu", jobs, 1, jobs[0].run)
    assert calls[4:] == ["base/seed0", "a/seed0"]
    assert testbed_runs.stale_job(jobs[1].run, {"x": 1}) .startswith("made with another ")


def test_a_drafter_that_is_not_lossless_is_reported_failed(tmp_path, monkeypatch):
    from testbed.stats import failed_runs

    _fake_stages(monkeypatch, {})
    p = Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "lossy"])
    times = scheduler.run_drafters(config.TestbedConfig(dir=str(tmp_path)), p, "cpu", jobs, 1, jobs[0].run)
    assert failed_runs(tmp_path, times, [j.run for j in jobs]) == {
        "runs/lossy/seed0": "not lossless: prompts [1] differ from the target's"}


def test_the_same_arm_twice_is_refused_before_anything_runs(tmp_path):
    import torch

    cfg = config.TestbedConfig(dir=str(tmp_path), arms=";gamma=5; gamma=5", preset="micro")
    with pytest.raises(ConfigError, match=r"testbed.arms: gamma=5 given twice .*--seeds"):
        testbed_ab.ab(cfg, Paths(str(tmp_path)), "cpu", torch.device("cpu"))
    cfg = config.TestbedConfig(dir=str(tmp_path), arms=";gamma=5 num_anchors=256;num_anchors=256 gamma=5",
                               preset="micro")  # (the same settings in another order: the same arm, the same seeds)
    with pytest.raises(ConfigError, match=r"gamma=5 num_anchors=256, num_anchors=256 gamma=5 given twice"):
        testbed_ab.ab(cfg, Paths(str(tmp_path)), "cpu", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"testbed.seed=1048575: give 0 … 1048573"):
        config.TestbedConfig(seed=2**20 - 1, seeds=2).resolve()
    assert not (tmp_path / "state.json").exists()


def test_a_drafter_that_would_end_past_stop_after_s_is_not_started_and_a_rerun_starts_it(tmp_path, monkeypatch):
    """--stop_after_s: the drafters that fit run; the next one, expected to take as long as the longest so far, is not
    started (no run directory, no error: `deferred`), and a rerun without the limit trains only that one."""
    import time

    calls = _fake_stages(monkeypatch, {})
    fake = scheduler.train_export

    def slow(cfg, run, cache, seed, settings, env, log_dir):
        time.sleep(1.2)
        return fake(cfg, run, cache, seed, settings, env, log_dir)

    monkeypatch.setattr(scheduler, "train_export", slow)
    monkeypatch.setattr(scheduler, "FIRST_DRAFTER_S", 1.4)  # (the first starts if set-up takes < 1.6 s: a loaded box)
    monkeypatch.setattr(scheduler, "STARTED", time.monotonic())
    cfg, p = config.TestbedConfig(dir=str(tmp_path), stop_after_s=3.0), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c"])
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    done = [j.run for j in jobs if (j.run / "eval.json").is_file()]
    assert 1 <= len(done) < 4 and done == [j.run for j in jobs[: len(done)]], done  # in order, then none
    assert all(times[j.run] == {"deferred": 1.0} and not j.run.exists() for j in jobs[len(done):])
    assert not any("error" in t for t in times.values()) and (p.run("", 0) / "eval-untrained.json").is_file()
    cfg.stop_after_s = 0
    scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    assert sorted(calls) == sorted(f"{j.run.parent.name}/seed0" for j in jobs)  # each trained once
    assert all((j.run / "eval.json").is_file() for j in jobs)


def test_no_untrained_evaluation_starts_once_the_drafters_ended_while_it_waited_for_the_decodes_made_ahead(
        tmp_path, monkeypatch):
    """`--ahead`: the untrained evaluation waits for the target-alone decodes made beside the extraction; where the
    drafters were interrupted, or failed, meanwhile (the decodes then ended with them), it starts none (nor a worker
    for it) — and where they only failed, it goes on and makes them itself."""
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    base = _jobs(p, ["base"])[0]
    base.run.mkdir(parents=True)
    (base.run / "config.json").write_text("{}")
    asked = []
    monkeypatch.setattr(scheduler, "evaluate", lambda *a, **k: asked.append(a[2]) or 1.0)
    monkeypatch.setattr(scheduler, "eval_summary", lambda path: {"tau_mean": 1.0})

    class Ahead:  # (its decodes ended by the interruption: `Ahead.stop`)
        seconds = None

        def __init__(self, interrupt):
            self.interrupt = interrupt

        def wait(self):
            if self.interrupt:
                d.aborted.set()
            return "stages.evaluate ... failed with exit status -15"

    for interrupt, want in ((True, []), (False, [base.run])):
        d = scheduler.Drafters(cfg, p, "cpu", [base], 1, base.run, False, None, None, Ahead(interrupt))
        d.untrained()
        assert asked == want and d.ready.is_set()


def test_an_arms_further_seed_is_expected_to_take_as_long_as_a_repeat_not_as_the_first_compile(tmp_path):
    """--stop_after_s on the H200: the first drafter of a setting took 212 s (it compiled), its further seeds 52–58 s;
    with 180 s left a further seed starts, a drafter of new settings (which may compile) does not. Before a repeat of
    its own settings ended, a further seed is expected to take the longest repeat of others or 0.6 of its first (with
    no repeat ended yet, 0.6 of its first: on the H100 a call idled its last 77 s expecting a repeat to take its
    first's 102 s; the repeats took 16–21 s)."""
    import time

    cfg, p = config.TestbedConfig(dir=str(tmp_path), stop_after_s=600), Paths(str(tmp_path))
    base = _jobs(p, ["base"])[0]
    seed1 = Job("", p.run("", 1), p.hidden(), 1, {})
    new = Job("gamma=5", p.run("gamma5", 0), p.hidden(), 0, {"gamma": 5.0})
    other = Job("noise_std=0.05", p.run("noise", 0), p.hidden(), 0, {"noise_std": 0.05})
    d = scheduler.Drafters(cfg, p, "cpu", [base, seed1, new, other], 1, base.run, False, None)
    d.deadline = time.monotonic() + 180
    d.took = [(scheduler.graph_key(base), 212.0, False)]
    share = scheduler.REPEAT_SHARE * 212.0
    assert d.expected_s(seed1) == share < 180 and d.expected_s(new) == 212.0  # no repeat ended yet: its first's share
    d.defer(seed1)
    d.deadline = time.monotonic() + share - 10
    with pytest.raises(scheduler.Deferred, match=f"takes ≈ {share:.0f}s"):
        d.defer(seed1)
    d.deadline = time.monotonic() + 180
    d.took.append((scheduler.graph_key(other), 150.0, True))  # a repeat of other settings, longer than that share
    assert d.expected_s(seed1) == 150.0
    d.took[-1] = (scheduler.graph_key(other), 56.0, True)
    assert d.expected_s(seed1) == share and d.expected_s(new) == 212.0
    d.defer(seed1)
    with pytest.raises(scheduler.Deferred):
        d.defer(new)
    d.took.append((scheduler.graph_key(seed1), 64.0, True))  # a repeat of its own settings, once one ended
    assert d.expected_s(seed1) == 64.0 and d.expected_s(other) == 56.0
    bad = Job("steps=150", p.run("steps150", 0), p.hidden(), 0, {"steps": 150})  # the recipe's graphs, fewer steps
    assert d.expected_s(bad) == 64.0


def test_a_first_drafter_whose_graphs_a_stand_in_compiled_is_expected_to_take_less(tmp_path):
    """On the H100 the first call deferred every drafter with 217 s left, expecting 240 s of the first (a compile);
    its stand-in had compiled the graphs, and it took 99 s. Before any drafter ended, a drafter whose stand-in is done
    (here or in an earlier invocation) is expected to take FIRST_PRECOMPILED_S; one still to compile, FIRST_DRAFTER_S."""
    import time

    from testbed.precompile import Precompile

    cfg, p = config.TestbedConfig(dir=str(tmp_path), stop_after_s=600), Paths(str(tmp_path))
    base = _jobs(p, ["base"])[0]
    seed1 = Job("", p.run("", 1), p.hidden(), 1, {})
    new = Job("gamma=5", p.run("gamma5", 0), p.hidden(), 0, {"gamma": 5.0})
    pre = Precompile(cfg, p, [base, seed1, new], {})

    def drafters():  # (a new invocation with 217 s left)
        d = scheduler.Drafters(cfg, p, "cpu", [base, seed1, new], 1, base.run, False, None, pre)
        d.deadline = time.monotonic() + 217
        return d

    d = drafters()
    assert not pre.compiled(base.run) and d.expected_s(base) == scheduler.FIRST_DRAFTER_S
    with pytest.raises(scheduler.Deferred):
        d.defer(base)
    for state in ("done", "earlier"):
        pre.by_run[base.run].state = state  # (the recipe's variant: its seeds' too)
        assert pre.compiled(seed1.run) and not pre.compiled(new.run)
        d = drafters()
        assert d.expected_s(base) == scheduler.FIRST_PRECOMPILED_S < 217 and d.expected_s(new) == 240
        d.defer(base)
    pre.by_run[base.run].state = "failed"
    assert d.expected_s(base) == scheduler.FIRST_DRAFTER_S
    d.took = [(scheduler.graph_key(base), 99.0, False)]  # once one ended, what ended counts
    assert d.expected_s(new) == 99.0

    # the base run deferred (its stand-in failed: 240 s) while a later arm's graphs are compiled (140 s): that arm is
    # deferred too while the target-alone decodes, which the base run's untrained evaluation makes, do not exist
    d = drafters()
    pre.by_run[new.run].state = "done"
    with pytest.raises(scheduler.Deferred, match="takes ≈ 240s"):
        d.defer(base)
    assert d.stopped.is_set() and d.expected_s(new) == scheduler.FIRST_PRECOMPILED_S
    with pytest.raises(scheduler.Deferred, match="the base drafter.*was not"):
        d.defer(new)
    p.baseline(cfg.eval_tokens).write_text("{}")  # (made by an earlier invocation: nothing waits on the base run)
    d.defer(new)


def test_a_base_drafter_past_stop_after_s_stops_the_untrained_evaluation_too(tmp_path, monkeypatch):
    import time

    _fake_stages(monkeypatch, {})
    monkeypatch.setattr(scheduler, "STARTED", time.monotonic() - 100)
    cfg, p = config.TestbedConfig(dir=str(tmp_path), stop_after_s=60), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a"])
    t0 = time.time()
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    assert time.time() - t0 < 10 and times[jobs[0].run] == {"deferred": 1.0} == times[jobs[1].run]
    assert not (p.run("", 0) / "eval-untrained.json").exists()


def test_an_ab_s_first_drafter_is_the_testbed_s_own_and_no_drafter_trains_for_the_testbed_alone(tmp_path,
                                                                                              monkeypatch):
    """In an A/B whose first arm is not the recipe, the testbed's train/export/eval phases are its first drafter's
    (the untrained evaluation beside it): no recipe drafter trains for the testbed alone. A later A/B with another
    first arm keeps the recorded drafter (no second untrained evaluation) while it stands: made as its own settings
    ask now (other --train_steps or drafter code: done again, by that A/B's first drafter), its run still there. A
    testbed without arms reports the recipe's drafter, never an arm's. A first arm with a cache of its own stands for
    the testbed too (its cache recorded: a rerun keeps it), whatever its seed (each arm's are its own)."""
    from testbed import phases

    calls = _fake_stages(monkeypatch, {})
    monkeypatch.setattr(phases, "result", lambda cfg, p, st: st)
    monkeypatch.setattr(phases, "run_metrics", lambda run: {"step": 6})
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    runs.write_state(p, {"phases": {name: {"seconds": 1.0} for name in ("target", "regen", "extract")}})
    job = lambda arm, seed, cache="": Job(arm, p.run(arm, seed), p.hidden(cache), seed,  # noqa: E731
                                          {"gamma": 5.0} if arm == "a" else {})
    evaluated = lambda: runs.read_state(p)["phases"]["eval"]["run"]  # noqa: E731
    phases.testbed(cfg, p, "cpu", None, [job("a", 0), job("a", 1), job("b", 0)])
    assert calls == ["a/seed0", "a/seed1", "b/seed0"] and not p.run("", 0).exists()
    ph = runs.read_state(p)["phases"]
    assert ph["eval"]["run"] == "runs/a/seed0" and ph["eval"]["trained"]["tau_mean"] == 2.0
    assert ph["eval"]["untrained"]["tau_mean"] == 1.0 and (p.run("a", 0) / "eval-untrained.json").is_file()
    assert testbed_ab.summary_record(cfg, p)[0]["tau_trained"] == 2.0
    phases.testbed(cfg, p, "cpu", None, [job("c", 0)])
    assert calls[3:] == ["c/seed0"] and not (p.run("c", 0) / "eval-untrained.json").exists()
    assert evaluated() == "runs/a/seed0"
    # other --train_steps: the recorded drafter (arm a's, rebuilt with its settings) is stale, the phases are c's
    cfg = config.TestbedConfig(dir=str(tmp_path), train_steps=7)
    phases.testbed(cfg, p, "cpu", None, [job("c", 0)])
    assert calls[4:] == ["c/seed0"] and (p.run("c", 0) / "eval-untrained.json").is_file()
    assert evaluated() == "runs/c/seed0"
    monkeypatch.setattr(runs, "drafter_code_digest", lambda: "other code")
    monkeypatch.setattr(commands, "drafter_code_digest", lambda: "other code")
    phases.testbed(cfg, p, "cpu", None, [job("d", 0)])
    assert calls[5:] == ["d/seed0"] and evaluated() == "runs/d/seed0"
    # its run removed (to redo the arm): the record does not outlive it
    import shutil

    shutil.rmtree(p.run("d", 0))
    phases.testbed(cfg, p, "cpu", None, [job("e", 0)])
    assert calls[6:] == ["e/seed0"] and evaluated() == "runs/e/seed0"
    # a testbed without arms: the recipe's drafter, trained now, not arm e's
    phases.testbed(cfg, p, "cpu", None, [])
    assert calls[7:] == ["base/seed0"] and evaluated() == "runs/base/seed0"
    assert phases.own_drafter(cfg, p, [job("r", 7), job("r", 8)]).run == p.run("r", 7)
    first = testbed_ab.sweep_jobs(cfg, p, ["gamma=5", "num_anchors=256"], None, None)[0][0]
    assert phases.own_drafter(cfg, p, [first]) == first and first.seed == testbed_ab.arm_seeds(cfg, "gamma=5")[0]
    # a first arm on a cache of its own: its first drafter is the testbed's, on that cache, kept by a rerun
    shutil.rmtree(p.run("", 0))
    phases.testbed(cfg, p, "cpu", None, [job("q", 0, "quantfp8"), job("q", 1, "quantfp8")])
    assert calls[8:] == ["q/seed0", "q/seed1"] and evaluated() == "runs/q/seed0"
    assert runs.read_state(p)["phases"]["eval"]["job"]["cache"] == "cache/hidden-quantfp8"
    assert (p.run("q", 0) / "eval-untrained.json").is_file() and not p.run("", 0).exists()
    recorded = phases.recorded_job(cfg, p, runs.read_state(p)["phases"])
    assert (recorded.run, recorded.cache) == (p.run("q", 0), p.hidden("quantfp8"))
    phases.testbed(cfg, p, "cpu", None, [job("q", 0, "quantfp8"), job("q", 1, "quantfp8")])
    assert calls[10:] == [] and evaluated() == "runs/q/seed0"


def test_a_rerun_keeps_the_first_arm_s_recorded_drafter_whatever_the_order_of_its_settings(tmp_path, monkeypatch,
                                                                                          capsys):
    """state.json stores an arm's settings sorted by name; an arm written in another order (`weighting=dpace
    precision=fp8`) is still the drafter recorded: a rerun of the same sweep neither calls it stale nor redoes the
    testbed's phases."""
    from testbed import phases

    calls = _fake_stages(monkeypatch, {})
    monkeypatch.setattr(phases, "result", lambda cfg, p, st: st)
    monkeypatch.setattr(phases, "run_metrics", lambda run: {"step": 6})
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    runs.write_state(p, {"phases": {name: {"seconds": 1.0} for name in ("target", "regen", "extract")}})
    first = Job("a", p.run("a", 0), p.hidden(), 0, {"weighting": "dpace", "precision": "fp8"})
    phases.testbed(cfg, p, "cpu", None, [first])
    eval_before = runs.read_state(p)["phases"]["eval"]
    assert calls == ["a/seed0"] and list(eval_before["job"]["settings"]) == ["precision", "weighting"]
    capsys.readouterr()
    phases.testbed(cfg, p, "cpu", None, [first])
    assert "done again" not in "".join(capsys.readouterr())
    assert calls == ["a/seed0"] and runs.read_state(p)["phases"]["eval"] == eval_before
    # a run recorded with the settings in the arm's own order (before they were sorted) is the same drafter; another
    # value is not
    job_file = first.run / runs.JOB_FILE
    recorded = json.loads(job_file.read_text())
    unsorted = [a for a in recorded["train"] if not a.startswith(("--weighting", "--precision"))] + [
        "--weighting=dpace", "--precision=fp8"]
    assert unsorted != recorded["train"]
    job_file.write_text(json.dumps({**recorded, "train": unsorted}))
    assert runs.stale_job(first.run, commands.job_identity(cfg, p, first)) is None
    job_file.write_text(json.dumps({**recorded, "train": [a.replace("fp8", "bf16") for a in unsorted]}))
    assert runs.stale_job(first.run, commands.job_identity(cfg, p, first)) == "made with another train"
    with pytest.raises(ConfigError, match="'gamma' is given twice"):
        runs.parse_arm("gamma=5 weighting=dpace gamma=6")


MICRO_COMPILED = ("--train_args=num_layers=2 num_heads=4 num_kv_heads=2 head_dim=16 num_anchors=16 batch_rows=2 "
                  "log_every=2 compile=on")  # (the micro preset's drafter, compiled as on a GPU)


def test_precompiled_stand_ins_leave_every_drafter_graph_in_the_compile_caches(tmp_path):
    """`--precompile=auto` with the drafter compiled: its graphs compile on a stand-in (random target weights and
    states of the same shapes) beside the phases; the real drafter then finds every Inductor graph in the (cold at
    the start) compile caches instead of compiling it (AOTAutograd's joint graphs too) — a stand-in of other shapes,
    encoding or mask token would miss; a rerun of the drafter compiles no stand-in again and still misses nothing."""
    import os

    root = tmp_path / "tb"
    env = {**os.environ, "DFLASH_COMPILE_CACHE": str(tmp_path / "compile-cache")}  # (cold: nothing compiled yet)

    def testbed(*args):
        r = subprocess.run([sys.executable, "-m", "testbed", "--preset=micro", f"--dir={root}", MICRO_COMPILED, *args],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        hits, misses, aot_hits, aot_misses = map(int, re.search(
            r"graph cache: (\d+) hits, (\d+) misses; AOTAutograd's: (\d+) hits, (\d+) misses",
            r.stdout + r.stderr).groups())
        assert hits > 0 and misses == 0 and aot_hits > 0 and aot_misses == 0, (args, hits, misses, aot_hits, aot_misses)
        assert re.search(r"; the step's parts: batches [\d.]+s, forward/backward [\d.]+s, optimizer [\d.]+s\n",
                         r.stdout + r.stderr)  # (where a warm-up's seconds went)
        return r, [(v["variant"], v["state"], v["runs"]) for v in
                   json.loads((root / "logs" / "precompile.json").read_text())]

    r, rec = testbed()
    assert rec == [("(recipe)", "done", ["runs/base/seed0"])] and "precompiling 1 drafter" in r.stdout
    assert not (root / "precompile" / "runs").exists() or not any((root / "precompile" / "runs").iterdir())
    r, rec = testbed("--from_phase=train")  # the drafter again, into the same compile caches
    assert rec == [("(recipe)", "earlier", ["runs/base/seed0"])] and "precompiling" not in r.stdout


def test_a_drafter_drops_its_stand_in_still_queued_and_waits_for_one_compiling(tmp_path):
    """The stand-ins never hold a drafter up for long: one not yet started is dropped when its drafter is about to
    train (the drafter compiles its own graphs), one compiling is waited for (not compiled twice at once); a stop
    drops the rest. Variants are the distinct [train] settings but steps × cache encodings, in the jobs' order."""
    import threading
    import time

    from testbed.precompile import Precompile

    p = Paths(tmp_path)
    cfg = config.TestbedConfig(dir=str(tmp_path))
    jobs = [Job("", p.run("", 0), p.hidden(), 0, {}), Job("", p.run("", 1), p.hidden(), 1, {}),
            Job("steps=150", p.run("steps150", 0), p.hidden(), 0, {"steps": 150}),
            Job("gamma=5", p.run("gamma5", 0), p.hidden(), 0, {"gamma": 5.0}),
            Job("quant=fp8", p.run("quantfp8", 0), p.hidden("quantfp8"), 0, {}),
            Job("num_anchors=256", p.run("num_anchors256", 0), p.hidden(), 0, {"num_anchors": 256})]
    pre = Precompile(cfg, p, jobs, {p.hidden("quantfp8"): {"quant": "fp8"}})
    assert [len(v.runs) for v in pre.variants] == [3, 1, 1, 1]  # (the recipe's seeds and its fewer steps: one)
    assert pre.variants[2].cache == {"quant": "fp8"}
    recipe, gamma, fp8, anchors = pre.variants
    assert pre.before(p.run("gamma5", 0)) < 1 and gamma.state == "dropped"
    recipe.state = "running"
    def compiled():
        with pre.cond:
            recipe.state = "done"
            pre.cond.notify_all()

    threading.Timer(0.5, compiled).start()
    t0 = time.perf_counter()
    pre.before(p.run("", 1))
    assert time.perf_counter() - t0 >= 0.4 and recipe.state == "done"
    pre.stop()
    assert (fp8.state, anchors.state) == ("dropped", "dropped")
    assert [v["state"] for v in json.loads(pre.record.read_text())] == ["done", "dropped", "dropped", "dropped"]


def _tiny_lm():
    """A language model of a few parameters: what the target's training loop needs of one (logits of input_ids)."""
    import types

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

        def forward(self, input_ids):
            return types.SimpleNamespace(logits=self.out(torch.tanh(self.emb(input_ids).cumsum(1))))

    return Tiny()


def test_the_targets_gradient_accumulated_over_micro_batches_is_the_whole_batchs():
    """The target may train in micro-batches (64 rows at once do not fit an H100): the same loss and gradient as the
    batch at once, up to float rounding."""

    import torch

    torch.manual_seed(0)
    model, rows = _tiny_lm(), torch.randint(0, 50, (12, 9), dtype=torch.int32)
    grads = []
    for micro in (12, 4, 5):
        model.zero_grad()
        loss = target.accumulate(model, rows, micro, False)
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    (loss0, g0), *others = grads
    for loss, g in others:
        assert torch.allclose(loss, loss0, atol=1e-6) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, g0, strict=True))
    assert loss0 > 0 and any(g.abs().sum() > 0 for g in g0)


def test_the_target_halves_its_micro_batch_when_out_of_memory_and_trains_as_if_it_had_started_there(monkeypatch):
    """By default the target's step runs the whole batch at once (its PyTorch Gated DeltaNet is launch-bound: on an
    H200, 4 micro-batches of 16 rows took twice the time of 64 at once, and the time budget then bought half the
    steps) and halves it each time the GPU runs out of memory (or cuBLAS cannot allocate) — also after a micro-batch's gradient was accumulated:
    the step is redone from nothing, so the weights equal those of a run given the micro-batch that fit; a
    micro-batch given explicitly is not shrunk."""

    import torch

    real, seen = target._loss, []

    def fits_4(model, rows, autocast):  # 16 rows fail at once; 8 fit once, then the step's second 8 fail
        if torch.is_grad_enabled():
            seen.append(len(rows))
            if len(rows) == 16:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            if len(rows) == 8 and seen.count(8) == 2:
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real(model, rows, autocast)

    rows, held = torch.randint(0, 50, (64, 9)), torch.randint(0, 50, (8, 9))

    def train(micro: int):
        torch.manual_seed(0)
        model, said = _tiny_lm(), []
        rec = target.train_target(model, rows, held, budget_s=60, max_steps=3, batch=16, lr=1e-2, seed=0,
                                  log=said.append, micro_batch=micro)
        return rec, model.state_dict(), said

    monkeypatch.setattr(target, "_loss", fits_4)
    rec, weights, said = train(0)
    assert rec["micro_batch_rows"] == 4 and rec["steps"] == 3 and seen[:4] == [16, 8, 8, 4]
    assert [x for x in said if "out of GPU memory" in x] == [
        "  out of GPU memory with 16 rows a forward/backward: 8 from now on",
        "  out of GPU memory with 8 rows a forward/backward: 4 from now on"]
    with pytest.raises(torch.OutOfMemoryError):
        train(16)
    monkeypatch.setattr(target, "_loss", lambda *a: (_ for _ in ()).throw(RuntimeError("an illegal memory access")))
    with pytest.raises(RuntimeError, match="illegal memory access"):  # (not a shortage of memory: not retried)
        train(0)
    monkeypatch.setattr(target, "_loss", real)
    rec4, weights4, _ = train(4)
    assert rec4["micro_batch_rows"] == 4
    assert all(torch.equal(weights[k], weights4[k]) for k in weights4)


def test_redoing_regen_or_the_target_forgets_the_target_alone_decodes_its_prompts_had(tmp_path):
    """baseline-<tokens>.json holds the target's decodes of the prompts regen chose: --from_phase=regen or =target
    removes it with them (else a later drafter would take it for the untrained evaluation's, start without it and
    decode the target alone itself); --from_phase=train keeps it."""
    from testbed.runs import forget_from

    p = Paths(str(tmp_path))
    for phase, kept in (("train", True), ("regen", False), ("target", False)):
        p.root.mkdir(parents=True, exist_ok=True)
        for t in (64, 12):
            p.baseline(t).write_text("{}")
        forget_from(p, {"phases": {ph: {} for ph in runs.PHASES}}, phase)
        assert p.baseline(64).is_file() == kept and p.baseline(12).is_file() == kept, phase


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_eval_trains_the_next_drafter_while_one_is_evaluated_and_never_two_at_once(tmp_path, monkeypatch,
                                                                                          overlap):
    """--overlap_eval=1: a drafter's evaluation runs beside the next one's training (one training at a time still);
    off, the next training waits for the evaluation. Read from each run's recorded timeline."""
    import time

    _fake_stages(monkeypatch, {})
    fake_train, fake_eval = scheduler.train_export, scheduler.evaluate

    def train_export(*a, **k):
        time.sleep(0.4)
        return fake_train(*a, **k)

    def evaluate(cfg, p, run, dev, untrained, *a, **k):
        time.sleep(0.1 if untrained else 0.8)
        return fake_eval(cfg, p, run, dev, untrained, *a, **k)

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "evaluate", evaluate)
    cfg, p = config.TestbedConfig(dir=str(tmp_path), overlap_eval=overlap), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b"])
    scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    when = [json.loads((j.run / runs.SECONDS_FILE).read_text()) for j in jobs]
    trains = sorted((w["train_start"], w["train_end"]) for w in when)
    assert all(end <= start for (_, end), (start, _) in zip(trains, trains[1:], strict=False)), trains  # one training at a time
    for before, after in zip(when, when[1:], strict=False):
        assert (after["train_start"] < before["eval_end"]) is overlap, (before, after)
    assert all((j.run / "eval.json").is_file() for j in jobs)
    assert [w["repeat"] for w in when] == [False, True, True]  # (same settings and cache: its graphs were loaded)


@pytest.mark.parametrize("queue", [1, 2])
def test_eval_queue_lets_a_training_start_beside_that_many_pending_evaluations(tmp_path, monkeypatch, queue):
    """--eval_queue=2: an arm's first's evaluation (slower than a repeat's training) no longer holds back the training
    after its repeat's — the repeat's evaluation waits behind it instead; 1: the next training waits for it. Still
    one training at a time and at most `queue` evaluations pending when one starts (the timelines recorded)."""
    _timed_stages(monkeypatch, 0.3, 1.0)
    cfg, p = config.TestbedConfig(dir=str(tmp_path), eval_queue=queue), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c"])
    scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    when = [json.loads((j.run / runs.SECONDS_FILE).read_text()) for j in jobs]
    trains = sorted((w["train_start"], w["train_end"]) for w in when)
    assert all(end <= start for (_, end), (start, _) in zip(trains, trains[1:], strict=False)), trains
    for i, w in enumerate(when):
        pending = sum(v["train_end"] <= w["train_start"] < v["eval_end"] for v in when[:i])
        assert pending <= queue, (i, pending)
    # the third training (b) starts before the first drafter's evaluation has ended only with a queue of 2
    assert (when[2]["train_start"] < when[0]["eval_end"]) is (queue == 2)


@pytest.mark.parametrize("overlap,queue", [(False, 1), (True, 1), (True, 2)])
def test_overlapped_evaluations_end_within_stop_after_s(tmp_path, monkeypatch, overlap, queue):
    """Evaluations slower than trainings (the known-bad arm's: 6 s of training, 33 s of evaluation) must not queue
    past --stop_after_s: a training waits while an evaluation is still pending beside it, and a drafter about to be
    deferred waits for the pending evaluations to know what they take, then starts if it fits."""
    import time

    _timed_stages(monkeypatch, 0.2, 0.8)
    monkeypatch.setattr(scheduler, "FIRST_DRAFTER_S", 1.2)
    monkeypatch.setattr(scheduler, "EVAL_GUESS_S", 0.8)
    monkeypatch.setattr(scheduler, "STARTED", time.monotonic())
    cfg = config.TestbedConfig(dir=str(tmp_path), overlap_eval=overlap, eval_queue=queue, stop_after_s=4.0)
    p = Paths(str(tmp_path))
    jobs = _jobs(p, ["base"] + [f"r{i}" for i in range(8)])
    times = scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    done = [j for j in jobs if (j.run / "eval.json").is_file()]
    assert time.monotonic() - scheduler.STARTED < 4.5 and len(done) >= 2, len(done)
    assert all("deferred" in times[j.run] for j in jobs if j not in done)


def test_an_interrupted_sweep_does_not_wait_for_evaluations_not_started(tmp_path, monkeypatch):
    """Ctrl-C during an overlapped sweep: run_drafters raises it once the training in flight ends, without training
    or evaluating anything further (the queued drafters and evaluations are dropped, not run one by one)."""
    import signal
    import threading
    import time

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as from a shell: an xdist worker ignores it)

    calls = _fake_stages(monkeypatch, {})
    fake_train, fake_eval = scheduler.train_export, scheduler.evaluate
    evaluated = []

    def train_export(cfg, run, *a, **k):
        if run.parent.name == "c":  # (Ctrl-C while c trains: the main thread, waiting on the jobs, is interrupted)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.3)
        return fake_train(cfg, run, *a, **k)

    def evaluate(cfg, p, run, dev, untrained, *a, **k):
        time.sleep(0.5)
        evaluated.append(run.parent.name)
        return fake_eval(cfg, p, run, dev, untrained, *a, **k)

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "evaluate", evaluate)
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c", "d"])
    try:
        with pytest.raises(KeyboardInterrupt):
            scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    finally:
        signal.signal(signal.SIGINT, before)
    assert "d/seed0" not in calls and not {"c", "d"} & set(evaluated)
    assert not (p.run("b", 0) / "eval.json").is_file() or evaluated.count("b") == 1


@pytest.mark.parametrize("queue", [1, 2])
def test_a_drafter_waiting_for_an_evaluation_when_interrupted_does_not_start(tmp_path, monkeypatch, queue):
    """Ctrl-C while the next drafter waits for the evaluations beside it (slower than the trainings): it does not
    start training once they end — nothing trains after the interrupt."""
    import signal
    import threading
    import time

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as from a shell: an xdist worker ignores it)
    started = _timed_stages(monkeypatch, 0.1, 1.0)
    cfg, p = config.TestbedConfig(dir=str(tmp_path), eval_queue=queue), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c", "d"])
    interrupted = []

    def ctrl_c():  # (once the trainings allowed beside the pending evaluations have started, and the next waits)
        while len(started) < 1 + queue:
            time.sleep(0.01)
        time.sleep(0.3)
        interrupted.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            scheduler.run_drafters(cfg, p, "cpu", jobs, 1, jobs[0].run)
    finally:
        signal.signal(signal.SIGINT, before)
    assert interrupted and [name for t, name in started if t > interrupted[0]] == [], started
    assert len(started) == 1 + queue, started


def test_a_rerun_that_finds_the_testbeds_drafter_evaluated_records_its_seconds_not_0(tmp_path, monkeypatch):
    """A call killed after the testbed's own drafter was evaluated but before its phases were recorded: the rerun
    reuses the drafter and records the seconds its run kept (RUN/testbed-seconds.json), not 0."""
    from testbed import phases

    calls = _fake_stages(monkeypatch, {})
    monkeypatch.setattr(phases, "result", lambda cfg, p, st: st)
    monkeypatch.setattr(phases, "run_metrics", lambda run: {"step": 6})
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    runs.write_state(p, {"phases": {name: {"seconds": 1.0} for name in ("target", "regen", "extract")}})
    first = Job("a", p.run("a", 0), p.hidden(), 0, {"gamma": 5.0})
    phases.testbed(cfg, p, "cpu", None, [first])
    kept = json.loads((first.run / runs.SECONDS_FILE).read_text())
    (first.run / runs.SECONDS_FILE).write_text(json.dumps({**kept, "train": 12.5, "eval_wall": 3.25}))
    st = runs.read_state(p)
    for name in ("train", "export", "eval"):
        st["phases"].pop(name)
    runs.write_state(p, st)
    phases.testbed(cfg, p, "cpu", None, [first])
    ph = runs.read_state(p)["phases"]
    assert calls == ["a/seed0"] and ph["train"]["seconds"] == 12.5 and ph["eval"]["seconds"] == 3.25


def test_trainings_spread_over_the_gpus_one_at_a_time_on_each(tmp_path, monkeypatch):
    """--gpus: each training takes a free GPU (its worker started with CUDA_VISIBLE_DEVICES naming it alone, within
    the testbed's own CUDA_VISIBLE_DEVICES), two GPUs train at once, and no GPU ever trains two."""
    import time

    _fake_stages(monkeypatch, {})
    fake, seen = scheduler.train_export, []

    def train_export(cfg, run, cache, seed, settings, env, log_dir):
        t0 = time.time()
        time.sleep(0.4)
        seen.append((env.get("CUDA_VISIBLE_DEVICES"), t0, time.time()))
        return fake(cfg, run, cache, seed, settings, env, log_dir)

    monkeypatch.setattr(scheduler, "train_export", train_export)
    monkeypatch.setattr(scheduler, "gpu_ids", lambda cfg, dev: ["5", "7"])  # (CUDA_VISIBLE_DEVICES=5,7 here)
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c", "d"])
    scheduler.run_drafters(cfg, p, "cpu", jobs, 2, jobs[0].run)
    assert all((j.run / "eval.json").is_file() for j in jobs) and {g for g, _, _ in seen} == {"5", "7"}
    for g in ("5", "7"):
        mine = sorted((a, b) for x, a, b in seen if x == g)
        assert all(end <= start for (_, end), (start, _) in zip(mine, mine[1:], strict=False)), mine
    assert any(a < d and c < b for (x, a, b) in seen for (y, c, d) in seen if x != y)  # (both GPUs at once)
    assert [json.loads((j.run / runs.SECONDS_FILE).read_text())["gpu"] for j in jobs[:1]] == ["5"]


def test_more_gpus_than_the_machine_shows_are_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert scheduler.gpu_ids(config.TestbedConfig(), "cuda") == ["3", "1"]
    assert scheduler.gpu_ids(config.TestbedConfig(gpus=1), "cuda") == ["3"]
    assert scheduler.gpu_ids(config.TestbedConfig(gpus=2), "cpu") == []
    with pytest.raises(ConfigError, match=r"testbed.gpus=3: this machine shows 2 GPU\(s\)"):
        scheduler.gpu_ids(config.TestbedConfig(gpus=3), "cuda")


def test_failed_trainings_give_their_gpu_back(tmp_path, monkeypatch):
    """Two trainings failing on two GPUs: each GPU goes back to the others (a lost one would hang the sweep)."""
    import threading

    _fake_stages(monkeypatch, {"a": ["bad"], "b": ["bad"]})
    monkeypatch.setattr(scheduler, "gpu_ids", lambda cfg, dev: ["0", "1"])
    cfg, p = config.TestbedConfig(dir=str(tmp_path)), Paths(str(tmp_path))
    jobs = _jobs(p, ["base", "a", "b", "c"])
    th = threading.Thread(target=scheduler.run_drafters, args=(cfg, p, "cpu", jobs, 2, jobs[0].run), daemon=True)
    th.start()
    th.join(30)
    assert not th.is_alive(), "the sweep hangs: a failed training kept its GPU"
    assert (p.run("c", 0) / "eval.json").is_file()


def test_a_results_file_names_all_the_code_it_was_made_with_whatever_commit_it_is_told(tmp_path, monkeypatch):
    """`provenance` (what a results file records): besides the drafter's code digest, the digest of all the code a
    testbed run executes — so a file whose commit was only said (`DFLASH_COMMIT`) can be checked against that commit's
    tree. An edit to the testbed's own code or a stage changes it and leaves the drafter's; the library's changes
    both; a file the run does not execute changes neither."""
    from testbed import report

    tree = _pkg(tmp_path, {"dflash_offline/drafter.py": "a = 1\n", "stages/train.py": "b = 1\n",
                           "stages/regen.py": "c = 1\n", "testbed/phases.py": "d = 1\n", "fixtures/tiny.py": "e = 1\n",
                           "manifests/testbed.toml": "[train]\n", "README.md": "hello\n"})

    def digests():
        return runs.code_digest(runs.DRAFTER_CODE, tree), runs.code_digest(runs.TESTBED_CODE, tree)

    before = digests()
    assert before[0] != before[1]
    for name, changes in (("testbed/phases.py", (False, True)), ("stages/regen.py", (False, True)),
                          ("fixtures/tiny.py", (False, True)),
                          ("manifests/testbed.toml", (False, True)), ("README.md", (False, False)),
                          ("stages/train.py", (True, True)), ("dflash_offline/drafter.py", (True, True))):
        f = tree / name
        f.write_text(f.read_text() + "# edited\n")
        after = digests()
        assert (after[0] != before[0], after[1] != before[1]) == changes, name
        before = after
    monkeypatch.setenv("DFLASH_COMMIT", "0" * 40)
    got = report.provenance()
    assert got["commit"] == "0" * 40 and got["testbed_code_sha256"] == runs.code_digest(runs.TESTBED_CODE)
    assert got["code_sha256"] == runs.drafter_code_digest() != got["testbed_code_sha256"]
