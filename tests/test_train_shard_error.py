"""A shard that fails its read check mid-run: the run stops with one line, a checkpoint of its last finished step
(whose data position re-reads the failed batch) and its status file `failed`; after the repair, `--resume=1`
continues it to the weights an uninterrupted run ends with (bitwise, on the CPU)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_train import cfg, final_weights, losses

from dflash_offline.cache.shards import ShardError, hidden_shard_name
from dflash_offline.dataset import HiddenStream, locate
from stages import train

ACCUM = dict(global_batch_tokens=2 * 2 * 128)  # 2 micro-batches of 2 rows × 128 tokens a step


def steps_saved(run) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (Path(run) / "checkpoints").glob("step-*"))


def status(run) -> str:
    return json.loads((Path(run) / "status-rank0.json").read_text())["state"]


def failing_read(monkeypatch, bad: set[int]):
    """The stream's read of the batches at these places of its sequence (epoch × batches an epoch + batch) fails
    its check as a damaged row's does, until `bad` is emptied (the shard redone)."""
    read = HiddenStream._read

    def _read(self, epoch, batch):
        if epoch * self.batches_per_epoch + batch in bad:
            raise ShardError(f"hidden-00001.safetensors has row 3 whose digest differs: redo the shard with "
                             f"`make extract CACHE={self.info.cache_dir} SHARD=1`")
        return read(self, epoch, batch)

    monkeypatch.setattr(HiddenStream, "_read", _read)


@pytest.mark.parametrize(("fails_at", "saved", "checkpoint"), [
    (7, [3], 3),  # the 2nd micro-batch of step 4 (steps 1-3 done, none checkpointed): a checkpoint of step 3
    (8, [4], 4),  # the 1st micro-batch of step 5, step 4 checkpointed already: nothing written again
    (1, [], None),  # the 2nd micro-batch of step 1: no step done, nothing to checkpoint
])
def test_a_read_failing_mid_run_checkpoints_the_last_finished_step_and_the_resume_equals_an_uninterrupted_run(
        tmp_path, hidden_cache, monkeypatch, fails_at, saved, checkpoint):
    kw = dict(steps=6, ckpt_every=4, **ACCUM)
    train.run(cfg(hidden_cache, tmp_path / "a", **kw))
    b, bad = tmp_path / "b", {fails_at}
    failing_read(monkeypatch, bad)
    with pytest.raises(ShardError) as e:
        train.run(cfg(hidden_cache, b, **kw))
    line = str(e.value)
    assert steps_saved(b) == saved and status(b) == "failed"
    assert "make extract CACHE=" in line and "`make train RESUME=1`" in line
    done = fails_at // 2
    assert f"stopped after step {done} of 6" in line
    if checkpoint is None:
        assert "no checkpoint yet" in line
    else:
        assert f"checkpoint step {checkpoint} ({b / 'checkpoints' / f'step-{checkpoint:08d}'})" in line
        data = json.loads((b / "checkpoints" / f"step-{checkpoint:08d}" / "data.json").read_text())
        assert data["batch"] == 2 * checkpoint  # the failed step's first batch: re-read on resume
    del e
    bad.clear()  # the shard redone
    train.run(cfg(hidden_cache, b, resume=True, **kw))
    assert status(b) == "done"
    assert losses(b) == losses(tmp_path / "a")
    wa, wb = final_weights(tmp_path / "a", 6), final_weights(b, 6)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_row_damaged_after_the_start_stops_the_run_with_a_checkpoint_to_continue_from(tmp_path, hidden_cache,
                                                                                        copy_cache):
    """The real check: one bit of a shard's row flipped (size and header intact, so the start's checks pass);
    the run stops when it reads that row, checkpointed; the shard restored, the resumed run ends as an
    uninterrupted one."""
    kw = dict(steps=30, ckpt_every=100, batch_rows=1)  # 30 rows of 1 per step: every shard
    train.run(cfg(hidden_cache, tmp_path / "a", **kw))
    cache = copy_cache(hidden_cache, tmp_path / "cache")
    shard_rows = tuple(e["rows"] for e in json.loads((cache / "manifest.json").read_text())["shards"])
    order = locate(shard_rows, cfg(cache, tmp_path / "x").seed, 0, 0, 30)  # the (shard, row) each step reads
    shard = next(s for s, r in order[10:] if r == shard_rows[s] - 1)  # one whose last row a step after 10 reads
    path = cache / hidden_shard_name(shard)
    good = path.read_bytes()
    raw = bytearray(good)
    raw[-7] ^= 0x10  # one bit of the last row of the last tensor
    path.write_bytes(bytes(raw))
    b = tmp_path / "b"
    with pytest.raises(ShardError) as e:
        train.run(cfg(cache, b, **kw))
    line = str(e.value)
    done = int(re.search(r"stopped after step (\d+) of 30", line)[1])
    assert order.index((shard, shard_rows[shard] - 1)) == done, line
    assert f"{path} has row" in line and f"`make extract CACHE={cache} SHARD={shard}`" in line
    assert f"checkpoint step {done} (" in line and "`make train RESUME=1`" in line
    assert steps_saved(b) == [done] and status(b) == "failed"
    del e
    path.write_bytes(good)  # the shard redone
    train.run(cfg(cache, b, resume=True, **kw))
    wa, wb = final_weights(tmp_path / "a", 30), final_weights(b, 30)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert losses(b) == losses(tmp_path / "a")
    shutil.rmtree(cache)
