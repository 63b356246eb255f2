"""Verify a hidden-state cache: re-hash every committed file, and recompute sampled rows with the target.

    python -m stages.verify --cache=DIR [--rows=2] [--tol=0.02] [--device=auto|cuda|cpu]

Checks exactly what training reads (N held to the token cache's count first): that every shard 0..N-1 is committed
and lists the one file training opens, `hidden-NNNNN.safetensors`; that this file's SHA-256 matches the manifest and
its header says it is that shard of this cache (key, encoding, projection), of the size, rows, layers and tensor
layout the manifest implies (`dataset.open_shard`, training's own check); that the token shard it was computed from
still hashes to the entry's `tokens_sha256`; and that `rows` sampled rows per shard equal a fresh
forward of the target within `tol` (the RMS over real tokens of each token's relative L2 error, per layer; FP8 and FP4 caches are held to
their round-trip bound, the encoding's `rel_tol`, where it is larger). A projected cache (`[extract] project_dims`) is compared
in its stored width: the fresh states are projected with the cache's P (its file checked against the manifest
first), z = h @ P in fp32 as extraction computes it, so the same tolerances hold. The verdict goes into the manifest (`verified`), which
training reads: a cache that failed is refused. Every bad shard is named with the command that redoes it; shards not
committed yet (an extraction unfinished or running) are named apart, with the command that finishes it. Exit status 1
if any is bad or not committed.
The verdict records what it judged (`seen`: each shard's `committed_at` as it read them): a shard (re)committed later
— a repair, or one not committed then — is no longer judged by it (`manifest.verdict_now`): training and `make status`
then ask for `make verify`, not for the shard to be redone.
Verify reads only, then records: on a read-only cache it prints the verdict all the same and says it is not recorded.

Three phases (their checks are `dflash_offline/verification.py`'s), each timed in the verdict (`phase_seconds`) and in
the last line printed:
- hash: every file hashed on a bounded pool of threads (hashlib releases the GIL: reads and hashing overlap);
- load: the target (transformers' modules, then the weights), once;
- recompute: the sampled rows of all shards are gathered into batches of the extraction's `batch_rows` rows, one
  forward per batch, the last batch padded as extraction pads it: one shape, the extraction's, so on CUDA the
  compiled pieces come from the compile caches the extraction left; the next batch's stored rows are read on a side
  thread while the current one runs.
`device=cuda` without CUDA is refused before anything is read; `auto` takes CUDA where there is one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dflash_offline.cache.manifest import (
    MANIFEST,
    NOT_COMMITTED,
    hidden_num_shards,
    read_manifest,
    require,
    shard_list,
    shard_stamps,
    token_cache,
    update_manifest,
)
from dflash_offline.cli import private_compile_caches, unbuffered
from dflash_offline.config import VerifyConfig, config_from_argv
from dflash_offline.devices import pick_device
from dflash_offline.progress import log
from dflash_offline.verification import check_files, recompute, sample_rows

# --- the run -------------------------------------------------------------------------------------------------


# what verify reads of a hidden cache's manifest, beyond what opening it for training does (`dataset.HIDDEN_NEEDS`)
VERIFY_NEEDS = ("config.layer_ids", "config.extract.batch_rows")


def verify(cache: Path, cfg: VerifyConfig) -> dict:
    """The verdict on `cache`, recorded in its manifest where the cache is writable (`record`). Reads only until then:
    a read-only cache is verified all the same."""
    from dflash_offline.cache.encodings import ENCODINGS
    from dflash_offline.dataset import HIDDEN_NEEDS
    from dflash_offline.targetid import check_same_target, resolve_checkpoint

    device = pick_device(cfg.device, "verify.device")
    m = read_manifest(cache, kind="hidden")
    require(m, cache / MANIFEST, HIDDEN_NEEDS + VERIFY_NEEDS + (("config.extract.target",) if cfg.rows > 0 else ()))
    if m["producer"]["quant"] not in ENCODINGS:
        raise ValueError(f"{cache / MANIFEST}: producer.quant is {m['producer']['quant']!r}, this code reads "
                         f"{', '.join(ENCODINGS)}: extract the cache again with this code")
    tokens_dir = token_cache(cache, m)[0]
    n = hidden_num_shards(cache, m, read_manifest(tokens_dir))  # a count edited into the manifest: refused before hashing
    seen = shard_stamps(m, n)  # the shards this verdict judges: one (re)committed later is not covered by it
    # a missing target fails now, not after hours of hashing
    ckpt = resolve_checkpoint(cfg.target or m["config"]["extract"]["target"]) if cfg.rows > 0 else None
    if ckpt is not None:  # other weights would mark every shard bad in a shared cache's recorded verdict
        check_same_target(str(ckpt), m["producer"]["target"], str(cache), m["config"]["extract"]["target"], "verify")
    Ps = None  # a projected cache: its P per tapped layer (the file checked against the manifest), before any hashing
    if m["producer"].get("projection"):
        from dflash_offline.cache.projection_file import ProjectionError, read_projection

        try:
            Ps = read_projection(cache, m["config"]["layer_ids"], m.get("projection"))
        except ProjectionError as e:  # every shard depends on it: the verdict is recorded, no shard is worth redoing
            return record(cache, {"ok": False, "bad": [], "projection": str(e), "at": time.time(), "seen": seen,
                                  "rows_per_shard": cfg.rows, "max_rel_err": None, "seconds": 0.0, "phase_seconds": {}})
    t0 = time.time()
    bad = check_files(cache, m, tokens_dir)
    phases = {"hash": time.time() - t0, "load": 0.0, "recompute": 0.0}
    worst = None
    if cfg.rows > 0:
        import torch

        from dflash_offline.target import load_target

        t = time.time()
        model = load_target(ckpt, m["config"]["layer_ids"], device=device, dtype=torch.bfloat16, mode=cfg.mode)
        phases["load"] = time.time() - t
        t = time.time()
        picked = sample_rows(m, cfg.rows, {b["shard"] for b in bad})
        tol = max(cfg.tol, ENCODINGS[m["producer"]["quant"]].rel_tol)
        projection = [P.to(model.device) for P in Ps] if Ps is not None else None
        more, worst = recompute(cache, m, tokens_dir, model, picked, tol, m["config"]["extract"]["batch_rows"],
                                projection)
        phases["recompute"] = time.time() - t
        bad += more
    return record(cache, {"ok": not bad, "bad": bad, "at": time.time(), "seen": seen, "rows_per_shard": cfg.rows,
                          "max_rel_err": worst, "seconds": time.time() - t0, "phase_seconds": phases})


def record(cache: Path, verdict: dict) -> dict:
    """Write `verdict` into the manifest's `verified`; where the cache cannot be written (a read-only shared cache, a
    full disk), return it with `not_recorded` saying why instead of failing: the verdict stands either way."""
    try:
        update_manifest(cache, verified=verdict)
    except OSError as e:
        return dict(verdict, not_recorded=f"{e.strerror or e} ({e.filename or cache})")
    return verdict


def main(argv: list[str]) -> None:
    private_compile_caches()  # the packed path compiles on CUDA: reuse (and never race on) the extraction's caches
    unbuffered()
    cfg = config_from_argv(VerifyConfig, "verify", argv, __doc__)
    v = verify(Path(cfg.cache), cfg)
    try:
        report(cfg.cache, v)
    finally:  # after the verdict, whatever it is
        if why := v.get("not_recorded"):
            print(f"the verdict is not recorded in {cfg.cache}/{MANIFEST}: it cannot be written here ({why}); "
                  f"training with require_verified=1 will not see it: run make verify where the cache is writable")


def report(cache: str, v: dict) -> None:
    """Print the verdict: every bad shard and the command that redoes them (exit status 1), or one line."""
    if v.get("projection"):
        print(f"BAD projection: {v['projection']}")
        sys.exit(1)
    pending = {b["shard"] for b in v["bad"] if b["reason"] == NOT_COMMITTED}
    bad = [b for b in v["bad"] if b["shard"] not in pending]
    for b in bad:
        print(f"BAD shard {b['shard']}: {b['reason']}")
    took = f"{v['seconds']:.1f}s: " + ", ".join(f"{k} {s:.1f}s" for k, s in v["phase_seconds"].items())
    if pending:  # an extraction not finished (or still running): nothing to redo, its shards are to be made
        print(f"{len(pending)} shard(s) not committed yet ({shard_list(pending)}): the extraction has not finished; "
              f"`make extract CACHE={cache}` makes them (it continues where it stopped; if one is running, wait for "
              f"it), then run make verify again")
    if bad:
        shards = shard_list({b["shard"] for b in bad})
        print(f"{len(bad)} problem(s) ({took}). Redo them with: make extract CACHE={cache} SHARD={shards}")
    elif pending:
        print(f"({took})")
    if v["bad"]:
        sys.exit(1)
    err = f", max rel err {v['max_rel_err']:.2e}" if v["max_rel_err"] is not None else ""
    log(f"{cache}: every shard committed, hashed and matching{err} ({took})")


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
