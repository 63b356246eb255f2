"""How fast a resident training reads its cache onto the device (`--resident=1`: every row read once, checked against
its digest, and held there), by the number of reading threads, from the page cache and from the disk.

    python -m bench.resident [--cache=DIR | --rows=544 --shards=9 --quant=bf16] [--threads=1,2,4,8] [--repeats=2]
                             [--device=cuda] [--out=FILE.json]

Without `--cache` it writes a fake cache of the testbed's shape (`fixtures.fake_cache`: 2,048 tokens a row, 5 taps of
768; the testbed's bf16 cache is 537 rows in 9 shards, 8.5 GB) under `--dir` and removes it after. Each threads
count reads the whole cache `--repeats` times "cold" (its files dropped from the page cache first:
`posix_fadvise(DONTNEED)`, which needs no privilege but leaves pages another process dirtied) and as many times
"warm" (right after a read). A table last (GB/s, best of the repeats); JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from dflash_offline import dataset as ds
from dflash_offline.devices import usable_cpus
from fixtures.fake_cache import make_fake_cache

LAYERS = [1, 3, 5, 7, 9]


def drop_from_page_cache(root: Path) -> None:
    """Ask the kernel to drop `root`'s files from the page cache (clean pages only)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def open_cache(cache: Path):
    """The cache's `CacheInfo`, every tapped layer read."""
    from dflash_offline.cache.manifest import read_manifest

    return ds.open_hidden_cache(cache, read_manifest(cache)["producer"]["layer_ids"])


def read_once(cache: Path, threads: int, device: torch.device) -> dict:
    """One resident read of `cache` with `threads` threads: its `held_read` (bytes, seconds, …)."""
    chosen = ds.hold_threads
    ds.hold_threads = lambda shards: max(1, min(threads, shards))
    s = ds.HiddenStream(open_cache(cache), 1, 0, 1, 0, resident=True, device=device)
    try:
        next(s)
        return dict(s.held_read)
    finally:
        ds.hold_threads = chosen
        s.close()
        del s
        ds.release_kept_rows()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="", help="a hidden cache to read (default: write a fake one of --rows)")
    p.add_argument("--dir", default="build/bench-resident", help="a new or empty folder the fake cache is written in (removed after)")
    p.add_argument("--rows", type=int, default=544, help="the fake cache's rows (2,048 tokens each)")
    p.add_argument("--shards", type=int, default=9, help="the fake cache's shards")
    p.add_argument("--quant", default="bf16", choices=["bf16", "fp8", "fp4"], help="the fake cache's encoding")
    p.add_argument("--threads", default="1,2,4,8", help="reading threads to time (comma-separated)")
    p.add_argument("--repeats", type=int, default=2, help="reads per threads count and page-cache state")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the rows are held")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    made = not args.cache
    cache = Path(args.cache) if args.cache else Path(args.dir) / "hidden"
    if made:
        if Path(args.dir).exists() and any(Path(args.dir).iterdir()):
            raise SystemExit(f"--dir={args.dir} holds files: give a new or empty folder (the bench removes it after)")
        t0 = time.perf_counter()
        per = -(-args.rows // args.shards)
        rows = [min(per, args.rows - i * per) for i in range(args.shards) if args.rows > i * per]
        make_fake_cache(cache, len(rows), rows, 2048, 768, LAYERS, args.quant, seed=0)
        print(f"fake cache: {args.rows} rows in {len(rows)} shards ({args.quant}) written in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    results = {"cache": str(cache), "device": str(device), "cpus": len(os.sched_getaffinity(0)), "usable_cpus": usable_cpus(), "runs": []}
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            for state in ("cold", "warm"):
                for _ in range(args.repeats):
                    if state == "cold":
                        drop_from_page_cache(cache)
                        drop_from_page_cache(open_cache(cache).tokens_dir)  # (a real cache's may lie elsewhere)
                    r = read_once(cache, threads, device)
                    r.update(threads_asked=threads, state=state, gb_s=r["bytes"] / 1e9 / r["seconds"])
                    results["runs"].append(r)
                    print(f"threads {threads} ({r['threads']} used), {state}: {r['bytes'] / 1e9:.2f} GB in "
                          f"{r['seconds']:.2f}s = {r['gb_s']:.2f} GB/s", flush=True)
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n| threads | cold GB/s | warm GB/s |   ({results['cpus']} CPUs, held on {device})\n|---|---|---|")
    for threads in sorted({r["threads_asked"] for r in results["runs"]}):
        best = {st: max(r["gb_s"] for r in results["runs"] if r["threads_asked"] == threads and r["state"] == st)
                for st in ("cold", "warm")}
        print(f"| {threads} | {best['cold']:.2f} | {best['warm']:.2f} |")
    return results


if __name__ == "__main__":
    main()
