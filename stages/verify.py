"""Verify a hidden-state cache: re-hash every committed file, and recompute sampled rows with the target.

    python -m stages.verify --cache=DIR [--rows=2] [--tol=0.02] [--device=cpu]

Checks that every shard 0..N-1 is committed, that each file's SHA-256 matches the manifest, that each hidden shard
still belongs to the token shard it was computed from, and that `rows` sampled rows per shard equal a fresh
forward of the target within `tol` (relative L2 error over real tokens, per layer; FP8 caches are held to
the FP8 round-trip bound instead). The verdict goes into the manifest (`verified`), which training reads: a cache
that failed is refused. Every bad shard is named with the command that redoes it. Exit status 1 if any is bad.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np

from dflash_offline.config import VerifyConfig, config_from_argv
from dflash_offline.manifest import committed, read_manifest, sha256_file, update_manifest
from dflash_offline.progress import log, private_compile_caches, unbuffered

FP8_REL_TOL = 0.06  # e4m3 keeps 3 mantissa bits: per-element rounding ≤ 6.25 %, RMS ≈ 2–3 %


def check_files(cache: Path, m: dict, tokens_dir: Path) -> list[dict]:
    bad = []
    done = committed(m)
    tokens = committed(read_manifest(tokens_dir))
    for i in range(m["num_shards"]):
        if i not in done:
            bad.append({"shard": i, "reason": "not committed"})
            continue
        for name, rec in done[i]["files"].items():
            path = cache / name
            if not path.is_file():
                bad.append({"shard": i, "reason": f"{name} is missing"})
            elif sha256_file(path) != rec["sha256"]:
                bad.append({"shard": i, "reason": f"{name} does not match its checksum"})
        tok = tokens.get(i)
        tok_sha = next(iter(tok["files"].values()))["sha256"] if tok else None
        if tok_sha != done[i].get("tokens_sha256"):
            bad.append({"shard": i, "reason": "computed from other tokens than the token cache now holds"})
    return bad


def recompute(cache: Path, m: dict, tokens_dir: Path, cfg: VerifyConfig, skip: set[int]) -> tuple[list, float]:
    import torch

    from dflash_offline.shards import hidden_shard_name, read_hidden, read_token_shard, token_shard_name
    from dflash_offline.target import load_target
    from dflash_offline.targetid import resolve_checkpoint

    layer_ids = m["config"]["layer_ids"]
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = load_target(resolve_checkpoint(cfg.target or m["config"]["extract"]["target"]), layer_ids,
                        device=device, dtype=torch.bfloat16, mode=cfg.mode)
    tol = max(cfg.tol, FP8_REL_TOL) if m["producer"]["quant"] == "fp8" else cfg.tol
    bad, worst = [], 0.0
    for i in range(m["num_shards"]):
        if i in skip:
            continue
        toks = read_token_shard(tokens_dir / token_shard_name(i))
        n = toks["input_ids"].shape[0]
        for r in sorted(random.Random(f"{m['key']}:{i}").sample(range(n), min(cfg.rows, n))):
            stored = read_hidden(cache / hidden_shard_name(i), layer_ids, rows=slice(r, r + 1), device=device)
            fresh = model.tapped_hidden_states(*(torch.from_numpy(np.array(toks[k][r:r + 1])).to(device)
                                                 for k in ("input_ids", "position_ids", "doc_ids")))
            real = torch.from_numpy(toks["doc_ids"][r] >= 0).to(device)
            for j, err in enumerate(layer_errors(stored[0][real], fresh[0][real], len(layer_ids))):
                worst = max(worst, err)
                if not err <= tol:  # also catches NaN
                    bad.append({"shard": i, "reason": f"row {r} layer {layer_ids[j]}: rel err {err:.3g} > {tol}"})
    return bad, worst


def layer_errors(a, b, k: int) -> list[float]:
    a, b = a.float().chunk(k, dim=-1), b.float().chunk(k, dim=-1)
    return [((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(a, b, strict=True)]


def verify(cache: Path, cfg: VerifyConfig) -> dict:
    m = read_manifest(cache)
    if m["kind"] != "hidden":
        raise ValueError(f"{cache} is a {m['kind']} cache; verify checks hidden-state caches (make extract output)")
    tokens_dir = (cache / m["config"]["tokens_dir"]).resolve()
    t0 = time.time()
    bad = check_files(cache, m, tokens_dir)
    worst = None
    if cfg.rows > 0:
        more, worst = recompute(cache, m, tokens_dir, cfg, {b["shard"] for b in bad})
        bad += more
    verdict = {"ok": not bad, "bad": bad, "at": time.time(), "rows_per_shard": cfg.rows,
               "max_rel_err": worst, "seconds": time.time() - t0}
    update_manifest(cache, verified=verdict)
    return verdict


def main(argv: list[str]) -> None:
    private_compile_caches()  # the packed path compiles on CUDA: reuse (and never race on) the extraction's caches
    unbuffered()
    cfg = config_from_argv(VerifyConfig, "verify", argv, __doc__)
    v = verify(Path(cfg.cache), cfg)
    for b in v["bad"]:
        print(f"BAD shard {b['shard']}: {b['reason']}")
    if v["bad"]:
        shards = ",".join(str(s) for s in sorted({b["shard"] for b in v["bad"]}))
        print(f"{len(v['bad'])} problem(s). Redo them with: make extract CACHE={cfg.cache} SHARD={shards}")
        sys.exit(1)
    err = f", max rel err {v['max_rel_err']:.2e}" if v["max_rel_err"] is not None else ""
    log(f"{cfg.cache}: every shard committed, hashed and matching{err} ({v['seconds']:.1f}s)")


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
