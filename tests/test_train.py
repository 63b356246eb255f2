"""Stage 2 on CPU: exact resume, 2 processes = 1 process with accumulation, refusals, golden losses."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from equivalence import (
    BF16_ULP,
    adamw_rtol,
    check,
    drafter_start,
    rel_diffs,
    scalar_rtol,
    step_terms,
    update_distance,
)
from safetensors.torch import load_file
from serving import free_port

from dflash_offline import metrics
from dflash_offline.cache.manifest import update_manifest
from dflash_offline.config import ConfigError
from dflash_offline.trainer import Trainer
from dflash_offline.trainsetup import (
    BenchSwitches,
    TrainConfig,
    cache_defaults,
    drafter_config,
    resolve_train,
)
from stages import train

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "train_tiny.json"
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
            trackers="none", lr=3e-3, warmup_steps=1)
# the terms of a step's longest float32 sums (tests/equivalence.py): 2 rows × (128 tokens + 8 anchors × 16), and
# 4 micro-batches of 2 rows
N_TINY = step_terms(rows=TINY["batch_rows"], seq_len=128, anchors=TINY["num_anchors"], block=16)
N_FSDP = 4 * N_TINY


def cfg(cache, run, **kw):
    return TrainConfig.of(cache=str(cache), run=str(run), **{**TINY, "steps": 6, "ckpt_every": 3, **kw}).resolve()


def losses(run):
    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def final_weights(run, step):
    return load_file(str(Path(run) / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def grad_norms(run):
    return [json.loads(line)["grad_norm"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def data_state(run, step):
    return json.loads((Path(run) / "checkpoints" / f"step-{step:08d}" / "data.json").read_text())


def run_on_one_thread(cfg):
    """train.run here with the one thread `launch_two`'s workers have (OMP_NUM_THREADS=1): a kernel may split its
    sums by thread, so a bitwise comparison with them needs the same count, whatever OMP_NUM_THREADS the tests run
    with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.run(cfg)
    finally:
        torch.set_num_threads(threads)


def assert_same_training(one, other, start, steps, n, bf16=False, first=0):
    """Two runs of the same rows, blocks and `start` weights whose float32 sums ran in another order: each logged
    step's loss and gradient norm within `scalar_rtol(n)` of each other, the training's update (to the final step
    `steps`, over the steps after `first`) within `adamw_rtol(n, steps - first)` (tests/equivalence.py derives
    both). `bf16`: bf16 weights or operands, which round alike where their fp32 values do unless those lie on either
    side of a bf16 rounding boundary, and then differ by one bf16 step, ≤ 2⁻⁷ relative: the bound of the scalars,
    were every term a step off, and what it adds to the update distance (a relative change turns no sign)."""
    scalars = BF16_ULP if bf16 else scalar_rtol(n)
    check("losses", max(rel_diffs(losses(other), losses(one))), scalars)
    check("gradient norms", max(rel_diffs(grad_norms(other), grad_norms(one))), scalars)
    check("update distance", update_distance(start, final_weights(one, steps), final_weights(other, steps)),
          adamw_rtol(n, steps - first) + (BF16_ULP if bf16 else 0.0))


def test_resume_equals_uninterrupted(tmp_path, hidden_cache):
    train.run(cfg(hidden_cache, tmp_path / "a"))
    b = tmp_path / "b"
    train.run(cfg(hidden_cache, b))
    # interrupt b after step 3: its last checkpoint and metrics are those of step 3
    shutil.rmtree(b / "checkpoints" / "step-00000006")
    (b / "checkpoints" / "latest").write_text("step-00000003\n")
    (b / "metrics.jsonl").write_text("\n".join((b / "metrics.jsonl").read_text().splitlines()[:3]) + "\n")
    train.run(cfg(hidden_cache, b, resume=True))
    assert losses(b) == losses(tmp_path / "a")
    wa, wb = final_weights(tmp_path / "a", 6), final_weights(b, 6)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # and the run really learned something different from its start
    assert not torch.equal(wa["fc.weight"], load_file(str(b / "checkpoints/step-00000003/model.safetensors"))[
        "fc.weight"])


def test_a_resume_with_other_drafter_settings_is_refused(tmp_path, hidden_cache):
    """--resume=1 continues the drafter its checkpoint records: another selector_top_k, conv setting, attention
    inside the block or attention layout (no tensor shape changes with these but the conv's) or another shape is refused in one line naming the
    field(s) before any weights load; the same settings continue."""
    run, d2 = tmp_path / "r", dict(variant="dflash2", selector_rank=8, sliding_window=64)
    train.run(cfg(hidden_cache, run, steps=2, ckpt_every=2, **d2))
    sliding_full = "['sliding_attention', 'full_attention']"
    for change, was, now in (
            ({"selector_top_k": 4}, "selector_top_k=16", "selector_top_k=4"),
            ({"conv_group_size": 32}, "conv_group_size=16", "conv_group_size=32"),
            ({"block_attention": "bidirectional"}, "block_attention='causal'", "block_attention='bidirectional'"),
            ({"full_attention_layers": 0}, f"layer_types={sliding_full}", "layer_types=['sliding_attention', "
                                                                         "'sliding_attention']"),
            ({"num_layers": 3}, f"num_layers=2, layer_types={sliding_full}", "num_layers=3, layer_types=")):
        with pytest.raises(ValueError, match=rf"^{run} trained a drafter with {re.escape(was)} \(step-00000002\) and "
                                             rf"this run asks for {re.escape(now)}.*: resume with the settings, cache "
                                             rf"and target it started with \({re.escape(str(run / 'config.json'))} "
                                             rf"records them; make train RESUME=1 without RECIPE= takes its settings "
                                             rf"from there\) or start a new RUN=$"):
            train.run(cfg(hidden_cache, run, steps=3, resume=True, **{**d2, **change}))
    train.run(cfg(hidden_cache, run, steps=3, resume=True, **d2))
    assert len(losses(run)) == 3


@pytest.mark.parametrize("recorded", ["tensorwise", "rowwise"])
def test_a_run_recorded_with_the_removed_fp8_recipe_resumes_exports_and_reads(tmp_path, hidden_cache, recorded,
                                                                                capsys):
    """A run whose config.json and checkpoints record `fp8_recipe` (the removed choice of float8 scaling: the train
    settings, and the derived block of an fp8 run) is read as any other: the recipe decided how the linears' GEMMs
    were computed, never a tensor of the checkpoint, so nothing that reads a run looks at it. Either value is
    accepted: a `rowwise` run resumes in tensorwise, as a run resumed with another precision continues in that one;
    only a user who sets it (`--fp8_recipe`, a recipe) is refused (tests/test_config_faults.py)."""
    from dflash_offline.evaluation import run_info
    from dflash_offline.export import export

    run = tmp_path / "run"
    train.run(cfg(hidden_cache, run, steps=3))
    record = json.loads((run / "config.json").read_text())
    record["train"]["fp8_recipe"] = record["derived"]["fp8_recipe"] = recorded
    (run / "config.json").write_text(json.dumps(record))
    meta_file = run / "checkpoints" / "step-00000003" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["train"]["fp8_recipe"] = recorded  # (meta.json's own bytes are in no digest)
    meta_file.write_text(json.dumps(meta))
    assert run_info(run)["train"]["fp8_recipe"] == recorded  # evaluation reads the run
    exported = export(run, tmp_path / "export")
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    capsys.readouterr()
    train.run(cfg(hidden_cache, run, steps=6, resume=True))
    assert f"resumed {run} at step 3 (step-00000003)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4,
                                                                                                       5, 6]
    rewritten = json.loads((run / "config.json").read_text())
    assert "fp8_recipe" not in rewritten["train"] and "fp8_recipe" not in rewritten["derived"]


def test_a_mask_token_that_is_no_embedding_row_or_an_end_token_is_refused_before_weights_load(tmp_path, hidden_cache,
                                                                                              monkeypatch):
    """train.mask_token_id (a recipe's, set by hand) gets extraction's check: an id past the vocabulary (another
    family's recipe) or the target's eos/pad would train, then crash in the embedding or ship an end token as the
    mask; both are refused naming the field, before the target's tables load."""
    from dflash_offline import drafter

    monkeypatch.setattr(drafter, "load_target_embeddings", lambda *a: pytest.fail("the target's tables loaded"))
    for mask, why in ((248070, r"\[0, 2048\)"), (1988, r"not pad/eos \(\[1986, 1988\]\)")):
        with pytest.raises(ValueError, match=rf"train.mask_token_id={mask} must be a real embedding row in .*{why}"):
            train.run(cfg(hidden_cache, tmp_path / str(mask), mask_token_id=mask))
        assert not (tmp_path / str(mask)).exists()


def test_a_recipes_taps_are_not_silently_replaced_by_the_caches(tmp_path, hidden_cache):
    """`make train RECIPE=` on a cache extracted with other taps than the recipe's [extract] layer_ids would train and
    export a drafter on the cache's taps: refused before anything is made, naming both; the recipe's taps, or
    train.layer_ids given, pass the check."""
    from stages import train as train_stage

    taps = json.loads((hidden_cache / "manifest.json").read_text())["config"]["layer_ids"]
    run = tmp_path / "r"
    args = [f"--cache={hidden_cache}", f"--run={run}", *(f"--{k}={v}" for k, v in TINY.items()), "--steps=1"]
    for want, ok in ((taps, True), ([0, 2, 4], False)):
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(f"[extract]\nlayer_ids = {want}\n")
        if ok:
            assert train_stage.main([f"--recipe={recipe}", *args]) == 0
        else:
            args[1] = f"--run={tmp_path / 'r2'}"
            with pytest.raises(ValueError, match=rf"holds taps {re.escape(str(taps))}, not the layer_ids \[0, 2, 4\] "
                                                 rf"of {recipe}'s \[extract\]"):
                train_stage.main([f"--recipe={recipe}", *args])
            assert not (tmp_path / "r2").exists()
    subset = ",".join(map(str, taps[:2]))
    assert train_stage.main([f"--recipe={recipe}", *args, f"--run={tmp_path / 'sub'}", f"--layer_ids={subset}"]) == 0


def test_a_resume_with_other_settings_keeps_the_earlier_config_and_says_what_changed(tmp_path, hidden_cache, capsys):
    """RUN/config.json is the resumed run's; the settings the steps before were trained with are kept beside it
    (config.until-<step>.json) and the differences logged — they were overwritten, unsaid. A resume that only runs
    longer keeps no copy."""
    run = tmp_path / "r"
    train.run(cfg(hidden_cache, run, steps=3))
    train.run(cfg(hidden_cache, run, steps=6, resume=True))
    assert not list(run.glob("config.until-*"))
    capsys.readouterr()
    train.run(cfg(hidden_cache, run, steps=9, resume=True, lr=1e-2, gamma=5.0))
    said = capsys.readouterr().out
    assert re.search(r"resumed with other settings than .*config.json: gamma .* → 5.0, lr 0.003 → 0.01; the earlier "
                     r"config is kept as config.until-00000006.json", said), said
    kept = json.loads((run / "config.until-00000006.json").read_text())["train"]
    assert kept["lr"] == 3e-3 and json.loads((run / "config.json").read_text())["train"]["lr"] == 1e-2
    shutil.rmtree(run / "checkpoints" / "step-00000009")  # a crash before the next checkpoint: resumed at 6 again
    train.run(cfg(hidden_cache, run, steps=9, resume=True, lr=5e-2))
    assert json.loads((run / "config.until-00000006.json").read_text())["train"]["lr"] == 3e-3  # still the truth


def test_a_resume_given_no_recipe_continues_with_the_runs_own_settings(tmp_path, hidden_cache, capsys, monkeypatch):
    """`make train RUN= RESUME=1` without RECIPE= (the Makefile then passes none) resumes with the settings
    RUN/config.json records (RUN= spelt with `~` too) and the cache as the run named it (relative here) — not the
    defaults: nothing changed, no earlier config kept — the command line's settings over theirs; a cache gone, or a
    recorded setting refused now, is said in one line naming where the settings came from."""
    import os

    from dflash_offline.config import ConfigError
    from stages import train as train_stage

    monkeypatch.chdir(tmp_path)
    cache, run = os.path.relpath(hidden_cache, tmp_path), Path("r")
    given = {**TINY, "gamma": 5.0, "seed": 3}
    assert train_stage.main([f"--cache={cache}", f"--run={run}", *(f"--{k}={v}" for k, v in given.items()),
                             "--steps=3"]) == 0
    before = json.loads((run / "config.json").read_text())["train"]
    capsys.readouterr()
    assert train_stage.main([f"--run={run}", "--resume=on", "--recipe=", "--steps=5"]) == 0
    said = capsys.readouterr().out
    assert f"resuming with the settings {run / 'config.json'} records (no --recipe given); from the command line: " \
           "steps\n" in said, said
    after = json.loads((run / "config.json").read_text())["train"]
    assert not list(run.glob("config.until-*")) and "resumed with other settings" not in said, said
    assert {k: v for k, v in after.items() if k not in ("steps", "resume")} == \
           {k: v for k, v in before.items() if k not in ("steps", "resume")}
    assert after["cache"] == cache and after["steps"] == 5 and (run / "checkpoints" / "step-00000005").is_dir()
    assert train_stage.main([f"--run={run}", "--resume=1", "--steps=6", "--lr=1e-2"]) == 0  # the command line wins
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 1e-2
    assert json.loads((run / "config.until-00000005.json").read_text())["train"]["gamma"] == 5.0
    monkeypatch.setenv("HOME", str(tmp_path))  # `--run=~/r` (the shell leaves `~` after `=`) is the same run
    assert train_stage.main(["--run=~/r", "--resume=1", "--steps=7"]) == 0
    assert (run / "checkpoints" / "step-00000007").is_dir()
    assert not (run / "config.until-00000006.json").exists()  # (the same settings: nothing kept, no change logged)

    rec = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**rec, "train": {**rec["train"], "cache": "gone"}, "cache_dir": "/gone"}))
    with pytest.raises(ConfigError, match=r"the cache r/config.json records \(gone, /gone\) is not there: pass the "
                                          r"run's cache with --cache="):
        train_stage.main([f"--run={run}", "--resume=1", "--steps=7"])
    (run / "config.json").write_text(json.dumps({**rec, "train": {**rec["train"], "weighting": "bogus"}}))
    with pytest.raises(ConfigError, match=r"bogus.*\(resuming with the settings r/config.json records \(no --recipe "
                                          r"given\); from the command line: steps: give that setting"):
        train_stage.main([f"--run={run}", "--resume=1", "--steps=7"])


def test_a_resume_given_no_recipe_from_another_directory_finds_the_target_named_relative(tmp_path, hidden_cache,
                                                                                          qwen35_dir, monkeypatch):
    """A run begun in one directory with a relative --target (TARGET=) resumes from another, given no recipe: the
    target is the absolute path RUN/config.json records beside the one as named, which is not there from here."""
    from stages import train as train_stage

    shutil.copytree(qwen35_dir, tmp_path / "a" / "t")  # (the cache's target, named "t" from a/)
    monkeypatch.chdir(tmp_path / "a")
    target = "t"
    assert train_stage.main([f"--cache={hidden_cache}", "--run=r", f"--target={target}", "--steps=2",
                             *(f"--{k}={v}" for k, v in TINY.items())]) == 0
    monkeypatch.chdir(tmp_path)
    assert not Path(target).exists()
    assert train_stage.main(["--run=a/r", "--resume=1", "--steps=3"]) == 0
    run = tmp_path / "a" / "r"
    assert (run / "checkpoints" / "step-00000003").is_dir() and not list(run.glob("config.until-*"))
    rec = json.loads((run / "config.json").read_text())
    assert rec["train"]["target"] == rec["target"] == str(tmp_path / "a" / "t")
    # a run whose config.json recorded no absolute target (made before it did): the target as named, no traceback
    (run / "config.json").write_text(json.dumps({k: v for k, v in rec.items() if k != "target"}))
    from dflash_offline.trainrun import recorded_settings

    values = {}
    recorded_settings(["--run=a/r", "--resume=1"])[0]("train", values, {})
    assert values["target"] == str(tmp_path / "a" / "t")
    (run / "config.json").write_text(json.dumps({**{k: v for k, v in rec.items() if k != "target"},
                                                 "train": {**rec["train"], "target": "Qwen/Qwen3-8B"}}))
    values = {}
    recorded_settings(["--run=a/r", "--resume=1"])[0]("train", values, {})
    assert values["target"] == "Qwen/Qwen3-8B"


def test_existing_run_needs_resume(tmp_path, hidden_cache):
    train.run(cfg(hidden_cache, tmp_path / "r", steps=3))
    with pytest.raises(ValueError, match=r"resume=1 \(make RESUME=1\) to continue it, or choose another --run "
                                         r"\(make RUN=\)"):
        train.run(cfg(hidden_cache, tmp_path / "r", steps=3))


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_a_run_whose_checkpoints_would_not_fit_is_refused_before_weights_load(tmp_path, hidden_cache, monkeypatch,
                                                                               variant):
    """The size start-up counts for a checkpoint is what one weighs (its weights and AdamW's moments, within their
    files' headers); a run whose newest keep_last + 1 checkpoints would not fit where RUN= is, less those a resume
    finds there, is refused before the target's tables load, naming the sizes; with room, it goes on."""
    from dflash_offline import checkpoint, drafter, trainsetup
    from dflash_offline.cache import fsio

    run = tmp_path / "r"
    train.run(cfg(hidden_cache, run, steps=3, variant=variant))
    d = run / "checkpoints" / "step-00000003"
    weighed = sum((d / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors"))
    c = cfg(hidden_cache, tmp_path / "x", variant=variant)
    counted = trainsetup.checkpoint_bytes(trainsetup.drafter_config(c, trainsetup.cache_defaults(c)))
    assert counted <= weighed <= counted + 64 * 1024
    monkeypatch.setattr(drafter, "load_target_embeddings", lambda *a: pytest.fail("the target's tables loaded"))
    room = trainsetup.CHECKPOINT_ROOM_GB * 1e9
    long = dict(steps=30, keep_last=3, variant=variant)  # 10 saves: 4 checkpoints on disk at the peak
    monkeypatch.setattr(fsio, "free_space", lambda p: room + 3.5 * counted)
    with pytest.raises(ValueError, match=r"/new: its checkpoints need .* each; keep_last=3 kept plus the one being "
                                         r"written\) but the filesystem has .* free.*keep_last=2 fits\)$"):
        train.run(cfg(hidden_cache, tmp_path / "new", **long))
    with pytest.raises(pytest.fail.Exception, match="tables loaded"):  # (what it offered does fit)
        train.run(cfg(hidden_cache, tmp_path / "new", **{**long, "keep_last": 2}))
    monkeypatch.setattr(fsio, "free_space", lambda p: room + 0.5 * counted)  # not one fits: fewer is not offered
    with pytest.raises(ValueError, match=r"free space or put RUN= elsewhere$"):
        train.run(cfg(hidden_cache, tmp_path / "new", **long))
    with monkeypatch.context() as m:  # a resume with 3 there: still none fits (one more is needed at a save)
        m.setattr(checkpoint, "list_checkpoints", lambda d: [None] * 3)
        with pytest.raises(ValueError, match=r"3 there already\) .*free space or put RUN= elsewhere$"):
            train.run(cfg(hidden_cache, run, resume=True, **long))
    monkeypatch.setattr(fsio, "free_space", lambda p: room + 3.5 * counted)
    assert not (tmp_path / "new" / "checkpoints").exists()
    with pytest.raises(pytest.fail.Exception, match="tables loaded"):  # a resume: 1 there, 3 more fit
        train.run(cfg(hidden_cache, run, resume=True, **long))
    monkeypatch.setattr(fsio, "free_space", lambda p: room + 2.5 * counted)
    with pytest.raises(ValueError, match=r"1 there already\) but the filesystem has"):
        train.run(cfg(hidden_cache, run, resume=True, **long))
    with pytest.raises(pytest.fail.Exception, match="tables loaded"):  # steps 3 and 6 save, the end no third time
        train.run(cfg(hidden_cache, tmp_path / "two", steps=6, keep_last=0, variant=variant))
    # epochs: the run's steps come from the cache's rows; keep_last=0 keeps every checkpoint the run saves
    from dflash_offline.dataset import open_hidden_cache

    per_epoch = open_hidden_cache(hidden_cache, trainsetup.cache_defaults(c)["layer_ids"]).num_rows // 2
    three = dict(epochs=2.5 / per_epoch, keep_last=0, variant=variant)  # 3 steps (rounded up)
    with pytest.raises(ValueError, match=r"keep_last=0: all kept\) but the filesystem has"):  # 3 saves, room for 2
        train.run(cfg(hidden_cache, tmp_path / "ep", ckpt_every=1, **three))
    with pytest.raises(pytest.fail.Exception, match="tables loaded"):  # steps 2 and 3 save
        train.run(cfg(hidden_cache, tmp_path / "ep", ckpt_every=2, **three))


def test_adamw_betas_are_a_setting(tmp_path, hidden_cache):
    """`--betas` reaches AdamW and its checkpoint. The default stays (0.9, 0.95); the reference recipe (SpecForge)
    runs torch's (0.9, 0.999) — docs/full-run.md#differences-from-the-reference-recipe-specforge."""
    assert TrainConfig.of(cache="x").optim.betas == [0.9, 0.95]
    train.run(cfg(hidden_cache, tmp_path / "r", steps=1, betas=[0.9, 0.999]))
    opt = json.loads((tmp_path / "r" / "checkpoints" / "step-00000001" / "optimizer.json").read_text())
    assert [g["betas"] for g in opt["param_groups"]] == [[0.9, 0.999]]


def test_a_run_ends_with_one_summary_line(tmp_path, hidden_cache, capsys):
    """The last line says what the run did: steps, tokens, time, steady tok/s, final loss and τ, recompiles, peak
    memory, and where its checkpoint is; a resumed run counts its own steps."""
    run = tmp_path / "r"
    train.run(cfg(hidden_cache, run, steps=4, ckpt_every=2, log_every=1))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert f"train done: 4 steps (0 → 4), {4 * 2 * 128:,} tokens in " in last
    assert " tok/s over 3 steady steps; " in last  # the first window (compilation, warm-up) left out
    assert f"loss {recs[-1]['loss']:.4f}, sim τ {recs[-1]['sim_tau']:.2f}, recompiles 0; peak " in last
    assert last.endswith(f"; checkpoint {run / 'checkpoints' / 'step-00000004'}")
    train.run(cfg(hidden_cache, run, steps=6, ckpt_every=2, log_every=1, resume=True))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "train done: 2 steps (4 → 6), " in last and last.endswith("step-00000006")


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_the_flop_fraction_counts_every_matmul_a_training_step_runs(tmp_path, hidden_cache, monkeypatch, variant):
    """`metrics.flops_per_row`, which a run's `flop_frac` divides by, against torch's FLOP counter around the
    trainer's micro-batch (the drafter's forward and backward, the lm_head CE and, DFlash2, the selector CE): equal
    but for two terms the counter does not see — attention (CPU SDPA is not counted; the formula's is an estimate)
    and DFlash2's depthwise convolutions (elementwise ops; counted as the counter counts a depthwise conv1d)."""
    from torch.utils.flop_counter import FlopCounterMode

    seen, counters, per_row, micro_batch = {}, [], metrics.flops_per_row, Trainer.micro_batch

    def recorded(dc, seq_len, num_anchors):
        seen.update(dc=dc, seq_len=seq_len, anchors=num_anchors)
        return per_row(dc, seq_len, num_anchors)

    def counted(self, *args, **kw):
        with FlopCounterMode(display=False) as counter:
            out = micro_batch(self, *args, **kw)
        counters.append(counter)
        return out

    monkeypatch.setattr(metrics, "flops_per_row", recorded)
    monkeypatch.setattr(Trainer, "micro_batch", counted)
    d2 = dict(variant="dflash2", selector_rank=8) if variant == "dflash2" else {}
    train.run(cfg(hidden_cache, tmp_path / "r", steps=1, ckpt_every=1, **d2))
    (counter,) = counters  # one step of one micro-batch
    assert {str(op) for op in counter.get_flop_counts()["Global"]} <= {"aten.mm", "aten.bmm"}  # no attention op
    dc, terms = seen["dc"], metrics.flop_terms(seen["dc"], seen["seq_len"], seen["anchors"])
    unseen = terms["attention"] + terms.get("conv", 0)
    assert counter.get_total_flops() / TINY["batch_rows"] == sum(terms.values()) - unseen
    if d2:  # each of 2 × layers sublayers between two convolutions of J taps over the row's A·L block tokens,
        # backward twice the forward (the counter's formula for a grouped conv's backward counts it as dense)
        J, Q = dc.conv_kernel_size, seen["anchors"] * dc.block_size
        with FlopCounterMode(display=False) as conv:
            torch.nn.functional.conv1d(torch.randn(1, dc.hidden_size, Q + J - 1), torch.randn(dc.hidden_size, 1, J),
                                       groups=dc.hidden_size)
        assert terms["conv"] == 2 * 2 * dc.num_layers * 3 * conv.get_total_flops()


WORKER = """
import sys
from stages import train
train.main(sys.argv[1:])
"""


def cli_args(cache, run, **kw):
    args = {**TINY, "steps": 4, "ckpt_every": 4, **kw}
    return [f"--cache={cache}", f"--run={run}"] + [f"--{k}={v}" for k, v in args.items()]


def launch_two(cache, run, worker=WORKER, **kw):
    """Train with 2 processes (as torchrun would start them: gloo on the CPU, NCCL with one GPU each where there
    are 2 GPUs); returns when both are done, with their (stdout, stderr)."""
    port = str(free_port())
    procs = []
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DFLASH_NO_BAR="1", PYTHONPATH=path,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", worker, *cli_args(cache, run, **kw)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    return outs


# every destruction of the process group reports how many DDP models are still alive at that moment
WORKER_WATCHING_TEARDOWN = """
import gc, json, sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from stages import train

destroy = dist.destroy_process_group

def watched(*args, **kwargs):
    gc.unfreeze()  # the trainer freezes what it built after warm-up: frozen objects are not in gc.get_objects()
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    print(json.dumps({"ddp_alive_at_destroy": alive}), flush=True)
    return destroy(*args, **kwargs)

dist.destroy_process_group = watched
train.main(sys.argv[1:])
"""


def test_two_processes_destroy_the_process_group_after_the_ddp_model(tmp_path, hidden_cache):
    """DDP's C++ reducer holds the process group: destroyed while the reducer lives (Accelerator.end_training in
    the run), the group's destructor later runs inside the reducer's, holding the GIL, and can hang the exit of a
    finished run. Each rank destroys the group once, with no DDP model left, and exits 0."""
    outs = launch_two(hidden_cache, tmp_path / "two", worker=WORKER_WATCHING_TEARDOWN)
    for out, _ in outs:
        seen = [json.loads(x) for x in out.splitlines() if x.startswith('{"ddp_alive_at_destroy"')]
        assert seen == [{"ddp_alive_at_destroy": 0}], out[-2000:]


def test_two_processes_equal_one_with_accumulation(tmp_path, hidden_cache):
    """2 processes × 1 micro-batch of 2 rows = 1 process accumulating the same 2 micro-batches, bit for bit: each
    micro-batch is the same 2-row computation either way, and DDP's mean of the two gradients ((a + b) / 2, the loss
    divided by half the step's weight) rounds as the accumulated a + b divided by the whole weight (a halving is
    exact), on one thread both (`run_on_one_thread`)."""
    tokens_per_step = 2 * 2 * 128  # 2 rows × 128 tokens, twice
    one = tmp_path / "one"
    run_on_one_thread(TrainConfig.of(cache=str(hidden_cache), run=str(one),
                                  **{**TINY, "steps": 4, "ckpt_every": 4, "global_batch_tokens": tokens_per_step}
                                  ).resolve())
    two = tmp_path / "two"
    launch_two(hidden_cache, two, global_batch_tokens=tokens_per_step)
    config = json.loads((two / "config.json").read_text())["derived"]
    assert config["world_size"] == 2 and config["grad_accum"] == 1
    assert json.loads((one / "config.json").read_text())["derived"]["grad_accum"] == 2
    assert losses(one) == losses(two) and grad_norms(one) == grad_norms(two)
    w1, w2 = final_weights(one, 4), final_weights(two, 4)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_a_resume_on_another_split_of_the_global_batch_continues_the_run(tmp_path, hidden_cache):
    """2 processes × 1 row train like 1 process × 2 rows (each row's anchors come from its place in the run, not
    from which rows share its micro-batch), and a run started on 2 × 1 and resumed on 1 × 2 continues the 1 × 2 run:
    at the same place in the data (exactly), and to the rounding of float32 sums in another order (a 2-row GEMM vs
    two 1-row GEMMs and an all-reduce) in its losses, gradient norms and update (`assert_same_training`; with n =
    2 rows × (128 + 8 × 16) = 512 terms: λ·n·u = 1.5e-4 and 2·√(4·n·u·4) = 0.044; measured on an AMD EPYC (Zen 5),
    torch 2.13: 1.3e-7, 8e-8 and 2.4e-7; with oneDNN off or other ATen/MKL kernels ≤ 1.3e-7, 1.3e-7 and 1.9e-6).
    A dropped or doubled micro-batch, anchors drawn for the wrong row and a resume that loses its data position,
    each planted in stages/train.py, fail it: update distance 0.76, 0.53, 0.52, 0.21; the first step's gradient
    norm 29 %, 27 %, 8 %, and 8 % at step 3; a whole step's gradient doubled (invisible in the weights: Adam, the
    clipping) doubles the gradient norm."""
    one = tmp_path / "one"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(one), **{**TINY, "steps": 4, "ckpt_every": 2}).resolve())
    split = tmp_path / "split"
    launch_two(hidden_cache, split, batch_rows=1, steps=4, ckpt_every=2)
    assert_same_training(one, split, drafter_start(cfg(hidden_cache, one)), 4, N_TINY)
    # interrupted after step 2, resumed on 1 process × 2 rows
    shutil.rmtree(split / "checkpoints" / "step-00000004")
    (split / "checkpoints" / "latest").write_text("step-00000002\n")
    (split / "metrics.jsonl").write_text("\n".join((split / "metrics.jsonl").read_text().splitlines()[:2]) + "\n")
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(split), resume=True,
                          **{**TINY, "steps": 4, "ckpt_every": 2}).resolve())
    assert data_state(split, 4) == data_state(one, 4)  # the same rows read, counted alike
    assert_same_training(one, split, drafter_start(cfg(hidden_cache, one)), 4, N_TINY)


@pytest.mark.parametrize("accum", [1, 2])
def test_bf16_master_weights_equal_fp32_weights_under_autocast(tmp_path, hidden_cache, accum):
    """precision=bf16 (CPU autocast here): bf16 model weights + MasterAdamW train like fp32 weights + AdamW + clip,
    with gradient accumulation too (fp32 accumulation buffers); checkpoints hold fp32 weights either way. The same
    bf16 GEMMs on the same values; the two optimizers' fp32 arithmetic in another order, and a bf16 weight that
    rounds the other way from there on: `assert_same_training` with bf16 rounding, n = accum × 512 terms (2⁻⁷ =
    7.8e-3, 2·√(4·n·u·4) + 2⁻⁷ = 0.052 / 0.070; measured on an AMD EPYC, torch 2.13: losses 1.2e-5 / 4e-6,
    gradient norms 6e-5 / 7e-5, update distance 1.3e-3 / 1.5e-4)."""
    kw = dict(precision="bf16", steps=4, ckpt_every=4, grad_clip=0.5, global_batch_tokens=accum * 2 * 128)
    train.run(cfg(hidden_cache, tmp_path / "off", master_weights="off", **kw))
    train.run(cfg(hidden_cache, tmp_path / "on", master_weights="on", **kw))
    derived = json.loads((tmp_path / "on" / "config.json").read_text())["derived"]
    assert derived["master_weights"] is True and derived["grad_accum"] == accum
    assert all(w.dtype == torch.float32 for w in final_weights(tmp_path / "on", 4).values())
    assert_same_training(tmp_path / "off", tmp_path / "on", drafter_start(cfg(hidden_cache, tmp_path / "on")), 4,
                         accum * N_TINY, bf16=True)
    recs = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["skipped_steps"] == 0 and recs[-1]["grad_norm"] > 0


def test_bf16_master_weights_resume_exactly(tmp_path, hidden_cache):
    kw = dict(precision="bf16", master_weights="on")
    train.run(cfg(hidden_cache, tmp_path / "a", **kw))
    b = tmp_path / "b"
    train.run(cfg(hidden_cache, b, **kw))
    shutil.rmtree(b / "checkpoints" / "step-00000006")  # interrupted after step 3
    (b / "checkpoints" / "latest").write_text("step-00000003\n")
    (b / "metrics.jsonl").write_text("\n".join((b / "metrics.jsonl").read_text().splitlines()[:3]) + "\n")
    train.run(cfg(hidden_cache, b, resume=True, **kw))
    assert losses(b) == losses(tmp_path / "a")
    wa, wb = final_weights(tmp_path / "a", 6), final_weights(b, 6)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_switching_master_weights_mode(tmp_path, hidden_cache):
    """Checkpoints are the same files in both modes: a run checkpointed with fp32 weights resumes with bf16 weights +
    MasterAdamW (and trains on like the uninterrupted fp32 run: from their common step-3 checkpoint, as in the test
    above, 2⁻⁷ and 2·√(4·n·u·3) + 2⁻⁷ = 0.046 with n = 512; measured 0, 5.6e-7 and 3.9e-7 on an AMD EPYC, torch 2.13)."""
    train.run(cfg(hidden_cache, tmp_path / "a", precision="bf16", master_weights="off"))
    b = tmp_path / "b"
    train.run(cfg(hidden_cache, b, precision="bf16", master_weights="off"))
    shutil.rmtree(b / "checkpoints" / "step-00000006")
    (b / "checkpoints" / "latest").write_text("step-00000003\n")
    (b / "metrics.jsonl").write_text("\n".join((b / "metrics.jsonl").read_text().splitlines()[:3]) + "\n")
    train.run(cfg(hidden_cache, b, precision="bf16", master_weights="on", resume=True))
    assert losses(b)[:3] == losses(tmp_path / "a")[:3] and grad_norms(b)[:3] == grad_norms(tmp_path / "a")[:3]
    assert all(w.dtype == torch.float32 for w in final_weights(b, 6).values())
    assert_same_training(tmp_path / "a", b, final_weights(b, 3), 6, N_TINY, bf16=True, first=3)


def test_master_weights_on_refuses_where_unavailable(tmp_path, hidden_cache):
    with pytest.raises(ValueError, match="precision is fp32"):
        train.run(cfg(hidden_cache, tmp_path / "x", precision="fp32", master_weights="on"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_flex_attention_is_refused_at_start_without_cuda(tmp_path, hidden_cache, monkeypatch):
    from dflash_offline import drafter

    monkeypatch.setattr(drafter, "load_target_embeddings", lambda *a: pytest.fail("weights loaded before refusing"))
    with pytest.raises(ValueError, match="attn=flex needs CUDA"):
        train.run(cfg(hidden_cache, tmp_path / "x", attn="flex", compile="on"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_tf32_is_refused_at_start_without_cuda(tmp_path, hidden_cache, monkeypatch):
    from dflash_offline import drafter

    monkeypatch.setattr(drafter, "load_target_embeddings", lambda *a: pytest.fail("weights loaded before refusing"))
    with pytest.raises(ValueError, match="TF32 needs CUDA"):
        train.run(cfg(hidden_cache, tmp_path / "x"), BenchSwitches(tf32=True))


def test_settings_resolve_for_the_machine_and_the_processes(hidden_cache, tmp_path):
    """What the config means with CUDA and without, on 1 and 2 processes (no GPU needed to check the CUDA side):
    the bench-only switches stay off unless asked for."""
    c = cfg(hidden_cache, tmp_path / "x")
    cpu = resolve_train(c, cuda=False, world=1, seq_len=128)
    assert (cpu.precision, cpu.attn, cpu.compile, cpu.master, cpu.tf32) == ("fp32", "dense", False, False, False)
    gpu = resolve_train(c, cuda=True, world=1, seq_len=128)
    assert (gpu.precision, gpu.attn, gpu.compile, gpu.master, gpu.tf32) == ("bf16", "flex", True, True, False)
    assert gpu.warmup == 1 and resolve_train(cfg(hidden_cache, tmp_path / "x", warmup_steps=-1, steps=100),
                                             cuda=True, world=1, seq_len=128).warmup == 4
    accum = dict(global_batch_tokens=4 * 2 * 128)
    ddp = resolve_train(cfg(hidden_cache, tmp_path / "x", **accum), cuda=True, world=2, seq_len=128)
    assert (ddp.accum, ddp.reduced_accum, ddp.master, ddp.sharded) == (2, True, False, False)  # auto: fp32 weights
    on = resolve_train(cfg(hidden_cache, tmp_path / "x", master_weights="on", **accum), cuda=True, world=2,
                       seq_len=128)
    assert on.master is True
    sharded = resolve_train(cfg(hidden_cache, tmp_path / "x", fsdp=True, **accum), cuda=True, world=2, seq_len=128)
    assert (sharded.sharded, sharded.master, sharded.reduced_accum) == (True, False, False)
    tf32 = resolve_train(c, cuda=True, world=1, seq_len=128, switches=BenchSwitches(tf32=True))
    assert (tf32.attn, tf32.tf32) == ("flex", True)
    with pytest.raises(ValueError, match=r"must be a multiple of batch_rows × seq_len × processes = 768 \(3 processes\); "
                                         r"it fits 1, 2, 4 processes; on 3, pass --global_batch_tokens=1536 "):
        resolve_train(cfg(hidden_cache, tmp_path / "x", **accum), cuda=False, world=3, seq_len=128)


@pytest.mark.parametrize("caller", ["allow_tf32", "fp32_precision"])
def test_tf32_is_the_runs_during_it_and_the_callers_after(tmp_path, hidden_cache, monkeypatch, caller):
    """The TF32 flag is set for the run (tf32=auto on the CPU: off) and the caller's setting is back afterwards,
    whichever of torch's two settings the caller used (with the newer one the older flag does not even read)."""
    from dflash_offline import loss

    m = torch.backends.cuda.matmul
    start, seen, real = m.fp32_precision, [], loss.block_ce_loss

    def spy(*a, **k):
        seen.append(m.allow_tf32)
        return real(*a, **k)

    monkeypatch.setattr(loss, "block_ce_loss", spy)
    try:
        setattr(m, caller, True if caller == "allow_tf32" else "tf32")
        train.run(cfg(hidden_cache, tmp_path / "x", steps=2, ckpt_every=10))
        assert seen and not any(seen)
        assert m.fp32_precision == "tf32"
        if caller == "allow_tf32":
            assert m.allow_tf32 is True
    finally:
        m.fp32_precision = start


def test_bf16_logits_reach_the_loss(tmp_path, hidden_cache):
    """loss_logits=bf16 (the logits rounded to bf16 before the CE): recorded, and the losses move by about that."""
    train.run(cfg(hidden_cache, tmp_path / "fp32", steps=2, ckpt_every=10))
    train.run(cfg(hidden_cache, tmp_path / "bf16", steps=2, ckpt_every=10, loss_logits="bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["derived"]["loss_logits"] == "bf16"
    a, b = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert a != b and b == pytest.approx(a, rel=1e-2)


def test_dpace_alpha_reaches_the_loss_and_is_refused_outside_0_1(tmp_path, hidden_cache):
    """train.dpace_alpha: the default run equals dpace_alpha=0.5's bit for bit, other values weigh the slots
    otherwise (the first step's loss, before any update, already differs); outside [0, 1] it is refused by name."""
    for name, kw in (("default", {}), ("half", {"dpace_alpha": 0.5}), ("zero", {"dpace_alpha": 0.0}),
                     ("one", {"dpace_alpha": 1.0})):
        train.run(cfg(hidden_cache, tmp_path / name, steps=1, ckpt_every=10, weighting="dpace", **kw))
    first = {name: losses(tmp_path / name)[0] for name in ("default", "half", "zero", "one")}
    assert first["default"] == first["half"]
    assert len({first["half"], first["zero"], first["one"]}) == 3, first
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="train.dpace_alpha"):
            cfg(hidden_cache, tmp_path / "bad", weighting="dpace", dpace_alpha=bad)


def test_fp8_logits_reach_the_loss(tmp_path, hidden_cache):
    """loss_logits=fp8 (both lm_head GEMMs in float8, `loss.Fp8Head`): recorded, and the losses stay within 2 % of
    the fp32 logits' while not equal to them."""
    train.run(cfg(hidden_cache, tmp_path / "fp32", steps=3, ckpt_every=10))
    train.run(cfg(hidden_cache, tmp_path / "fp8", steps=3, ckpt_every=10, loss_logits="fp8"))
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["derived"]["loss_logits"] == "fp8"
    a, b = losses(tmp_path / "fp32"), losses(tmp_path / "fp8")
    assert a != b and b == pytest.approx(a, rel=2e-2)


def test_fp8_logits_refuse_a_vocabulary_off_multiples_of_16_at_start(tmp_path, hidden_cache, monkeypatch):
    import dataclasses

    from dflash_offline import trainsetup

    real = trainsetup.drafter_config
    monkeypatch.setattr(trainsetup, "drafter_config", lambda *a: dataclasses.replace(real(*a), vocab_size=2050))
    with pytest.raises(ValueError, match=r"loss_logits=fp8 .* multiples of 16: the target has 64 and 2050"):
        train.run(cfg(hidden_cache, tmp_path / "x", steps=2, loss_logits="fp8"))
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_two_processes_bf16_master_weights_equal_one(tmp_path, hidden_cache):
    """DDP with bf16 gradients reduced in fp32 (the comm hook) = one process accumulating two micro-batches, to bf16
    rounding: `assert_same_training` with bf16 rounding, n = 1024 terms (2⁻⁷ = 7.8e-3 and 2·√(4·n·u·4) + 2⁻⁷ = 0.070;
    measured 5e-6, 1.4e-4 and 1.5e-3 on an AMD EPYC, torch 2.13)."""
    kw = dict(precision="bf16", master_weights="on", global_batch_tokens=2 * 2 * 128)
    one = tmp_path / "one"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(one), **{**TINY, "steps": 4, "ckpt_every": 4,
                                                                    **kw}).resolve())
    two = tmp_path / "two"
    launch_two(hidden_cache, two, **kw)
    assert json.loads((two / "config.json").read_text())["derived"]["master_weights"] is True
    assert_same_training(one, two, drafter_start(cfg(hidden_cache, one)), 4, 2 * N_TINY, bf16=True)


def test_two_processes_accumulating_with_master_weights_equal_one(tmp_path, hidden_cache):
    """DDP + gradient accumulation with bf16 weights (master_weights=on): each process sums its micro-batches' bf16
    gradients in fp32 and the comm hook reduces those sums in fp32, = one process accumulating all four, to the
    rounding of those fp32 sums in another order (the bf16 gradients of each micro-batch are the same): as the FSDP
    test, n = 2048 terms; measured 6e-8, 0 and 3e-8 (an AMD EPYC, torch 2.13). (auto keeps fp32 weights for this
    combination.)"""
    kw = dict(precision="bf16", master_weights="on", global_batch_tokens=4 * 2 * 128)
    one = tmp_path / "one"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(one), **{**TINY, "steps": 4, "ckpt_every": 4,
                                                                    **kw}).resolve())
    two = tmp_path / "two"
    launch_two(hidden_cache, two, **kw)
    derived = json.loads((two / "config.json").read_text())["derived"]
    assert derived["master_weights"] is True and derived["grad_accum"] == 2
    assert json.loads((one / "config.json").read_text())["derived"]["grad_accum"] == 4
    # (the gradient norms too: a gradient of the wrong scale would hide in the clipping)
    assert_same_training(one, two, drafter_start(cfg(hidden_cache, one)), 4, N_FSDP)
    auto = tmp_path / "auto"
    launch_two(hidden_cache, auto, **{**kw, "master_weights": "auto"}, steps=1)
    assert json.loads((auto / "config.json").read_text())["derived"]["master_weights"] is False


def test_taps_no_engine_serves_as_trained_are_refused_before_training(tmp_path, hidden_cache):
    taps = json.loads((hidden_cache / "manifest.json").read_text())["producer"]["layer_ids"]
    with pytest.raises(ValueError, match="not ascending"):
        train.run(cfg(hidden_cache, tmp_path / "x", layer_ids=taps[::-1]))
    assert not (tmp_path / "x").exists()


def test_cache_mismatches_are_refused_by_name(tmp_path, hidden_cache, qwen3_dir, copy_cache):
    with pytest.raises(ValueError, match=r"\[2\]"):
        train.run(cfg(hidden_cache, tmp_path / "x", layer_ids=[1, 2]))
    with pytest.raises(ValueError, match="not the target the cache was extracted from"):
        train.run(cfg(hidden_cache, tmp_path / "y", target=str(qwen3_dir)))
    bad = copy_cache(hidden_cache, tmp_path / "bad")
    update_manifest(bad, verified={"ok": False, "bad": [{"shard": 1, "reason": "x does not match its checksum"}]})
    with pytest.raises(ValueError, match="SHARD=1"):
        train.run(cfg(bad, tmp_path / "z"))
    with pytest.raises(ValueError, match="verify"):
        train.run(cfg(hidden_cache, tmp_path / "w", require_verified=True))


def test_golden_losses(tmp_path, hidden_cache):
    """A short deterministic CPU run must reproduce the committed losses (DFLASH_UPDATE_GOLDEN=1 rewrites them), to
    the rounding of another CPU's kernels, which sum in another order: λ·n·u = 1.5e-4 for n = 512 terms
    (tests/equivalence.py). Measured on the AMD EPYC (Zen 5) that wrote them: 0 with torch 2.13 and 2.11, 0 with
    oneDNN off (pytest --no-mkldnn), 2.6e-5 with ATen's default kernels (ATEN_CPU_CAPABILITY=default); a planted bug
    (γ doubled) is 8.2e-4. (The tiny target itself must not depend on torch: its bf16 init drawn by torch 2.11 gave
    other weights, 8e-3 here, until fixtures/tiny.py drew it in float32.)"""
    train.run(cfg(hidden_cache, tmp_path / "g", steps=5, ckpt_every=5))
    got = losses(tmp_path / "g")
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"losses": got, "torch": torch.__version__}, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())["losses"]
    check("losses against the golden ones", max(rel_diffs(got, want)), scalar_rtol(N_TINY))
    assert got[-1] < got[0]  # and it learns


def test_each_rank_gets_its_own_persistent_compile_cache(monkeypatch, tmp_path):
    from dflash_offline.cli import private_compile_caches

    monkeypatch.setenv("DFLASH_COMPILE_CACHE", str(tmp_path))
    dirs = {}
    for rank in ("0", "1"):
        for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("RANK", rank)
        dirs[rank] = private_compile_caches()
    assert dirs["0"]["TRITON_CACHE_DIR"] != dirs["1"]["TRITON_CACHE_DIR"]
    assert dirs["0"]["TORCHINDUCTOR_CACHE_DIR"] != dirs["1"]["TORCHINDUCTOR_CACHE_DIR"]
    assert all(v.startswith(str(tmp_path)) for d in dirs.values() for v in d.values())
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var)
    assert private_compile_caches() == dirs["1"]  # the same directories on the next run: compilation is reused
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert private_compile_caches()["TRITON_CACHE_DIR"] == "/elsewhere"  # an explicit setting wins


def test_fsdp_two_processes_equal_one_and_resume_exactly(tmp_path, hidden_cache):
    """FSDP-sharded (2 gloo processes, accumulation 2) = one unsharded process with accumulation 4, to the rounding
    of the step's sums in another order (rank r sums micro-batches r and r + 2, then the reduce-scatter adds the two
    ranks'): `assert_same_training` with n = 8 rows × 256 = 2048 terms (λ·n·u = 6.1e-4, 2·√(4·n·u·4) = 0.088;
    measured on an AMD EPYC (Zen 5), torch 2.13: 1.3e-7, 8e-8, 3.3e-7, ≤ 1.5e-7, 1.5e-7, 4.2e-7 with oneDNN off or
    other ATen/MKL kernels); a sharded run resumed from its step-2 checkpoint ends where the uninterrupted one did,
    bit for bit; its checkpoint loads unsharded."""
    tokens_per_step = 4 * 2 * 128
    one = tmp_path / "one"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(one), **{**TINY, "steps": 4, "ckpt_every": 2,
                                                                    "global_batch_tokens": tokens_per_step}).resolve())
    sharded = tmp_path / "fsdp"
    launch_two(hidden_cache, sharded, global_batch_tokens=tokens_per_step, fsdp=1, ckpt_every=2)
    derived = json.loads((sharded / "config.json").read_text())["derived"]
    assert derived["grad_accum"] == 2 and derived["fsdp_sharded"] is True
    assert set(final_weights(one, 4)) == set(final_weights(sharded, 4))
    # (the gradient norms: clipping sees the global norm of the sharded gradients)
    assert_same_training(one, sharded, drafter_start(cfg(hidden_cache, one)), 4, N_FSDP)
    uninterrupted = final_weights(sharded, 4), losses(sharded), grad_norms(sharded)
    # interrupt after step 2, resume sharded: the same arithmetic as the uninterrupted sharded run, bit for bit
    shutil.rmtree(sharded / "checkpoints" / "step-00000004")
    (sharded / "checkpoints" / "latest").write_text("step-00000002\n")
    (sharded / "metrics.jsonl").write_text("\n".join((sharded / "metrics.jsonl").read_text().splitlines()[:2]) + "\n")
    launch_two(hidden_cache, sharded, global_batch_tokens=tokens_per_step, fsdp=1, ckpt_every=2, resume=1)
    w, resumed_losses, resumed_norms = uninterrupted
    assert losses(sharded) == resumed_losses and grad_norms(sharded) == resumed_norms
    assert all(torch.equal(v, w[k]) for k, v in final_weights(sharded, 4).items())
    # the sharded run's checkpoint (full tensors, optimizer by parameter index) loads into an unsharded model + AdamW
    from dflash_offline.checkpoint import load_checkpoint
    from dflash_offline.drafter import DFlashDrafter

    c = cfg(hidden_cache, sharded, **TINY)
    model = DFlashDrafter(drafter_config(c, cache_defaults(c)))
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    state = load_checkpoint(sharded, model, opt, step=2, rng=False)
    assert state["step"] == 2
    saved = load_file(str(sharded / "checkpoints" / "step-00000002" / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    for p_ in model.parameters():  # full-size moments for every parameter, after 2 steps
        assert opt.state[p_]["exp_avg"].shape == p_.shape and float(opt.state[p_]["step"]) == 2


def test_compiled_graph_counter_counts_new_graphs():
    """The trainer's `recompiles` metric is the number of graphs compiled after warm-up: the counter it reads
    must move when torch.compile makes a graph (a key torch no longer fills would report 0 forever)."""
    import torch

    from dflash_offline.metrics import compiled_graphs

    f = torch.compile(lambda x: x * 2 + 1, dynamic=False, backend="eager")
    g0 = compiled_graphs()
    f(torch.ones(3))
    f(torch.ones(3))
    assert compiled_graphs() == g0 + 1
    f(torch.ones(5))  # a new static shape: a recompile
    assert compiled_graphs() == g0 + 2


def test_a_heap_the_caller_froze_before_importing_us_is_neither_refrozen_nor_unfrozen():
    """A process that froze its own heap (gc.freeze) before dflash_offline's modules were imported: a run there
    (`kept_process_state` around `end_warm_up`, as `trainrun.run` has them) freezes nothing and leaves the caller's
    frozen objects frozen — the interpreter's own frozen objects (Python 3.12's static tuples) are counted in a fresh
    interpreter, not taken from this process when a module happens to be imported."""
    # (a frozen object still dies when its last reference goes: the count may fall a little, never to 0 nor rise by
    # the hundreds of thousands of objects that importing torch adds)
    code = ("import gc; keep = [[i] for i in range(5000)]; gc.freeze(); n = gc.get_freeze_count()\n"
            "from dflash_offline.trainsetup import end_warm_up, kept_process_state\n"
            "with kept_process_state():\n"
            "    end_warm_up(False); assert n - 1000 < gc.get_freeze_count() <= n, ('refrozen', n, gc.get_freeze_count())\n"
            "assert n - 1000 < gc.get_freeze_count() <= n, ('unfrozen', n, gc.get_freeze_count())\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_long_lived_objects_leave_the_gc_after_warm_up_and_come_back_at_the_end(tmp_path, hidden_cache, monkeypatch):
    """After the warm-up step the heap built so far is frozen (full GC passes on the feeding thread stay short);
    when the run ends it is unfrozen, so the process is as it was."""
    import gc

    calls = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append(len(calls)), real_freeze())[1])
    train.run(cfg(hidden_cache, tmp_path / "r", steps=3))
    assert calls == [0]  # once, after the warm-up step
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    # no more than the interpreter keeps frozen itself: nothing before Python 3.12; on 3.12 its static tuples, which
    # every full collection puts back
    assert frozen <= gc.get_freeze_count()
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["gc_frac"] < 1 for r in recs)  # time the feeding thread spent in the GC, per window
    assert metrics.GC_CLOCK not in gc.callbacks  # removed when the run ends
    gc.callbacks.append(metrics.GC_CLOCK)
    try:
        before = metrics.GC_CLOCK.total
        gc.collect()
        assert metrics.GC_CLOCK.total > before
    finally:
        gc.callbacks.remove(metrics.GC_CLOCK)


def test_window_reports_are_read_after_the_next_step_is_queued_and_windows_tile_time(tmp_path, hidden_cache,
                                                                                       monkeypatch):
    """A window's metrics are read (on a GPU: the only wait for the device) once the next step has been queued,
    so the device never idles for a log line, except at a checkpoint or at the end, whose windows are read at once
    (a checkpoint also ends a window: its time is not training time); each window's timing runs from the end of
    the one before, so the windows tile the run, and each window is charged its own steps' time."""
    from dflash_offline import dataset

    drawn, read_at = [0], []
    real_next, real_result = dataset.HiddenStream.__next__, metrics.Report.result

    def slow_next(self):  # every step takes at least 50 ms, so step times are comparable
        time.sleep(0.05)
        drawn[0] += 1
        return real_next(self)

    monkeypatch.setattr(dataset.HiddenStream, "__next__", slow_next)
    monkeypatch.setattr(metrics.Report, "result", lambda self: (read_at.append((self.kw["step"], drawn[0])),
                                                                real_result(self))[1])
    train.run(cfg(hidden_cache, tmp_path / "r", steps=9, log_every=2, ckpt_every=5))
    # 1 batch a step: step n's record is read after step n+1's batch, except at the checkpoint (5) and the end (9)
    assert read_at == [(2, 3), (4, 5), (5, 5), (6, 7), (8, 9), (9, 9)]
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4, 5, 6, 8, 9]
    for prev, r, n in zip(recs[:-1], recs[1:], [2, 1, 1, 2, 1], strict=True):
        if prev["step"] != 5:  # (the window after the checkpoint starts when the checkpoint is written)
            assert r["time"] - prev["time"] == pytest.approx(r["ms_per_step"] * n / 1000, rel=1e-6, abs=1e-6)
    # each window holds its own steps' time: >= 50 ms a step, and no window is charged a step of the next one
    assert all(50 <= r["ms_per_step"] < 3 * min(x["ms_per_step"] for x in recs[1:]) for r in recs[1:])


def test_a_bench_run_without_its_final_checkpoint_still_records_its_last_window(tmp_path, hidden_cache):
    """bench.train's switch (`BenchSwitches.final_checkpoint=False`): the last step writes no checkpoint (≈ 25 GB at
    the 27B shapes, a minute of a timed call that is not the step), and its last, shorter window is still recorded.
    A run as users run it saves its last step."""
    kw = dict(steps=5, log_every=2, ckpt_every=10**9)
    train.run(cfg(hidden_cache, tmp_path / "bench", **kw), BenchSwitches(final_checkpoint=False))
    train.run(cfg(hidden_cache, tmp_path / "user", **kw))
    steps = {r: [json.loads(x)["step"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
             for r in ("bench", "user")}
    assert steps == {"bench": [2, 4, 5], "user": [2, 4, 5]}
    assert not list((tmp_path / "bench").glob("checkpoints/step-*"))
    assert [p.name for p in (tmp_path / "user").glob("checkpoints/step-*")] == ["step-00000005"]


def test_training_on_a_shard_altered_after_extraction_stops_with_one_line_naming_the_fix(tmp_path, hidden_cache,
                                                                                        copy_cache):
    """The read check is the guarantee: no verify verdict needed, and a past 'ok' verdict is no substitute."""
    from dflash_offline.cache.shards import hidden_shard_name

    bad = copy_cache(hidden_cache, tmp_path / "cache")
    update_manifest(bad, verified={"ok": True, "bad": []})
    path = bad / hidden_shard_name(1)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10  # one bit of the last row of the last tensor: same size, same header
    path.write_bytes(bytes(raw))
    env = {**os.environ, "DFLASH_NO_BAR": "1"}
    args = cli_args(bad, tmp_path / "run", steps=30, ckpt_every=100)  # 30 rows of 1 per step: every shard
    out = subprocess.run([sys.executable, "-m", "stages.train", *args, "--batch_rows=1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("error: ") and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{path} has row" in errors[-1] and f"`make extract CACHE={bad} SHARD=1`" in errors[-1]


def test_a_hand_edited_manifest_is_refused_before_the_run_directory_exists(tmp_path, hidden_cache, copy_cache):
    bad = copy_cache(hidden_cache, tmp_path / "cache")
    m = json.loads((bad / "manifest.json").read_text())
    m["shards"][2]["rows"] = m["shards"][2]["rows"] + 1  # a plausible value that contradicts the shard
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"hidden-00002.safetensors holds .* but the manifest says"):
        train.run(cfg(bad, tmp_path / "run"))
    m["shards"][2]["rows"] = "many"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"shards\[2\].rows is 'many'"):
        train.run(cfg(bad, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_finished_run_leaves_no_model_behind(tmp_path, hidden_cache):
    """The compiled drafter is a reference cycle (its compiled method): once `train.run` returns, nothing of it is
    alive — a second run in the process (bench.train's fp8 or encoded-cache run) does not carry the first one's
    weights in its memory figures."""
    import gc
    import weakref

    from dflash_offline import drafter

    live, init = weakref.WeakSet(), drafter.DFlashDrafter.__init__

    def tracked(self, *a, **k):
        init(self, *a, **k)
        live.add(self)

    drafter.DFlashDrafter.__init__ = tracked
    try:
        train.run(cfg(hidden_cache, tmp_path / "r", steps=2, ckpt_every=2, compile="on"))
    finally:
        drafter.DFlashDrafter.__init__ = init
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    assert frozen <= gc.get_freeze_count() and len(live) == 0  # (the interpreter's own frozen objects: as above)


@pytest.mark.parametrize("master", ["off", "on"])
def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(tmp_path, hidden_cache, monkeypatch, master):
    """One micro-batch's loss turns NaN (a bad row, an overflow): that step changes nothing — with fp32 weights and
    torch's AdamW as with MasterAdamW — the run goes on with finite weights, and the metrics count the skipped step."""
    real = Trainer.micro_batch
    calls = {"n": 0}

    def poisoned(trainer, batch, norm, last):
        calls["n"] += 1
        if calls["n"] == 3:  # step 3's only micro-batch
            batch = dict(batch, hidden=batch["hidden"] * float("nan"))
        return real(trainer, batch, norm, last)

    monkeypatch.setattr(Trainer, "micro_batch", poisoned)
    kw = dict(steps=4, ckpt_every=4, precision="bf16" if master == "on" else "fp32", master_weights=master)
    train.run(cfg(hidden_cache, tmp_path / "r", **kw))
    recs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_steps") for r in recs] == [0, 0, 1, 1]
    weights = final_weights(tmp_path / "r", 4)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert math.isfinite(recs[-1]["loss"])
