"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

`run_dir/checkpoints/step-{step:08d}/`:

| file | holds |
| --- | --- |
| `model.safetensors` | the drafter's state_dict (unwrapped from DDP / torch.compile), as trained (fp32 master weights, also when the model computes with bf16 copies: `full_precision_state_dict`) |
| `optimizer.safetensors` | every optimizer state tensor, `state.{param_index}.{name}` |
| `optimizer.json` | `param_groups` and non-tensor state (`scalars.{param_index}.{name}`) |
| `scheduler.json` | `scheduler.state_dict()` (LambdaLR with a plain function or lambda: JSON-able) |
| `rng.safetensors` | torch CPU RNG state (`torch.cpu`), CUDA RNG state per device (`torch.cuda.{i}`), uint8 |
| `rng.json` | python `random` and numpy global RNG states |
| `data.json` | the data stream's `state_dict()` |
| `meta.json` | format, step, time, config, extra, torch version, byte size and SHA-256 of every file (written last) |

A checkpoint is written into a temp directory beside it, every file fsynced, then the directory is renamed into place:
a directory named `step-*` is complete. `latest` (written atomically) names the newest. The last `keep_last`
checkpoints (by save time) are kept; older ones are deleted only after the new one is complete. A save that fails
(a full disk: one `OSError` line, whether Python or safetensors hit it) leaves the previous checkpoints and `latest`
as they were.

Resuming (`intact_checkpoint`, `load_checkpoint`) checks every file against the SHA-256 recorded when it was saved:
a damaged newest checkpoint (a flipped bit) is skipped, said so, for the newest intact earlier one; none intact is
one error line. (Checkpoints saved before the digests were recorded are checked by size only.)

Multi-process runs: call `save_checkpoint` on the main process only (DDP keeps model and optimizer identical on every
rank) and `load_checkpoint` on every rank. FSDP (sharded) runs: every rank calls `gather_full_state` (a collective),
the main process passes its result to `save_checkpoint(states=...)`; `load_checkpoint(..., sharded=True)` on every
rank gives each its shard. The files are the same either way (full tensors, optimizer state by parameter index in
`named_parameters()` order), so a sharded run resumes unsharded and the other way round. The RNG saved is the saving process's; randomness that must differ per rank
and survive a resume should come from explicit generators seeded from (seed, rank, step).
"""

from __future__ import annotations

import errno
import json
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .cache.fsio import atomic_dir, hash_obj, publish, remove_dir, sha256_file, temp_path

FORMAT = "dflash-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the objects it is loaded into."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP / DataParallel (accelerate's wrappers) and torch.compile."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def step_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


# --- save ----------------------------------------------------------------------------------------------------


def gather_full_state(model, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state by parameter index) as full CPU tensors, from FSDP-sharded (DTensor)
    parameters: a collective, call it on every rank; the main process gets the tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = unwrap(model)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return msd, {"state": {index[k]: v for k, v in osd.get("state", {}).items()},
                 "param_groups": [dict(g, params=[index[p] for p in g["params"]]) for g in osd.get("param_groups", [])]}


def save_checkpoint(run_dir, step: int, model, optimizer=None, scheduler=None, data_state: dict | None = None,
                    rng: bool = True, extra: dict | None = None, config: dict | None = None,
                    keep_last: int | None = 3, states: tuple[dict, dict] | None = None) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, prune to the newest `keep_last`; returns its dir.
    `states`: (model, optimizer) state dicts from `gather_full_state` instead of the objects' own (FSDP)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(run_dir, step)
    with atomic_dir(final) as tmp:  # saving a step again (after resuming from an earlier one) replaces it
        files = _write_all(tmp, model, optimizer, scheduler, data_state, rng, states)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "time": time.time(),
                "config": config, "extra": extra or {}, "torch": torch.__version__,
                "files": {name: (tmp / name).stat().st_size for name in files},
                "sha256": sha256_files(tmp, files)}
        _write_json(tmp / "meta.json", meta, "meta (config/extra)")
    latest = root / LATEST
    t = temp_path(latest)
    t.write_text(final.name + "\n")
    publish(t, latest)
    if keep_last:
        for _, _, path in list_checkpoints(run_dir)[:-keep_last]:
            if path != final:  # (a kill mid-delete never leaves a half checkpoint under its name)
                remove_dir(path)
    return final


def sha256_files(d: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each file, on a thread each (hashlib releases the GIL: the optimizer's file, the largest, no longer
    waits for the model's)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(d / n), names), strict=True))


def _write_all(d: Path, model, optimizer, scheduler, data_state, rng: bool, states=None) -> list[str]:
    model_sd = states[0] if states else full_precision_state_dict(model, optimizer)
    sd = {k: v.detach().cpu().contiguous() for k, v in model_sd.items()}
    _write_tensors(d / "model.safetensors", sd)
    files = ["model.safetensors"]
    if optimizer is not None:
        tensors, blob = optimizer_to_files(states[1] if states else optimizer.state_dict())
        _write_tensors(d / "optimizer.safetensors", tensors)
        _write_json(d / "optimizer.json", blob, "optimizer param_groups/state")
        files += ["optimizer.safetensors", "optimizer.json"]
    if scheduler is not None:
        _write_json(d / "scheduler.json", scheduler.state_dict(), "scheduler.state_dict() (use a plain lr function)")
        files.append("scheduler.json")
    if rng:
        tensors, blob = rng_state()
        _write_tensors(d / "rng.safetensors", tensors)
        _write_json(d / "rng.json", blob, "rng")
        files += ["rng.safetensors", "rng.json"]
    _write_json(d / "data.json", data_state, "data_state")
    return files + ["data.json"]



def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # under accelerate's AcceleratedOptimizer


def full_precision_state_dict(model, optimizer=None) -> dict[str, torch.Tensor]:
    """The model's state_dict with the optimizer's fp32 master weights where it keeps them (optim.MasterAdamW):
    checkpoints always hold the weights as trained, whatever the model computes in."""
    inner = _inner(optimizer)
    if hasattr(inner, "master_state_dict"):
        return inner.master_state_dict(unwrap(model))
    return unwrap(model).state_dict()


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors' writer; its I/O failures (Rust errors, not OSError) become the OSError they are, so that a full
    disk reads as one line (`cli.run_cli`) like any other failed write."""
    try:
        save_file(tensors, str(path), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    except SafetensorError as e:
        full = "StorageFull" in str(e) or "code: 28" in str(e) or "No space left" in str(e)
        raise OSError(errno.ENOSPC if full else errno.EIO, f"{'No space left on device' if full else 'I/O error'} "
                      f"(safetensors: {e})", str(path)) from None


def _write_json(path: Path, obj, what: str) -> None:
    try:
        text = json.dumps(obj, sort_keys=True, indent=1, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-able ({e}); checkpoints hold no pickle") from None
    path.write_text(text + "\n")  # (fsynced with the directory by atomic_dir)


def optimizer_to_files(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """optimizer.state_dict() → (tensors `state.{i}.{name}`, JSON blob of param_groups + non-tensor state)."""
    tensors, scalars = {}, {}
    for i, state in sd["state"].items():
        for name, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{i}.{name}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(i), {})[name] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = s
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    blob = {"python": [version, list(mt), gauss],
            "numpy": [kind, key.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, blob


# --- load ----------------------------------------------------------------------------------------------------


def list_checkpoints(run_dir) -> list[tuple[float, int, Path]]:
    """Complete checkpoints as (save time, step, dir), by step (not by save time: a machine's clock may run behind
    the one that saved the earlier steps)."""
    root = Path(run_dir) / "checkpoints"
    out = []
    for d in root.glob("step-*") if root.is_dir() else []:
        try:
            meta = json.loads((d / "meta.json").read_text())
            if any((d / name).stat().st_size != size for name, size in meta.get("files", {}).items()):
                continue  # a file it lists is not there whole
            out.append((float(meta["time"]), int(meta["step"]), d))
        except (OSError, ValueError, KeyError, AttributeError):
            continue  # not a complete checkpoint
    return sorted(out, key=lambda x: (x[1], x[0]))


def find_checkpoint(run_dir, step: int | None = None) -> Path:
    root = Path(run_dir) / "checkpoints"
    complete = list_checkpoints(run_dir)
    have = ", ".join(str(s) for _, s, _ in complete) or "none"
    if step is not None:
        d = step_dir(run_dir, step)
    else:  # `latest`, unless it names a checkpoint that is gone or not whole (a kill while re-saving it, a damaged file)
        d = root / (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
        if (d is None or d not in {c for _, _, c in complete}) and complete:
            d = complete[-1][2]  # the newest whole one
        elif d is None:
            raise CheckpointError(f"no checkpoint under {root} yet: train the run first (make train RUN=), or start "
                                  f"a new run without resuming (export and eval read its checkpoints)")
    if not (d / "meta.json").is_file():
        raise CheckpointError(f"{d} is not a complete checkpoint; steps available: {have}")
    return d


def damage(d: Path, only: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with checkpoint `d`'s files against its meta.json (missing, resized, SHA-256 differs; the
    digests of `only` these, if given), or None when they are as saved."""
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    for name, size in meta.get("files", {}).items():
        if not (d / name).is_file() or (d / name).stat().st_size != size:
            return f"{name} is missing or truncated (expected {size} bytes)"
    want = {n: h for n, h in meta.get("sha256", {}).items() if only is None or n in only}
    got = sha256_files(d, list(want))
    return next((f"{n} differs from the SHA-256 recorded when it was saved" for n in want if got[n] != want[n]), None)


def my_share(d: Path, rank: int, world: int) -> tuple[str, ...] | None:
    """The files whose digests process `rank` of `world` checks (largest first, dealt round-robin): the processes of a
    run read each file once between them, not once each. None: all of them (one process)."""
    if world == 1:
        return None
    try:
        names = sorted(json.loads((d / "meta.json").read_text()).get("sha256", {}))
    except (OSError, ValueError):
        return ()  # (damage() says so on every rank)
    names.sort(key=lambda n: -(d / n).stat().st_size if (d / n).is_file() else 0)
    return tuple(names[rank::world])


def intact_checkpoint(run_dir, step: int | None = None, log=print, rank: int = 0, world: int = 1,
                      reduce_max=None) -> Path:
    """Checkpoint `step`, or the newest whose files are as saved: a damaged newer one is skipped with a `log` line
    naming it and why. Raises one line when `step` is damaged or none is intact. The `world` processes of a run
    (`reduce_max(int) -> int`: the maximum over them, a collective) split the hashing between them and agree on one
    checkpoint; each says the damage it found itself."""
    agree = reduce_max or (lambda v: v)

    def judge(d: Path) -> str | None:
        why = damage(d, my_share(d, rank, world))
        return (why or "damaged (see the other processes' lines)") if agree(int(why is not None)) else None

    if step is not None:
        d = find_checkpoint(run_dir, step)
        if why := judge(d):
            raise CheckpointError(f"{d} is damaged: {why}; load another step (see {d.parent})")
        return d
    newest = find_checkpoint(run_dir)
    candidates = [newest] + [c for _, _, c in reversed(list_checkpoints(run_dir)) if c != newest]
    bad = []
    for d in candidates:
        if not (why := judge(d)):
            if bad:
                log(f"{bad[0][0]} is damaged ({bad[0][1]}): resuming from {d.name} instead"
                    + (f" ({len(bad) - 1} more damaged skipped)" if len(bad) > 1 else ""))
            return d
        bad.append((d, why))
    raise CheckpointError(f"no intact checkpoint under {Path(run_dir) / 'checkpoints'}: "
                          + "; ".join(f"{d.name}: {why}" for d, why in bad)
                          + "; restore one from a copy, or start the run again without --resume")


def resume_point(run_dir, log=print, rank: int = 0, world: int = 1, reduce_max=None) -> Path | None:
    """The checkpoint a resumed run starts from (`intact_checkpoint`), or None where the run holds none. Processes
    that see the same checkpoints (one collective checks it) split the hashing; where they do not (machines with
    their own RUN=), each checks its own whole, and the run is refused by `same_start_on_every_rank` if they would
    start from different steps."""
    found = [c.name for _, _, c in list_checkpoints(run_dir)]
    if world > 1 and reduce_max is not None:
        mine = int(hash_obj(found)[:15], 16)
        if reduce_max(mine) != -reduce_max(-mine):
            rank, world, reduce_max = 0, 1, None
    return intact_checkpoint(run_dir, log=log, rank=rank, world=world, reduce_max=reduce_max) if found else None


def load_checkpoint(run_dir, model, optimizer=None, scheduler=None, step: int | None = None,
                    rng: bool = True, sharded: bool = False, verify: bool = True, log=print) -> dict:
    """Restore model, optimizer, scheduler and (with `rng`) RNG states from `step` or the newest intact checkpoint.
    `sharded`: the model is FSDP-sharded; every rank reads the full tensors and keeps its shard. `verify=False`:
    the caller has just checked the checkpoint's digests (`intact_checkpoint`).

    Returns {"step", "data_state", "extra", "config", "dir"}.
    """
    d = intact_checkpoint(run_dir, step, log) if verify else find_checkpoint(run_dir, step)
    meta = _read_json(d, "meta.json")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{d}/meta.json: format {meta.get('format')!r} v{meta.get('format_version')!r}, "
                              f"this code reads {FORMAT!r} v{FORMAT_VERSION}")
    for name, size in meta["files"].items():
        if not (d / name).is_file() or (d / name).stat().st_size != size:
            raise CheckpointError(f"{d}/{name} is missing or truncated (expected {size} bytes); "
                                  f"load an older step (see {d.parent})")
    if sharded:
        _load_sharded(d, unwrap(model), getattr(optimizer, "optimizer", optimizer))
    else:
        try:
            unwrap(model).load_state_dict(_read_tensors(d, "model.safetensors"), strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{d}/model.safetensors does not fit this model: {e}") from None
    if optimizer is not None and not sharded:
        load_optimizer(d, optimizer)
        if hasattr(_inner(optimizer), "load_masters"):  # the exact fp32 weights (the model holds bf16 copies)
            _inner(optimizer).load_masters(unwrap(model), _read_tensors(d, "model.safetensors"))
    if scheduler is not None:
        scheduler.load_state_dict(_read_json(d, "scheduler.json"))
    if rng:
        set_rng_state(_read_tensors(d, "rng.safetensors"), _read_json(d, "rng.json"))
    return {"step": meta["step"], "data_state": _read_json(d, "data.json"), "extra": meta["extra"],
            "config": meta["config"], "dir": d}


def _read_tensors(d: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(d / name))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{d / name}: unreadable ({e}); load an older step") from None


def _read_json(d: Path, name: str):
    try:
        return json.loads((d / name).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d / name}: unreadable ({e}); load an older step") from None


def _load_sharded(d: Path, model, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, _read_tensors(d, "model.safetensors"), options=options)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{d}/model.safetensors does not fit this model: {e}") from None
    if optimizer is None:
        return
    state, groups = _optimizer_files(d)
    names = [name for name, _ in model.named_parameters()]
    try:
        groups = [{k: tuple(v) if isinstance(f.get(k), tuple) else v for k, v in g.items()}  # JSON made tuples lists
                  for g, f in zip(groups, optimizer.param_groups, strict=True)]
        osd = {"state": {names[i]: v for i, v in state.items()},
               "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in groups]}
        set_optimizer_state_dict(model, optimizer, osd, options=options)
    except (RuntimeError, KeyError, ValueError, IndexError) as e:
        raise CheckpointError(f"{d}/optimizer.* does not fit this optimizer: {e}") from None


def _optimizer_files(d: Path) -> tuple[dict[int, dict], list[dict]]:
    blob = _read_json(d, "optimizer.json")
    state: dict[int, dict] = {}
    for key, t in _read_tensors(d, "optimizer.safetensors").items():
        _, i, name = key.split(".", 2)
        state.setdefault(int(i), {})[name] = t
    for i, values in blob["scalars"].items():
        state.setdefault(int(i), {}).update(values)
    return state, blob["param_groups"]


def load_optimizer(d: Path, optimizer) -> None:
    state, saved_groups = _optimizer_files(d)
    fresh = optimizer.state_dict()["param_groups"]
    if len(fresh) != len(saved_groups):
        raise CheckpointError(f"{d}/optimizer.json has {len(saved_groups)} param groups, the optimizer {len(fresh)}")
    # JSON made tuples lists; the fresh group's keys stay where the saved one lacks them (a checkpoint written by
    # MasterAdamW has no 'fused'/'foreach' for torch's AdamW, and the other way round)
    groups = [{**f, **{k: tuple(v) if isinstance(f.get(k), tuple) else v for k, v in g.items()}}
              for g, f in zip(saved_groups, fresh, strict=True)]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{d}/optimizer.* does not fit this optimizer: {e}") from None


def set_rng_state(tensors: dict[str, torch.Tensor], blob: dict) -> None:
    torch.set_rng_state(tensors["torch.cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("torch.cuda.")),
                                       key=lambda k: int(k.rsplit(".", 1)[1]))]
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(cuda):
            warnings.warn(f"checkpoint holds CUDA RNG states of {len(cuda)} devices, this process sees {n}; "
                          f"restoring the first {min(n, len(cuda))}", stacklevel=2)
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, i)
    version, mt, gauss = blob["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, key, pos, has_gauss, cached = blob["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
