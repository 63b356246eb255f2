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

from dflash_offline.manifest import (
    MANIFEST,
    ManifestError,
    claim_state,
    committed,
    missing_files,
    pid_alive,
    read_claim,
    read_manifest,
)

STALE_S = 300.0  # a running writer with no lease of its own that has not updated its status this long is stale


def live_status(cache: Path) -> list[dict]:
    """Every writer's status file, with `liveness`: its final state (done, failed), or running / dead (its process
    is gone: same host) / stale (no update for longer than its lease: another host, probably dead)."""
    out = []
    for p in sorted(cache.glob("status*.json")):
        try:
            st = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if st.get("state") != "running":
            st["liveness"] = st.get("state", "?")
        elif not pid_alive(st.get("host", ""), st.get("pid", "")):
            st["liveness"] = "dead"
        elif time.time() - st.get("updated_at", 0) > st.get("lease_s", STALE_S):
            st["liveness"] = "stale"
        else:
            st["liveness"] = "running"
        out.append(st)
    return out


def claims(cache: Path) -> list[dict]:
    out = []
    for p in sorted((cache / "claims").glob("shard-*.json")):
        c = read_claim(p)
        if c is not None:
            out.append(dict(c, state=claim_state(c)))
    return out


def report(cache: Path) -> dict:
    m = read_manifest(cache)
    done = committed(m)
    total = m.get("num_shards")
    damaged = missing_files(cache, m)
    return {
        "cache": str(cache),
        "kind": m["kind"],
        "key": m["key"],
        "complete": not damaged and (bool(m.get("complete")) or (total is not None and len(done) == total)),
        "num_shards": total,
        "committed": len(done),
        "damaged": damaged,
        "pending": None if total is None else sorted(set(range(total)) - set(done)),
        "summary": m.get("summary", {}),
        "shards": m["shards"],
        "live": live_status(cache),
        "claims": claims(cache),
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


def print_report(r: dict, show_all: bool) -> None:
    total = "?" if r["num_shards"] is None else r["num_shards"]
    state = "complete" if r["complete"] else "DAMAGED" if r["damaged"] else "incomplete"
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
    if r["damaged"]:
        bad = sorted({b["shard"] for b in r["damaged"]})
        print(f"  {len(bad)} committed shard(s) damaged on disk: {compact(bad)} ({r['damaged'][0]['reason']}"
              f"{' …' if len(r['damaged']) > 1 else ''}); `make extract CACHE={r['cache']}` redoes them")
    for k, v in r["summary"].items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    for st in r["live"]:
        age = time.time() - st.get("updated_at", 0)
        who = f"{st.get('host', '?')}:{st.get('pid', '?')} rank {st.get('rank', '?')}"
        eta = f", eta {st.get('eta_s') or 0:.0f}s" if st["liveness"] == "running" else ""
        print(f"  {st['liveness']:<8} {st.get('stage')} {who}: {st.get('done')}/{st.get('total')} "
              f"{st.get('tokens_per_s', 0):,.0f} tok/s{eta} (updated {age:.0f}s ago)")
    for c in r["claims"]:
        left = c.get("expires", 0) - time.time()
        what = {"live": f"for {left:.0f}s more", "dead": "but its process is gone: the next run takes it over",
                "expired": f"lease expired {-left:.0f}s ago: the next run takes it over"}[c["state"]]
        print(f"  claimed: shard {c['index']} by {c.get('worker')} rank {c.get('rank', '?')} ({c['state']}), {what}")


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
