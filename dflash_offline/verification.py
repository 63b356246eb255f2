"""Checking a hidden-state cache against its manifest and against the target: the helpers of `stages/verify.py`.

`check_files` holds every shard 0..N-1 to what training reads (N held to the token cache's count first): committed,
listing exactly the file training opens, that file's SHA-256, its header (`header_mismatch`: shard index, cache key,
encoding, projection) and size, rows and tensor layout (`dataset.open_shard`, training's own check), and the token
shard it was computed from hashed against the entry's `tokens_sha256`; files are hashed on a bounded pool of
threads (hashlib releases the GIL: reads and hashing overlap). `sample_rows` picks the rows to recompute (the same
for the same cache every time) and `recompute` compares them with a fresh forward of the target, `batch_rows` rows
per forward in the extraction's one shape, the next batch's stored rows read on a side thread (`read_batch`): the
RMS over real tokens of each token's relative L2 error, per layer (`layer_errors`); a projected cache is compared in its stored width.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .cache.fsio import HASH_THREADS, sha256_file
from .cache.manifest import NOT_COMMITTED, committed, hidden_num_shards, read_manifest

# --- hash ----------------------------------------------------------------------------------------------------


def check_files(cache: Path, m: dict, tokens_dir: Path) -> list[dict]:
    """Every shard 0..N-1 checked as training reads it: committed, listing exactly the file training opens
    (`dataset.entry_error`), that file's SHA-256, header and size, rows and tensor layout against the manifest
    (`dataset.open_shard`), and the token shard it was computed from hashed against the entry's `tokens_sha256`.
    N is held to the token cache's count first (`hidden_num_shards`)."""
    from .cache.shards import hidden_shard_name, token_shard_name
    from .dataset import cache_info, entry_error

    n, done = hidden_num_shards(cache, m, read_manifest(tokens_dir)), committed(m)
    info = cache_info(cache, m, m["producer"]["layer_ids"], n)
    paths = [p for i in range(n) if i in done for p in (cache / hidden_shard_name(i), tokens_dir / token_shard_name(i))]
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="verify-hash") as pool:
        sha = dict(zip(paths, pool.map(file_sha256, paths), strict=True))
    bad = []
    for i in range(n):
        why = NOT_COMMITTED if i not in done else entry_error(done[i], i) or shard_error(info, m, i, sha)
        if why:
            bad.append({"shard": i, "reason": why})
        elif sha[tokens_dir / token_shard_name(i)] != done[i]["tokens_sha256"]:
            bad.append({"shard": i, "reason": "computed from other tokens than the token cache now holds"})
    return bad


def shard_error(info, m: dict, index: int, sha: dict) -> str | None:
    """Why hidden shard `index`'s file is not what its (committed, well-formed) entry says, or None."""
    from .cache.shards import ShardError, hidden_shard_name
    from .dataset import open_shard

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
    from .cache.shards import ShardError, hidden_metadata, hidden_shard_metadata

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
    from .cache.shards import (
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

    from .cache.shards import ROW_FILL

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
    """Per layer of `k` ([tokens, k·H] stored `a` vs recomputed `b`): the RMS over tokens of each token's relative L2
    error. Not the row's ‖a − b‖ / ‖b‖: a few tokens of large norm (a Qwen target's attention sinks carry
    activations hundreds of times the others') would dominate it and hide altered values on every other token."""
    a, b = a.float().chunk(k, dim=-1), b.float().chunk(k, dim=-1)
    return [((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).square().mean().sqrt().item()
            for x, y in zip(a, b, strict=True)]
