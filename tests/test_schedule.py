"""The run's length in the user's terms: `epochs` over the cache → optimizer steps (whatever the processes and the
accumulation), `warmup_ratio`, the line printed at start and the config.json "derived" block; a resumed run keeps
its schedule and ends where the uninterrupted one does."""

import json
import shutil
from pathlib import Path

import pytest

from dflash_offline.config import ConfigError
from dflash_offline.dataset import HiddenStream, open_hidden_cache
from dflash_offline.trainsetup import TrainConfig, cache_defaults, resolve_train
from stages import train

TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, log_every=1, trackers="none",
            lr=3e-3)


def cfg(cache, run="unused", **kw):
    return TrainConfig.of(cache=str(cache), run=str(run), **{**TINY, **kw}).resolve()


@pytest.fixture(scope="module")
def info(hidden_cache):
    return open_hidden_cache(hidden_cache, cache_defaults(TrainConfig.of(cache=str(hidden_cache)))["layer_ids"])


@pytest.mark.parametrize(("world", "batch_rows", "accum"), [(1, 2, 1), (2, 2, 1), (1, 2, 4), (2, 1, 3), (3, 4, 2)])
def test_epochs_are_passes_of_the_stream_for_any_processes_and_accumulation(hidden_cache, info, world, batch_rows,
                                                                             accum):
    """`epochs=E` runs E passes of the stream each rank reads (its epoch: the rows that fill whole global batches),
    rounded up to whole optimizer steps; the same cache, E and processes always give the same steps."""
    c = cfg(hidden_cache, epochs=3, batch_rows=batch_rows, global_batch_tokens=batch_rows * world * accum * 128)
    s = resolve_train(c, cuda=False, world=world, seq_len=128, rows=info.num_rows)
    assert s.accum == accum
    stream = HiddenStream(info, batch_rows, rank=world - 1, world_size=world)  # (reads nothing until iterated)
    rows_per_step = batch_rows * world * accum
    epoch_rows = stream.batches_per_epoch * batch_rows * world  # what one pass of the stream hands out
    assert s.steps_per_epoch * rows_per_step == epoch_rows
    assert 3 * epoch_rows <= s.steps * rows_per_step < 3 * epoch_rows + rows_per_step
    derived = s.derived(c, "key")
    assert (derived["steps"], derived["steps_per_epoch"], derived["warmup_steps"]) == (s.steps, s.steps_per_epoch,
                                                                                      s.warmup)
    assert derived["epochs"] == pytest.approx(3, abs=1 / s.steps_per_epoch)
    assert resolve_train(c, cuda=False, world=world, seq_len=128, rows=info.num_rows) == s


def test_steps_without_epochs_and_the_warmup(hidden_cache, info):
    rows = info.num_rows  # 152 rows of 128 tokens
    by_steps = resolve_train(cfg(hidden_cache, steps=100, batch_rows=2), cuda=False, world=1, seq_len=128, rows=rows)
    assert (by_steps.steps, by_steps.steps_per_epoch, by_steps.warmup) == (100, 76, 4)  # 4 % of the steps
    # warmup_ratio × steps rounded down, as SpecForge (int(0.04 × 10000) = 400); at least 1; warmup_steps wins
    for kw, warmup in [({"steps": 10000}, 400), ({"steps": 7404}, 296), ({"steps": 10, "warmup_ratio": 0.05}, 1),
                       ({"steps": 100, "warmup_ratio": 0.0}, 0), ({"steps": 100, "warmup_steps": 7}, 7),
                       ({"epochs": 2, "warmup_ratio": 0.1}, 15)]:  # 2 epochs × 76 steps = 152 → 15
        assert resolve_train(cfg(hidden_cache, batch_rows=2, **kw), cuda=False, world=1, seq_len=128,
                             rows=rows).warmup == warmup, kw
    for bad, match in [({"epochs": -1}, "train.epochs must be >= 0"),
                       ({"warmup_ratio": 1.0}, r"train.warmup_ratio must be in \[0, 1\)"),
                       ({"warmup_steps": -2}, "train.warmup_steps must be >= 0")]:
        with pytest.raises(ConfigError, match=match):
            cfg(hidden_cache, **bad)
    with pytest.raises(ValueError, match="the cache holds 152 rows, fewer than one global batch of 160"):
        resolve_train(cfg(hidden_cache, epochs=1, batch_rows=80), cuda=False, world=2, seq_len=128, rows=rows)


def test_the_start_line_speaks_epochs_and_steps(hidden_cache):
    """8 processes × 1 row of 4096 over a cache of 9,872 rows: 1,234 steps an epoch."""
    kw = dict(batch_rows=1, global_batch_tokens=8 * 4096)

    def line(**more):
        c = cfg(hidden_cache, **kw, **more)
        return resolve_train(c, cuda=False, world=8, seq_len=4096, rows=9872).describe_schedule(c, 4096)

    assert line(epochs=6) == ("schedule: 6 epochs × 1,234 steps = 7,404 steps (global batch 8 rows × 4096), "
                              "warmup 296 (4 %)")
    assert line(steps=617) == ("schedule: 617 steps = 0.5 epochs of 1,234 steps (global batch 8 rows × 4096), "
                               "warmup 24 (3.89 %)")
    assert line(epochs=0.5, steps=300).endswith("; steps=300 ignored: epochs sets the length")
    c = cfg(hidden_cache, epochs=1, batch_rows=1, global_batch_tokens=2 * 4096)  # 1 process accumulating 2 rows
    s = resolve_train(c, cuda=False, world=1, seq_len=4096, rows=9871)
    assert s.describe_schedule(c, 4096).startswith("schedule: 1 epochs × 4,935.5 steps = 4,936 steps (global batch 2 ")


def last_step(run: Path) -> int:
    return int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))


def test_a_run_of_epochs_ends_after_them_and_a_resumed_one_keeps_the_schedule(tmp_path, hidden_cache, capsys):
    """2 epochs of 152 rows in optimizer steps of 2 micro-batches × 16 rows (9 micro-batches an epoch): 9 steps,
    the stream at the start of epoch 2 after the last; killed after step 6 and resumed, the run has the same
    schedule, learning rates and losses, and ends at the same place."""
    kw = dict(epochs=2, batch_rows=16, global_batch_tokens=2 * 16 * 128, ckpt_every=3)
    a = tmp_path / "a"
    train.run(cfg(hidden_cache, a, **kw))
    out = capsys.readouterr().out
    assert "schedule: 2 epochs × 4.5 steps = 9 steps (global batch 32 rows × 128), warmup 1 (11.1 %)" in out
    derived = json.loads((a / "config.json").read_text())["derived"]
    assert (derived["steps"], derived["steps_per_epoch"], derived["epochs"], derived["warmup_steps"]) == (9, 4.5, 2, 1)
    assert last_step(a) == 9
    end = json.loads((a / "checkpoints" / "step-00000009" / "data.json").read_text())
    assert (end["epoch"], end["batch"]) == (2, 0)

    b = tmp_path / "b"
    shutil.copytree(a, b)  # b was killed after its checkpoint at step 6
    shutil.rmtree(b / "checkpoints" / "step-00000009")
    (b / "checkpoints" / "latest").write_text("step-00000006\n")
    (b / "metrics.jsonl").write_text("\n".join((a / "metrics.jsonl").read_text().splitlines()[:6]) + "\n")
    train.run(cfg(hidden_cache, b, resume=True, **kw))
    assert "= 9 steps" in capsys.readouterr().out
    assert json.loads((b / "config.json").read_text())["derived"] == derived
    recs = [[json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (a, b)]
    assert [(r["step"], r["lr"], r["loss"]) for r in recs[1]] == [(r["step"], r["lr"], r["loss"]) for r in recs[0]]
    assert last_step(b) == 9
    assert json.loads((b / "checkpoints" / "step-00000009" / "data.json").read_text()) == end
