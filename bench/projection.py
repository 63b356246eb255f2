"""How many dimensions of each tapped layer a cache needs: retained energy and held-out loss of a top-k projection.

    python -m bench.projection --cache=build/testbed/cache/hidden [--ks=64,128,256,512] [--calib_shards=4]
                               [--heldout_shards=1] [--max_rows=256] [--out=FILE.json]

For each tapped layer of the cache: E[h hᵀ] accumulated in fp64 over the real (non-padding) tokens of the first
`calib_shards` shards (`dflash_offline.projection.SecondMoment`), its eigen-decomposition, and for each k the share
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

import torch

from dflash_offline.cache import encodings
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import hidden_shard_name, read_hidden, read_token_shard, token_shard_name
from dflash_offline.dataset import open_hidden_cache
from dflash_offline.projection import SecondMoment, residual, retained


def real_tokens(info, shard: int, layer: int, device, max_rows: int) -> torch.Tensor:
    """[N, H] hidden states of `layer` at the real tokens (doc_ids >= 0) of the first `max_rows` rows of `shard`."""
    rows = min(info.shard_rows[shard], max_rows)
    x = read_hidden(info.cache_dir / hidden_shard_name(shard), [layer], slice(0, rows), torch.float32, device)
    tok = read_token_shard(info.tokens_dir / token_shard_name(shard), sha256=info.tokens_sha256[shard])
    keep = torch.from_numpy(tok["doc_ids"][:rows] >= 0).to(device)
    return x[keep]


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
    m = read_manifest(Path(args.cache))
    layers = [int(i) for i in m["producer"]["layer_ids"]]
    info = open_hidden_cache(args.cache, layers)
    n = len(info.shard_rows)
    calib = list(range(min(args.calib_shards, max(n - args.heldout_shards, 1))))
    held = [i for i in range(max(n - args.heldout_shards, 0), n) if i not in calib]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H = info.width  # the hidden size (a projected cache: its stored k, measured in that space)
    ks = sorted({k for k in (int(x) for x in args.ks.split(",")) if 0 < k <= H} | {H})
    result = {"cache": str(args.cache), "hidden_size": H, "layers": {}, "calib_shards": calib, "heldout_shards": held,
              "quant": info.quant, "device": str(device)}
    for lid in layers:
        mom = SecondMoment(H, device)
        for s in calib:
            mom.add(real_tokens(info, s, lid, device, args.max_rows))
        evals, evecs = mom.spectrum()
        x_held = torch.cat([real_tokens(info, s, lid, device, args.max_rows) for s in held]) if held else None
        result["layers"][lid] = {
            "calib_tokens": mom.n, "heldout_tokens": 0 if x_held is None else x_held.shape[0],
            "retained": {k: retained(evals, k) for k in ks},
            "heldout_loss": {k: residual(evecs[:, :k], x_held) for k in ks} if x_held is not None else {},
            "top_eigenvalue_share": retained(evals, 1),
        }
    taps = len(layers)
    stored = encodings.bytes_per_token(info.quant, taps, H)  # (the cache's own encoding and width)
    result["bytes_per_token"] = {"cache": stored, **{
        k: {q: encodings.bytes_per_token(q, taps, k) for q in ("bf16", "fp8")} for k in ks}}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{args.cache}: {taps} taps × hidden {H}, {info.quant} ({stored:,.0f} B/token); calibration shards {calib}, "
          f"held out {held}")
    print(f"{'k':>6} {'bf16 B/tok':>11} {'fp8 B/tok':>10}  " + "  ".join(f"L{lid} kept / lost" for lid in layers))
    for k in ks:
        cells = [f"{result['layers'][lid]['retained'][k]:.4f} / "
                 f"{result['layers'][lid]['heldout_loss'].get(k, float('nan')):.4f}" for lid in layers]
        b = result["bytes_per_token"][k]
        print(f"{k:>6} {b['bf16']:>11,.0f} {b['fp8']:>10,.0f}  " + "  ".join(cells))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
