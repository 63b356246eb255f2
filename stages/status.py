"""Print a cache's shard table and summary, and any live status of a job writing it.

    python -m stages.status CACHE [--json] [--all]

CACHE is a token or hidden-state cache directory (or a parent directory: every cache below it is listed).
`--json` prints one machine-readable JSON object instead; `--all` lists every shard instead of a compact table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflash_offline.manifest import MANIFEST, ManifestError, committed, read_manifest


def live_status(cache: Path) -> list[dict]:
    out = []
    for p in sorted(cache.glob("status*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (json.JSONDecodeError, OSError):
            pass
    return out


def claims(cache: Path) -> list[dict]:
    out = []
    for p in sorted((cache / "claims").glob("shard-*.json")):
        try:
            c = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        c["live"] = c.get("expires", 0) > time.time()
        out.append(c)
    return out


def report(cache: Path) -> dict:
    m = read_manifest(cache)
    done = committed(m)
    total = m.get("num_shards")
    return {
        "cache": str(cache),
        "kind": m["kind"],
        "key": m["key"],
        "complete": bool(m.get("complete")) or (total is not None and len(done) == total),
        "num_shards": total,
        "committed": len(done),
        "pending": None if total is None else sorted(set(range(total)) - set(done)),
        "summary": m.get("summary", {}),
        "shards": m["shards"],
        "live": live_status(cache),
        "claims": [c for c in claims(cache) if c["live"]],
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


def print_report(r: dict, show_all: bool) -> None:
    total = "?" if r["num_shards"] is None else r["num_shards"]
    state = "complete" if r["complete"] else "incomplete"
    print(f"{r['cache']}  [{r['kind']} cache, key {r['key'][:12]}, {r['committed']}/{total} shards committed, {state}]")
    rows = r["shards"] if show_all or len(r["shards"]) <= 20 else r["shards"][:10] + r["shards"][-5:]
    print(f"  {'shard':>5} {'status':<10} {'rows':>6} {'tokens':>10} {'bytes':>9} {'sec':>7}  sha256")
    for s in rows:
        size = sum(f["bytes"] for f in s.get("files", {}).values())
        sha = ",".join(f["sha256"][:10] for f in s.get("files", {}).values())
        print(f"  {s['index']:>5} {s['status']:<10} {s.get('rows', 0):>6} {s.get('tokens', 0):>10,} "
              f"{fmt_bytes(size):>9} {s.get('seconds', 0):>7.1f}  {sha}")
    if len(rows) < len(r["shards"]):
        print(f"  … {len(r['shards']) - len(rows)} more (use --all)")
    if r["pending"]:
        print(f"  pending shards: {compact(r['pending'])}")
    for k, v in r["summary"].items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    for live in r["live"]:
        age = time.time() - live.get("updated_at", 0)
        print(f"  live: {live.get('stage')} {live.get('state')} {live.get('done')}/{live.get('total')} "
              f"{live.get('tokens_per_s', 0):,.0f} tok/s, eta {live.get('eta_s') or 0:.0f}s (updated {age:.0f}s ago)")
    for c in r["claims"]:
        print(f"  claimed: shard {c['index']} by {c['worker']} for {c['expires'] - time.time():.0f}s more")


def compact(ids: list[int]) -> str:
    """[0,1,2,5,7,8] → '0-2,5,7-8' (the SHARD= syntax)."""
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ",".join(parts)


def find_caches(root: Path) -> list[Path]:
    if (root / MANIFEST).is_file():
        return [root]
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    root = Path(argv[0])
    caches = find_caches(root)
    if not caches:
        raise ManifestError(f"no cache at {root} (no {MANIFEST} there or one level below)")
    reports = [report(c) for c in caches]
    if "--json" in argv:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1, sort_keys=True))
        return
    for r in reports:
        print_report(r, "--all" in argv)


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
