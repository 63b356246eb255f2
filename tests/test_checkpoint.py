"""Checkpoints: exact resume (params, optimizer, scheduler, RNG), keep_last, atomic writes, no pickle, clear errors."""

import functools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_offline import checkpoint as ck


def cosine(step: int, warmup: int, total: int) -> float:
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total)))


def make(seed: int, partial: bool = False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    fn = functools.partial(cosine, warmup=2, total=10) if partial else (lambda s: cosine(s, 2, 10))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, fn)


def train_step(model, opt, sched) -> torch.Tensor:
    """Uses every RNG a checkpoint restores: torch (data, dropout), python `random` and numpy."""
    x = torch.randn(8, 4)
    y = x.sum(1, keepdim=True) * (1 + random.random()) + float(np.random.randn())
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def scramble_rngs():
    torch.manual_seed(1234)
    random.seed(99)
    np.random.seed(7)


@pytest.mark.parametrize("partial", [False, True])
def test_resume_reproduces_training_exactly(tmp_path, partial):
    random.seed(0)
    np.random.seed(0)
    model, opt, sched = make(0, partial)
    for _ in range(3):
        train_step(model, opt, sched)
    data = {"epoch": 0, "batch": 3, "samples": 24}
    ck.save_checkpoint(tmp_path, 3, model, opt, sched, data_state=data, extra={"loss": 0.5}, config={"lr": 1e-2})
    losses = [train_step(model, opt, sched) for _ in range(2)]

    scramble_rngs()
    model2, opt2, sched2 = make(42, partial)  # other weights, fresh optimizer and scheduler
    got = ck.load_checkpoint(tmp_path, model2, opt2, sched2)
    assert got["step"] == 3 and got["data_state"] == data and got["extra"] == {"loss": 0.5}
    assert got["config"] == {"lr": 1e-2}
    losses2 = [train_step(model2, opt2, sched2) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(losses, losses2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert sched.get_last_lr() == sched2.get_last_lr()
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)


def test_without_rng_restore_the_run_differs(tmp_path):
    """Guards the test above: it fails if RNG restoring does nothing."""
    model, opt, sched = make(0)
    ck.save_checkpoint(tmp_path, 1, model, opt, sched)
    a = train_step(model, opt, sched)
    scramble_rngs()
    model2, opt2, sched2 = make(0)
    ck.load_checkpoint(tmp_path, model2, opt2, sched2, rng=False)
    assert not torch.equal(a, train_step(model2, opt2, sched2))


def test_keep_last_latest_and_no_pickle(tmp_path):
    model, opt, sched = make(0)
    for step in range(1, 6):
        train_step(model, opt, sched)
        ck.save_checkpoint(tmp_path, step, model, opt, sched, data_state={"batch": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    assert (root / "latest").read_text().strip() == "step-00000005"
    ck.save_checkpoint(tmp_path, 5, model, opt, sched, data_state={"batch": 55}, keep_last=2)  # same step again
    assert ck.load_checkpoint(tmp_path, model, opt, sched)["data_state"] == {"batch": 55}
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".safetensors", ".json", ""}
    assert {p.name for p in files if not p.suffix} == {"latest"}
    assert not any(p.read_bytes()[:1] == b"\x80" for p in files)  # no pickle protocol header anywhere
    names = {p.name for p in (root / "step-00000005").iterdir()}
    assert names == {"model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
                     "rng.safetensors", "rng.json", "data.json", "meta.json"}


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    model, opt, sched = make(0)
    ck.save_checkpoint(tmp_path, 1, model, opt, sched)
    monkeypatch.setattr(ck, "rng_state", lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 2, model, opt, sched)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000001"


class TensorLambda:
    def __init__(self):
        self.factor = torch.ones(1)

    def __call__(self, step: int) -> float:
        return 1.0


def test_clear_errors(tmp_path):
    model, opt, sched = make(0)
    with pytest.raises(ck.CheckpointError, match="no checkpoint under .* yet: train the run first"):
        ck.load_checkpoint(tmp_path, model, opt, sched)  # (a resume, an export or an eval of a run not trained yet)
    ck.save_checkpoint(tmp_path, 7, model, opt, sched)
    with pytest.raises(ck.CheckpointError, match="steps available: 7"):
        ck.load_checkpoint(tmp_path, model, step=8)
    with pytest.raises(ck.CheckpointError, match="does not fit this model"):
        ck.load_checkpoint(tmp_path, nn.Linear(4, 16))
    bad_sched = torch.optim.lr_scheduler.LambdaLR(opt, TensorLambda())  # LambdaLR saves a callable's __dict__
    with pytest.raises(ck.CheckpointError, match="scheduler.*not JSON-able"):
        ck.save_checkpoint(tmp_path, 8, model, opt, bad_sched)
    model_file = tmp_path / "checkpoints" / "step-00000007" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-4])
    with pytest.raises(ck.CheckpointError, match="model.safetensors is missing or truncated"):
        ck.load_checkpoint(tmp_path, model)
    (tmp_path / "checkpoints" / "latest").unlink()
    ck.save_checkpoint(tmp_path, 9, model, opt, sched)
    (tmp_path / "checkpoints" / "latest").unlink()  # crashed before `latest` was written: the newest one is used
    assert ck.load_checkpoint(tmp_path, model, opt, sched)["step"] == 9


def test_wrapped_models_save_plain_keys(tmp_path):
    model, _, _ = make(0)
    ck.save_checkpoint(tmp_path, 1, torch.compile(model), rng=False)
    keys = json.loads((tmp_path / "checkpoints" / "step-00000001" / "meta.json").read_text())["files"]
    assert "model.safetensors" in keys and "optimizer.json" not in keys
    plain, _, _ = make(5)
    ck.load_checkpoint(tmp_path, plain, rng=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, opt, sched = make(0)
        ddp = nn.parallel.DistributedDataParallel(model)
        train_step(ddp, opt, sched)
        ck.save_checkpoint(tmp_path / "run", 1, ddp, opt, sched)
        plain, opt2, sched2 = make(3)
        ck.load_checkpoint(tmp_path / "run", nn.parallel.DistributedDataParallel(plain), opt2, sched2)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_resume_restores_cuda_rng_and_state(tmp_path):
    def step(model, opt, sched):
        x = torch.randn(8, 4, device="cuda")  # the CUDA generator
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    model, opt, sched = make(0)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, 2, 10))
    for _ in range(2):
        step(model, opt, sched)
    ck.save_checkpoint(tmp_path, 2, model, opt, sched)
    losses = [step(model, opt, sched) for _ in range(2)]
    torch.cuda.manual_seed_all(77)
    model2, _, _ = make(5)
    model2.cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: cosine(s, 2, 10))
    ck.load_checkpoint(tmp_path, model2, opt2, sched2)
    assert all(v.is_cuda for s in opt2.state.values() for k, v in s.items() if k != "step")
    assert all(torch.equal(a, step(model2, opt2, sched2)) for a in losses)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


def test_a_checkpoint_half_written_by_a_killed_run_is_removed_by_the_next_run(tmp_path, hidden_cache):
    """kill -9 during a save leaves a temp directory naming the dead process; resuming removes it."""
    import socket
    import subprocess
    import sys

    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    tiny = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, num_anchors=4, batch_rows=1, trackers="none")
    run = tmp_path / "run"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), steps=2, ckpt_every=2, **tiny).resolve())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half = run / "checkpoints" / f".step-00000004.tmp~{socket.gethostname()}~{dead.pid}~abcd1234"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 4096)
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), steps=4, ckpt_every=2, resume=True, **tiny).resolve())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000002", "step-00000004"]


def _tiny_train(cache, run, **kw):
    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    tiny = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, num_anchors=4, batch_rows=1, trackers="none",
                log_every=1, ckpt_every=2)
    train.run(TrainConfig.of(cache=str(cache), run=str(run), **{**tiny, **kw}).resolve())
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_a_run_killed_past_its_last_checkpoint_resumes_without_duplicate_metrics(tmp_path, hidden_cache):
    """kill -9 after steps 5-6 were logged but before step 6's checkpoint was whole: the resumed run does them again
    and metrics.jsonl holds each step once, as an uninterrupted run's."""
    import shutil

    clean = _tiny_train(hidden_cache, tmp_path / "clean", steps=6)
    run = tmp_path / "killed"
    _tiny_train(hidden_cache, run, steps=6)
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    (run / "checkpoints" / "latest").write_text("step-00000004\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.0')  # a torn last line
    resumed = _tiny_train(hidden_cache, run, steps=6, resume=True)
    assert [r["step"] for r in resumed] == [r["step"] for r in clean] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in clean]


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_killed_during_its_first_checkpoint_save_can_be_rerun_either_way(tmp_path, hidden_cache, resume):
    import socket
    import subprocess
    import sys

    clean = _tiny_train(hidden_cache, tmp_path / "clean", steps=4)
    run = tmp_path / "killed"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half = run / "checkpoints" / f".step-00000002.tmp~{socket.gethostname()}~{dead.pid}~abcd1234"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"\0" * 100)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')
    again = _tiny_train(hidden_cache, run, steps=4, resume=resume)
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"]) for r in clean]


def test_a_checkpoint_missing_a_file_it_lists_is_not_complete(tmp_path):
    """A prune (or a copy) cut short leaves meta.json without every file: it is not offered for resuming."""
    model, opt, sched = make(0)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model, opt, sched)
    (tmp_path / "checkpoints" / "step-00000002" / "rng.json").unlink()
    assert [s for _, s, _ in ck.list_checkpoints(tmp_path)] == [1]
    # `latest` still names it: the resume takes the newest whole checkpoint instead of failing on it
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert ck.find_checkpoint(tmp_path).name == "step-00000001"
    (tmp_path / "checkpoints" / "latest").unlink()
    assert ck.find_checkpoint(tmp_path).name == "step-00000001"


def test_keep_last_keeps_the_latest_steps_whatever_the_clock(tmp_path, monkeypatch):
    """A resume on a machine whose clock runs behind the one that saved steps 1-3: pruning keeps the newest steps."""
    import time

    model, opt, sched = make(0)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, model, opt, sched, keep_last=3)
    behind = time.time() - 3600
    monkeypatch.setattr(time, "time", lambda: behind)
    for step in (4, 5):
        ck.save_checkpoint(tmp_path, step, model, opt, sched, keep_last=3)
    assert [s for _, s, _ in ck.list_checkpoints(tmp_path)] == [3, 4, 5]
    assert ck.find_checkpoint(tmp_path).name == "step-00000005"


def flip_one_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # a bit of the last tensor's data: same size, same header, a valid file
    path.write_bytes(bytes(raw))


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    """One flipped bit in the newest checkpoint's weights (same size: only the digest sees it): resuming takes the
    step before, says which and why; an explicit damaged step and no intact one at all are one error line each."""
    model, opt, sched = make(0)
    for step in (1, 2, 3):
        train_step(model, opt, sched)
        ck.save_checkpoint(tmp_path, step, model, opt, sched, keep_last=0)
    flip_one_bit(tmp_path / "checkpoints" / "step-00000003" / "model.safetensors")
    said = []
    assert ck.load_checkpoint(tmp_path, *make(1), log=said.append)["step"] == 2
    assert said == [f"{tmp_path / 'checkpoints' / 'step-00000003'} is damaged (model.safetensors differs from the "
                    f"SHA-256 recorded when it was saved): resuming from step-00000002 instead"]
    with pytest.raises(ck.CheckpointError, match=r"step-00000003 is damaged: model.safetensors differs"):
        ck.load_checkpoint(tmp_path, *make(1), step=3)
    flip_one_bit(tmp_path / "checkpoints" / "step-00000002" / "optimizer.safetensors")
    (tmp_path / "checkpoints" / "step-00000001" / "data.json").write_text("NULL\n")  # same size, other bytes
    with pytest.raises(ck.CheckpointError, match=r"^no intact checkpoint under .*step-00000003: model.safetensors "
                       r"differs.*; step-00000002: optimizer.safetensors differs.*; step-00000001: data.json "
                       r"differs.*start the run again without --resume$"):
        ck.load_checkpoint(tmp_path, *make(1))


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own (Rust) error: it becomes OSError ENOSPC, which the stages print
    as one line (`cli.run_cli`); the failed save leaves no temp directory, and `latest` names the step before."""
    import errno

    from safetensors import SafetensorError

    model, opt, sched = make(0)
    ck.save_checkpoint(tmp_path, 1, model, opt, sched)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })")

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(OSError) as e:
        ck.save_checkpoint(tmp_path, 2, model, opt, sched)
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("model.safetensors")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    assert ck.intact_checkpoint(tmp_path).name == "step-00000001"


def test_a_run_resumes_from_the_newest_intact_checkpoint(tmp_path, hidden_cache, capsys):
    """Training's resume reads what `intact_checkpoint` chose: step 4's weights damaged, it continues from step 2
    (the log says so) and logs steps 3-6 again."""
    run = tmp_path / "run"
    _tiny_train(hidden_cache, run, steps=4)
    flip_one_bit(run / "checkpoints" / "step-00000004" / "model.safetensors")
    capsys.readouterr()
    recs = _tiny_train(hidden_cache, run, steps=6, resume=True)
    out = capsys.readouterr().out
    assert (f"{run / 'checkpoints' / 'step-00000004'} is damaged (model.safetensors differs from the SHA-256 "
            f"recorded when it was saved): resuming from step-00000002 instead") in out
    assert f"resumed {run} at step 2 (step-00000002)" in out
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]


def test_export_refuses_damaged_weights(tmp_path, hidden_cache):
    from dflash_offline.export import ExportConfig
    from stages import export

    run = tmp_path / "run"
    _tiny_train(hidden_cache, run, steps=4)
    flip_one_bit(run / "checkpoints" / "step-00000004" / "model.safetensors")
    with pytest.raises(ValueError, match=r"step-00000004 is damaged: model.safetensors differs from the SHA-256 "
                                         r"recorded when it was saved; export another step \(--step=N; others: 2\)$"):
        export.run(ExportConfig(run=str(run), export=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()
    export.run(ExportConfig(run=str(run), export=str(tmp_path / "out"), step=2))
    assert (tmp_path / "out" / "model.safetensors").is_file()


class ThreadGroup:
    """`world` threads standing for a run's processes: `reduce_max(rank)` is their all-reduce (max), a collective."""

    def __init__(self, world: int):
        import threading

        self.barrier, self.values = threading.Barrier(world, timeout=30), {}

    def reduce_max(self, rank: int):
        def collective(v: int) -> int:
            self.values[rank] = v
            self.barrier.wait()
            out = max(self.values.values())
            self.barrier.wait()
            return out
        return collective


def on_ranks(world: int, fn):
    """fn(rank, reduce_max) on `world` threads at once: each rank's result or exception."""
    from concurrent.futures import ThreadPoolExecutor

    group = ThreadGroup(world)

    def call(rank):
        try:
            return fn(rank, group.reduce_max(rank))
        except Exception as e:  # noqa: BLE001 (returned for the test to check)
            return e
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(call, range(world)))


def test_the_processes_of_a_run_hash_each_file_once_between_them_and_agree(tmp_path, monkeypatch):
    """Resuming with 2 processes: each hashes its share of the checkpoint's files (together every file, once); damage
    in one process's share makes both skip that checkpoint. Processes that see different checkpoints each check their own
    (`same_start_on_every_rank` then refuses different steps: tests/test_multinode.py)."""
    model, opt, sched = make(0)
    for step in (1, 2):
        train_step(model, opt, sched)
        ck.save_checkpoint(tmp_path, step, model, opt, sched, keep_last=0)
    hashed, real = [], ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p: (hashed.append((p.parent.name, p.name)), real(p))[1])
    newest = tmp_path / "checkpoints" / "step-00000002"
    files = sorted(json.loads((newest / "meta.json").read_text())["sha256"])
    assert [d.name for d in on_ranks(2, lambda r, red: ck.resume_point(tmp_path, print, r, 2, red))] == [
        newest.name] * 2
    assert sorted(hashed) == [(newest.name, f) for f in files]  # every file once, by one process or the other
    shares = [ck.my_share(newest, r, 2) for r in (0, 1)]
    assert set(shares[0]).isdisjoint(shares[1]) and all(shares)
    said = []
    flip_one_bit(newest / shares[1][0])  # in process 1's share only
    got = on_ranks(2, lambda r, red: ck.resume_point(tmp_path, said.append, r, 2, red))
    assert [d.name for d in got] == ["step-00000001"] * 2
    assert any("damaged (see the other processes' lines)" in s for s in said)
    assert any(f"{shares[1][0]} differs from the SHA-256" in s for s in said)
    # machines with their own RUN= that see other checkpoints: each checks its own whole (no collective to wait on)
    other = tmp_path / "other"
    ck.save_checkpoint(other, 1, model, opt, sched)
    hashed.clear()
    got = on_ranks(2, lambda r, red: ck.resume_point(tmp_path if r == 0 else other, print, r, 2, red))
    assert [d.name for d in got] == ["step-00000001"] * 2 and got[0].parent.parent == tmp_path
    assert sorted(hashed) == sorted([(newest.name, f) for f in files] + [("step-00000001", f) for f in files] * 2)
