"""Benchmark the cache manifest at a full run's shard count: what each commit and claim costs under the cache's lock.

    python -m bench.manifest [--shards=24414 --rank_shards=100 --out=FILE]   (CPU; make bench-manifest: ~4 min)

A hidden cache of `--shards` entries (z-lab's scale at the Qwen3.5/3.6-27B recipes' 16 rows a shard: 24,414) as
extraction leaves it: each entry its file record, token count and timings. Timed, each the median of `--repeats`:
one schema-checked read (`read_manifest`), one commit (`commit_shard`: read, merge, write, fsync, under the lock),
a claim of a shard committed already (`try_claim`: what a rank pays for each shard it steps over); then rank 0's
run (of `--shards / --rank_shards` processes) with no compute: its stripe claimed and committed one shard at a time while the other ranks'
shards are committed already — the manifest's share of a rank's extraction, and what it pays to find nothing left. Results: a
table last, JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dflash_offline.cache import claims, fsio
from dflash_offline.cache import manifest as mf


def entry(i: int) -> dict:
    sha = f"{i:064x}"
    return {"index": i, "rows": 16, "tokens": 31_000, "tokens_sha256": sha, "status": "committed",
            "files": {f"hidden-{i:05d}.safetensors": {"bytes": 472_000_000, "sha256": sha, "header_sha256": sha}},
            "seconds": 5.6, "compute_seconds": 5.1, "write_seconds": 2.3, "committed_at": 1.76e9 + i}


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=24_414, help="entries in the manifest")
    ap.add_argument("--rank_shards", type=int, default=100,
                    help="shards in rank 0's stripe (its run's length): the processes are shards / this")
    ap.add_argument("--repeats", type=int, default=5, help="timings taken of each operation (the median reported)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    a = ap.parse_args(argv)
    a.world = max(1, a.shards // a.rank_shards)
    with tempfile.TemporaryDirectory() as d:
        cache = Path(d)
        m = mf.open_cache(cache, "hidden", "k" * 64, {}, {}, a.shards)
        fsio.write_json_atomic(cache / mf.MANIFEST, dict(m, shards=[entry(i) for i in range(a.shards - 1)]))
        res = {"shards": a.shards, "world": a.world,
               "manifest_mb": round((cache / mf.MANIFEST).stat().st_size / 1e6, 1),
               "read_s": timed(lambda: mf.read_manifest(cache), a.repeats),
               "commit_s": timed(lambda: mf.commit_shard(cache, entry(a.shards - 1)), a.repeats),
               "claim_committed_s": timed(lambda: claims.try_claim(cache, 1, lease_s=60), a.repeats)}
        # rank 0's run: its stripe left to do, every other shard committed by the other ranks meanwhile
        m = mf.read_manifest(cache)
        fsio.write_json_atomic(cache / mf.MANIFEST, dict(m, shards=[s for s in m["shards"] if s["index"] % a.world]))
        t, done = time.perf_counter(), []
        for claim, i in claims.claimed_shards(cache, list(range(a.shards)), lambda i: i, rank=0, world=a.world,
                                              lease_s=60, redo=False, wait_claims=False):
            mf.commit_shard(cache, entry(i))  # (as the shard writer does)
            claim.release()
            done.append(i)
        res["rank0_run_s"], res["rank0_shards"] = time.perf_counter() - t, len(done)
        res["rank0_per_shard_s"] = res["rank0_run_s"] / max(1, len(done))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"{'shards':>8} {'MB':>6} {'read s':>7} {'commit s':>9} {'claim (committed) s':>20} {'rank 0 s':>9} "
          f"{'its shards':>10} {'s a shard':>9}")
    print(f"{res['shards']:>8} {res['manifest_mb']:>6} {res['read_s']:>7.3f} {res['commit_s']:>9.3f} "
          f"{res['claim_committed_s']:>20.3f} {res['rank0_run_s']:>9.1f} {res['rank0_shards']:>10} {res['rank0_per_shard_s']:>9.3f}")
    return res


if __name__ == "__main__":
    main()
