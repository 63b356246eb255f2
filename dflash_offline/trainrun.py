"""One training run of stage 2 (`stages/train.py` is its command line; `bench.train` runs it as a user does), in
sections: config → compute → model → optimizer → data → loop. `run` checks the inputs before any weights load, owns
the run directory (rank 0 holds its lock: `runguard`), builds the accelerator and what the settings mean on it
(`trainsetup.TrainSetup`), resumes from the newest intact checkpoint, writes the resolved config, builds the drafter
and the target's frozen embedding and lm_head, and hands them to `trainer.Trainer`, whose loop runs to the end. The
process's settings are left as the run found them (`trainsetup.kept_process_state`, the signal handlers); what
torch.compile (its compiled graphs), accelerate (its state singletons) and the CUDA allocator (its cache, its peak
statistics) keep stays in the process: a caller that trains several drafters in one process resets those between
runs. SIGTERM/SIGINT stop a run after the step in flight with a final checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from dflash_offline.cache.fsio import write_json_atomic
from dflash_offline.config import as_dict
from dflash_offline.runguard import Interrupted, StopSignals, check_run_dir, ender, owned
from dflash_offline.trainer import Trainer, check_same_drafter, check_same_projection
from dflash_offline.trainsetup import (
    BenchSwitches,
    TrainConfig,
    TrainSetup,
    check_inputs,
    kept_process_state,
    release_process_group,
    resolve_train,
    same_start_on_every_rank,
)

# --- the run ---------------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, switches: BenchSwitches = BenchSwitches(), note: str = "") -> Path:
    """Train; `switches` are bench.train's A/B switches (not options); `note` is logged once the run is this
    trainer's (where its settings came from). The process's settings are left as the run
    found them (the module doc says what stays). SIGTERM/SIGINT stop it after the step in flight with a final
    checkpoint (`runguard`): it raises `Interrupted`."""
    check_run_dir(Path(cfg.run))
    rank, stopped = int(os.environ.get("RANK", 0)), None
    try:
        with kept_process_state(), StopSignals(cfg.stop_grace_s, ender(Path(cfg.run), rank)) as stopper:
            run_dir = _run(cfg, switches, stopper, note)
    except Interrupted as e:
        stopped = e.with_traceback(None)  # its traceback would keep `_run`'s frame, and the DDP model, alive
    release_process_group()  # after `_run`'s frame is gone
    if stopped is not None:
        raise stopped
    return run_dir


def _run(cfg: TrainConfig, switches: BenchSwitches, stopper: StopSignals, note: str = "") -> Path:
    # --- config: everything checked before any weights load; then the run is this trainer's (rank 0 holds its lock)
    t0, run_dir = time.time(), Path(cfg.run)
    c, dc, info = check_inputs(cfg, run_dir, switches.final_checkpoint)  # (also removes what a killed run left
    # half-written)
    with owned(run_dir, int(os.environ.get("RANK", 0)), lost=lambda held: os._exit(1)):  # (another owns it now)
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(f"[train] {note}", flush=True)
        return _train(cfg, switches, stopper, t0, c, dc, info)


def _train(cfg: TrainConfig, switches: BenchSwitches, stopper: StopSignals, t0: float, c: dict, dc, info) -> Path:
    import torch
    from accelerate.utils import set_seed

    from dflash_offline.checkpoint import resume_point
    from dflash_offline.progress import log

    run_dir = Path(cfg.run)
    # --- compute
    acc, s, trackers = accelerator(cfg, switches, c["seq_len"], info.num_rows)
    rank, device = acc.process_index, acc.device
    # the newest checkpoint whose files match their recorded SHA-256 (a damaged one is skipped, and said so); the
    # processes hash a share of its files each
    start = resume_point(run_dir, log, rank, acc.num_processes, lambda v: int(acc.gather(
        torch.tensor([v], dtype=torch.int64, device=device)).max())) if cfg.resume else None
    set_seed(cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)  # every rank: its status file goes there (RUN= local to a machine too)
    same_start_on_every_rank(acc, start, run_dir, info)  # machines that do not share RUN= or CACHE= would differ
    if start is not None:
        check_same_projection(start, run_dir, c.get("projection"))
        check_same_drafter(start, run_dir, dc)
    if rank == 0:
        write_resolved(cfg, s, dc, c, info.key, run_dir, start)

    # --- model
    model, embed, head = build_model(cfg, s, dc, c["target"], device, log if rank == 0 else None)

    # --- optimizer (built after sharding when FSDP is on: it must hold the sharded parameters) and data
    trainer = Trainer(cfg, s, acc, model, embed, head, info, run_dir, c.get("projection"))
    trainer.resume(start)
    if trackers and rank == 0:
        acc.init_trackers("dflash", config={k: v for k, v in as_dict(cfg).items() if isinstance(v, int | float | str)})

    # --- loop
    trainer.run(c["seq_len"], t0, stopper)
    return run_dir


def accelerator(cfg: TrainConfig, switches: BenchSwitches, seq_len: int, rows: int):
    """(the Accelerator, what the settings mean on it: `TrainSetup`, the metric trackers available)."""
    import torch
    from accelerate import Accelerator

    from dflash_offline.metrics import available_trackers
    from dflash_offline.progress import log

    cuda, trackers = torch.cuda.is_available(), available_trackers(cfg.trackers)
    if not cuda:
        from dflash_offline.devices import quiet_cpu_kernel_notes

        quiet_cpu_kernel_notes(log)
    # step_scheduler_with_optimizer=False: the schedule is in optimizer steps, whatever the number of processes
    acc = Accelerator(mixed_precision="no", cpu=not cuda, log_with=trackers or None, project_dir=str(cfg.run),
                      step_scheduler_with_optimizer=False)
    s = resolve_train(cfg, cuda=cuda, world=acc.num_processes, seq_len=seq_len, rows=rows, switches=switches)
    torch.backends.cuda.matmul.allow_tf32 = s.tf32  # after the Accelerator, which may set it (`run` puts it back)
    return acc, s, trackers


def recorded_settings(argv: list[str]) -> tuple[Callable | None, str]:
    """For `configs_from_argv`: a resume (`--resume=1`) given no `--recipe` whose RUN/config.json exists continues
    with the settings recorded there — the cache as the run named it where it is still there, else the absolute path
    recorded beside (`export.run_cache`), its target likewise — under those of the command line (its `steps` or
    `epochs` replacing both); None otherwise (a recipe given is read as always: a changed setting is then logged and
    the earlier config kept).
    Without it, `make train RUN= RESUME=1` resumed a run under the Makefile's default recipe. Returns (the
    `defaults` function or None, a note of where the settings came from: `run` logs it once the run is the trainer's,
    `stages.train` adds it to a setting refused; '' with None)."""
    import json

    from dflash_offline.config import ConfigError, _coerce, parse_overrides, setting_names
    from dflash_offline.export import run_cache

    try:
        recipe, given = parse_overrides(argv)
        resume = _coerce("resume", given.get("resume") or "0", bool)
    except ConfigError:  # (--help, or a malformed argument: configs_from_argv answers it)
        return None, ""
    if recipe or not resume or not given.get("run"):
        return None, ""
    path = Path(given["run"]) / "config.json"
    if not path.is_file():
        return None, ""
    try:
        rec = json.loads(path.read_text())
        train = {k: v for k, v in rec["train"].items() if k in setting_names(TrainConfig) and k != "resume"}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"train: {path} is not a run's config ({type(e).__name__}: {e}): a resume given no --recipe "
                          f"takes its settings from it; pass --recipe= (make RECIPE=) with the run's recipe") from None
    if not given.get("cache"):
        cache = run_cache(rec)
        if cache is None:
            named = ", ".join(dict.fromkeys(c for c in (train.get("cache"), rec.get("cache_dir")) if c))
            raise ConfigError(f"train: the cache {path} records ({named or 'none'}) is not there: pass the run's cache "
                              f"with --cache= (make CACHE=)")
        train["cache"] = cache
    here, there = train.get("target"), rec.get("target")  # (named from where the run began: the absolute path beside)
    if here and not given.get("target") and not Path(here).exists() and isinstance(there, str) and there \
            and Path(there).is_dir():
        train["target"] = there
    if {"steps", "epochs"} & set(given):  # (a longer run: the length given, not half of it recorded)
        train.pop("steps", None)
        train.pop("epochs", None)

    def fill(section, values, earlier) -> None:
        for k, v in train.items():
            values.setdefault(k, v)

    mine = sorted(k for k, v in given.items() if v != "" and k not in ("resume", "run"))  # (empty: not given)
    return fill, (f"resuming with the settings {path} records (no --recipe given)"
                  + (f"; from the command line: {', '.join(mine)}" if mine else ""))


# (a resume says resume=1; a longer run is what a resume is for; the run is this one, however its path was spelt)
IGNORED_ON_RESUME = {"resume", "steps", "epochs", "run"}
# a path setting the same as before when the absolute path recorded beside it is (named from another directory)
SAME_WHERE = {"cache": "cache_dir", "target": "target"}


def keep_earlier_config(run_dir: Path, resolved: dict, start: Path, log) -> None:
    """A resume whose settings differ from those RUN/config.json records: the earlier file is kept as
    config.until-<step>.json (the steps before were trained with it) and the differences are logged."""
    import json

    old_path = run_dir / "config.json"
    try:
        old = json.loads(old_path.read_text())
    except (OSError, ValueError):
        return
    before, now = old.get("train", {}), resolved["train"]
    moved = {k for k, top in SAME_WHERE.items() if old.get(top) and old.get(top) == resolved.get(top)}
    changed = sorted(k for k in set(before) | set(now)
                     if k not in IGNORED_ON_RESUME | moved and before.get(k) != now.get(k))
    if not changed:
        return
    step = start.name.removeprefix("step-")
    if not (run_dir / f"config.until-{step}.json").exists():  # (a second resume from that step: the first is the truth)
        write_json_atomic(run_dir / f"config.until-{step}.json", old)
    log(f"resumed with other settings than {old_path}: "
        + ", ".join(f"{k} {before.get(k)!r} → {now.get(k)!r}" for k in changed)
        + f"; the earlier config is kept as config.until-{step}.json")


def write_resolved(cfg: TrainConfig, s: TrainSetup, dc, c: dict, cache_key: str, run_dir: Path, start=None) -> None:
    """RUN/config.json (the resolved config, what it means here, the cache's projection) and the run's P; logged. A
    resume with other settings keeps the earlier ones (`keep_earlier_config`)."""
    from dflash_offline.progress import log

    # the target and the cache as paths from anywhere: eval finds the target once the cache is deleted or moved
    where = {"target": str(Path(c["target"]).resolve()) if Path(c["target"]).exists() else c["target"],
             "cache_dir": str(Path(cfg.cache).resolve())}
    resolved = {"train": as_dict(cfg), "drafter": as_dict(dc), "derived": s.derived(cfg, cache_key), **where,
                "target_id": c["target_id"],  # (the cache's producer.target: eval checks its target against it)
                "template_kwargs": c["template_kwargs"],
                **({"projection": c["projection"]} if c.get("projection") else {})}
    if start is not None:
        keep_earlier_config(run_dir, resolved, start, log)
    write_json_atomic(run_dir / "config.json", resolved)  # a reader never sees half of it
    if c.get("projection"):  # the run keeps the P it trains on: export and eval then need no cache
        from dflash_offline.cache.projection_file import copy_to_run

        copy_to_run(c["projection"], run_dir)
    log(f"drafter {dc.num_layers}×(H {dc.hidden_size}, {dc.num_heads}/{dc.num_kv_heads} heads × "
        f"{dc.head_dim}, FFN {dc.intermediate_size}) on taps {dc.target_layer_ids}; {s.describe(cfg)}")
    log(s.describe_schedule(cfg, c["seq_len"]))


# --- model ---------------------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, s: TrainSetup, dc, target, device, log=None):
    """(the drafter, the target's frozen embedding, its frozen lm_head) on `device`; the drafter's linears in float8
    for an fp8 run (before sharding, the optimizer and compilation: torchao's order)."""
    import torch

    from dflash_offline.drafter import DFlashDrafter, load_target_embeddings

    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dc).to(device)
    if s.precision == "fp8":
        from dflash_offline.fp8 import convert

        convert(model, emulate=s.fp8_emulate, log=log)
    embed, head = load_target_embeddings(target)
    wdtype = torch.bfloat16 if s.bf16 else torch.float32
    return model, embed.to(device, wdtype).requires_grad_(False), head.to(device, wdtype).requires_grad_(False)
