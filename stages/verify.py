"""Verify a hidden-state cache: re-hash every committed file, and recompute sampled rows with the target.

    python -m stages.verify --cache=DIR [--rows=2] [--tol=0.02] [--device=auto|cuda|cpu]

Checks exactly what training reads (N held to the token cache's count first): that every shard 0..N-1 is committed
and lists the one file training opens, `hidden-NNNNN.safetensors`; that this file's SHA-256 matches the manifest and
its header says it is that shard of this cache (key, encoding, projection), of the size, rows, layers and tensor
layout the manifest implies (`dataset.open_shard`, training's own check); that the token shard it was computed from
still hashes to the entry's `tokens_sha256`; and that `rows` sampled rows per shard equal a fresh
forward of the target within `tol` (relative L2 error over real tokens, per layer; FP8 and FP4 caches are held to
their round-trip bound, the encoding's `rel_tol`, where it is larger). A projected cache (`[extract] project_dims`) is compared
in its stored width: the fresh states are projected with the cache's P (its file checked against the manifest
first), z = h @ P in fp32 as extraction computes it, so the same tolerances hold. The verdict goes into the manifest (`verified`), which
training reads: a cache that failed is refused. Every bad shard is named with the command that redoes it. Exit status 1 if any is bad.
Verify reads only, then records: on a read-only cache it prints the verdict all the same and says it is not recorded.

Three phases, each timed in the verdict (`phase_seconds`) and in the last line printed:
- hash: every file hashed on a bounded pool of threads (hashlib releases the GIL: reads and hashing overlap);
- load: the target (transformers' modules, then the weights), once;
- recompute: the sampled rows of all shards are gathered into batches of the extraction's `batch_rows` rows, one
  forward per batch, the last batch padded as extraction pads it: one shape, the extraction's, so on CUDA the
  compiled pieces come from the compile caches the extraction left; the next batch's stored rows are read on a side
  thread while the current one runs.
`device=cuda` without CUDA is refused before anything is read; `auto` takes CUDA where there is one.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dflash_offline.cache.fsio import HASH_THREADS, sha256_file
from dflash_offline.cache.manifest import (
    MANIFEST,
    committed,
    hidden_num_shards,
    read_manifest,
    require,
    token_cache,
    update_manifest,
)
from dflash_offline.config import VerifyConfig, config_from_argv, shard_list
from dflash_offline.devices import pick_device
from dflash_offline.progress import log, private_compile_caches, unbuffered

# --- hash ----------------------------------------------------------------------------------------------------


def check_files(cache: Path, m: dict, tokens_dir: Path) -> list[dict]:
    """Every shard 0..N-1 checked as training reads it: committed, listing exactly the file training opens
    (`dataset.entry_error`), that file's SHA-256, header and size, rows and tensor layout against the manifest
    (`dataset.open_shard`), and the token shard it was computed from hashed against the entry's `tokens_sha256`.
    N is held to the token cache's count first (`hidden_num_shards`)."""
    from dflash_offline.cache.shards import hidden_shard_name, token_shard_name
    from dflash_offline.dataset import cache_info, entry_error

    n, done = hidden_num_shards(cache, m, read_manifest(tokens_dir)), committed(m)
    info = cache_info(cache, m, m["producer"]["layer_ids"], n)
    paths = [p for i in range(n) if i in done for p in (cache / hidden_shard_name(i), tokens_dir / token_shard_name(i))]
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="verify-hash") as pool:
        sha = dict(zip(paths, pool.map(file_sha256, paths), strict=True))
    bad = []
    for i in range(n):
        why = "not committed" if i not in done else entry_error(done[i], i) or shard_error(info, m, i, sha)
        if why:
            bad.append({"shard": i, "reason": why})
        elif sha[tokens_dir / token_shard_name(i)] != done[i]["tokens_sha256"]:
            bad.append({"shard": i, "reason": "computed from other tokens than the token cache now holds"})
    return bad


def shard_error(info, m: dict, index: int, sha: dict) -> str | None:
    """Why hidden shard `index`'s file is not what its (committed, well-formed) entry says, or None."""
    from dflash_offline.cache.shards import ShardError, hidden_shard_name
    from dflash_offline.dataset import open_shard

    path, rec = info.cache_dir / hidden_shard_name(index), info.shard_files[index]
    if sha[path] is None:
        return f"{path.name} is missing"
    if sha[path] != rec["sha256"]:
        return f"{path.name} does not match its checksum"
    if why := header_mismatch(path, index, m):
        return f"{path.name} {why}"
    try:  # size, header checksum, rows, layers and tensor layout: what training checks when it opens the shard
        open_shard(info, index).close()
    except ShardError as e:
        return f"{path.name} {str(e).removeprefix(f'{path} ').split(': the cache was damaged')[0]}"
    return None


def header_mismatch(path: Path, index: int, m: dict) -> str | None:
    """What a hidden shard's header says it is (index, cache key, encoding and, projected, the projection's SHA-256)
    where the manifest says otherwise: a file moved in from another cache, or computed with another P."""
    from dflash_offline.cache.shards import ShardError, hidden_metadata, hidden_shard_metadata

    try:
        meta = hidden_metadata(path)
    except ShardError as e:
        return f"is not a hidden shard of this code's format ({e})"
    projection = (m.get("projection") or {}).get("sha256") if m["producer"].get("projection") else None
    want = {k: str(v) for k, v in hidden_shard_metadata(index, m["key"], projection).items()}
    want["quant"] = m["producer"]["quant"]
    have = {k: meta.get(k) for k in want}
    return None if have == want else f"says it is {have}, the manifest {want}"


def file_sha256(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


# --- recompute -----------------------------------------------------------------------------------------------


def sample_rows(m: dict, rows: int, skip: set[int]) -> list[tuple[int, int]]:
    """(shard, row) of every row to recompute, in shard order: the same rows for the same cache every time."""
    done = committed(m)
    out = []
    for i in range(m["num_shards"]):
        if i in skip:
            continue
        n = done[i]["rows"]  # = the token shard's rows (its checksum matched the one extraction read)
        out += [(i, r) for r in sorted(random.Random(f"{m['key']}:{i}").sample(range(n), min(rows, n)))]
    return out


def read_batch(cache: Path, tokens_dir: Path, layer_ids: list[int], picked: list[tuple[int, int]], b: int):
    """Token rows [b, S] per column (rows past `picked` are padding), and the stored rows [1, S, K*H] on the CPU."""
    from dflash_offline.cache.shards import (
        ROW_FILL,
        hidden_shard_name,
        read_hidden,
        read_token_shard,
        token_shard_name,
    )

    toks = {i: read_token_shard(tokens_dir / token_shard_name(i)) for i in dict.fromkeys(i for i, _ in picked)}
    S = next(iter(toks.values()))["input_ids"].shape[1]
    rows = {k: np.full((b, S), fill, dtype=toks[picked[0][0]][k].dtype) for k, fill in ROW_FILL}
    for j, (i, r) in enumerate(picked):
        for k in rows:
            rows[k][j] = toks[i][k][r]
    stored = [read_hidden(cache / hidden_shard_name(i), layer_ids, rows=slice(r, r + 1)) for i, r in picked]
    return rows, stored


def recompute(cache: Path, m: dict, tokens_dir: Path, model, picked: list[tuple[int, int]], tol: float,
              batch_rows: int, projection: list | None = None) -> tuple[list, float]:
    """Compare the stored rows `picked` with the target's, `batch_rows` rows per forward: (bad rows, worst error).
    `projection`: P of each tapped layer on the model's device (a projected cache), applied to the fresh states."""
    import torch

    from dflash_offline.cache.shards import ROW_FILL

    layer_ids, device = m["config"]["layer_ids"], model.device
    batches = [picked[s:s + batch_rows] for s in range(0, len(picked), batch_rows)]
    bad, worst = [], 0.0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-read") as io:  # file reads only, no compute
        ahead = io.submit(read_batch, cache, tokens_dir, layer_ids, batches[0], batch_rows) if batches else None
        for n, batch in enumerate(batches):
            rows, stored = ahead.result()
            if n + 1 < len(batches):
                ahead = io.submit(read_batch, cache, tokens_dir, layer_ids, batches[n + 1], batch_rows)
            taps = model.tapped_layers(*(torch.from_numpy(rows[k]) for k, _ in ROW_FILL))  # rows stay on the host
            for j, (i, r) in enumerate(batch):
                real = torch.from_numpy(rows["doc_ids"][j] >= 0).to(device)
                fresh = torch.cat([t[j] if projection is None else t[j].float() @ P
                                   for t, P in zip(taps, projection or [None] * len(taps), strict=True)], dim=-1)
                for lid, err in zip(layer_ids, layer_errors(stored[j][0].to(device)[real], fresh[real],
                                                            len(layer_ids)), strict=True):
                    worst = max(worst, err)
                    if not err <= tol:  # also catches NaN
                        bad.append({"shard": i, "reason": f"row {r} layer {lid}: rel err {err:.3g} > {tol}"})
            del taps
    return bad, worst


def layer_errors(a, b, k: int) -> list[float]:
    a, b = a.float().chunk(k, dim=-1), b.float().chunk(k, dim=-1)
    return [((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(a, b, strict=True)]


# --- the run -------------------------------------------------------------------------------------------------


# what verify reads of a hidden cache's manifest, beyond what opening it for training does (`dataset.HIDDEN_NEEDS`)
VERIFY_NEEDS = ("config.layer_ids", "config.extract.batch_rows")


def verify(cache: Path, cfg: VerifyConfig) -> dict:
    """The verdict on `cache`, recorded in its manifest where the cache is writable (`record`). Reads only until then:
    a read-only cache is verified all the same."""
    from dflash_offline.cache.encodings import ENCODINGS
    from dflash_offline.dataset import HIDDEN_NEEDS
    from dflash_offline.targetid import resolve_checkpoint

    device = pick_device(cfg.device, "verify.device")
    m = read_manifest(cache)
    if m["kind"] != "hidden":
        raise ValueError(f"{cache} is a {m['kind']} cache; verify checks hidden-state caches (make extract output)")
    require(m, cache / MANIFEST, HIDDEN_NEEDS + VERIFY_NEEDS + (("config.extract.target",) if cfg.rows > 0 else ()))
    if m["producer"]["quant"] not in ENCODINGS:
        raise ValueError(f"{cache / MANIFEST}: producer.quant is {m['producer']['quant']!r}, this code reads "
                         f"{', '.join(ENCODINGS)}: extract the cache again with this code")
    tokens_dir = token_cache(cache, m)[0]
    hidden_num_shards(cache, m, read_manifest(tokens_dir))  # a count edited into the manifest: refused before hashing
    # a missing target fails now, not after hours of hashing
    ckpt = resolve_checkpoint(cfg.target or m["config"]["extract"]["target"]) if cfg.rows > 0 else None
    Ps = None  # a projected cache: its P per tapped layer (the file checked against the manifest), before any hashing
    if m["producer"].get("projection"):
        from dflash_offline.projection import ProjectionError, read_projection

        try:
            Ps = read_projection(cache, m["config"]["layer_ids"], m.get("projection"))
        except ProjectionError as e:  # every shard depends on it: the verdict is recorded, no shard is worth redoing
            return record(cache, {"ok": False, "bad": [], "projection": str(e), "at": time.time(),
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
    return record(cache, {"ok": not bad, "bad": bad, "at": time.time(), "rows_per_shard": cfg.rows,
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
    for b in v["bad"]:
        print(f"BAD shard {b['shard']}: {b['reason']}")
    took = f"{v['seconds']:.1f}s: " + ", ".join(f"{k} {s:.1f}s" for k, s in v["phase_seconds"].items())
    if v["bad"]:
        shards = shard_list({b["shard"] for b in v["bad"]})
        print(f"{len(v['bad'])} problem(s) ({took}). Redo them with: make extract CACHE={cache} SHARD={shards}")
        sys.exit(1)
    err = f", max rel err {v['max_rel_err']:.2e}" if v["max_rel_err"] is not None else ""
    log(f"{cache}: every shard committed, hashed and matching{err} ({took})")


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
