"""How many dimensions of each tapped layer a cache needs: retained energy and held-out loss of a top-k projection.

    python -m bench.projection --cache=build/testbed/cache/hidden [--ks=64,128,256,512] [--calib_shards=4]
                               [--heldout_shards=1] [--max_rows=256] [--out=FILE.json]

For each tapped layer of the cache: E[h hᵀ] accumulated in fp64 over the real (non-padding) tokens of the first
`calib_shards` shards (`dflash_offline.projection.measure_taps`), its eigen-decomposition, and for each k the share
of E‖h‖² its top-k directions keep on those rows and the share a projection onto them loses on the tokens of the
last `heldout_shards` shards (held out from the calibration). Also the bytes per token each k would store (bf16, and
fp8 with a per-token scale) against the cache's own. This is the measurement the projected-taps encoding starts
from (the drafter's τ per k is the testbed's to tell). A table last; JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_offline.cache.manifest import read_manifest
from dflash_offline.dataset import open_hidden_cache
from dflash_offline.projection import measure_taps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="hidden-state cache directory (make extract's output)")
    p.add_argument("--ks", default="32,64,128,256,512,1024", help="projection widths to report")
    p.add_argument("--calib_shards", type=int, default=4, help="shards the second moment is estimated on (the first)")
    p.add_argument("--heldout_shards", type=int, default=1, help="shards the loss is measured on (the last)")
    p.add_argument("--max_rows", type=int, default=256, help="rows read per shard at most")
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    info = open_hidden_cache(args.cache, read_manifest(Path(args.cache))["producer"]["layer_ids"])
    result = {"cache": str(args.cache), **measure_taps(info, [int(x) for x in args.ks.split(",")], args.calib_shards,
                                                       args.heldout_shards, args.max_rows)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


def print_table(result: dict) -> None:
    layers, stored = list(result["layers"]), result["bytes_per_token"]["cache"]
    ks = [k for k in result["bytes_per_token"] if k != "cache"]
    print(f"{result['cache']}: {len(layers)} taps × hidden {result['hidden_size']}, {result['quant']} ({stored:,.0f} "
          f"B/token); calibration shards {result['calib_shards']}, held out {result['heldout_shards']}")
    print(f"{'k':>6} {'bf16 B/tok':>11} {'fp8 B/tok':>10}  " + "  ".join(f"L{lid} kept / lost" for lid in layers))
    for k in ks:
        cells = [f"{result['layers'][lid]['retained'][k]:.4f} / "
                 f"{result['layers'][lid]['heldout_loss'].get(k, float('nan')):.4f}" for lid in layers]
        b = result["bytes_per_token"][k]
        print(f"{k:>6} {b['bf16']:>11,.0f} {b['fp8']:>10,.0f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
