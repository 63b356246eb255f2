"""What a cache holds now, as `make status` reports it (`report`): its shards against its manifest and files, the
recorded verdict judged against the shards as they are, its writers' live status files and the shard claims. Reads
only: a read-only cache is reported as well."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .claims import claim_state, read_claim
from .fsio import pid_alive
from .manifest import (
    ManifestError,
    committed,
    has_manifest,
    hidden_num_shards,
    missing_files,
    projection_problem,
    read_manifest,
    token_cache,
    verdict_now,
)

STALE_S = 300.0  # a running writer with no lease of its own that has not updated its status this long is stale


def live_status(cache: Path) -> list[dict]:
    """Every writer's status file, with `liveness`: its final state (done, failed, interrupted: stopped by SIGTERM
    or SIGINT), or running / dead (its process is gone: same host) / stale (no update for longer than its lease:
    another host, probably dead)."""
    out = []
    for p in sorted(cache.glob("status*.json")):
        try:
            st = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if st.get("state") != "running":
            st["liveness"] = st.get("state", "?")
        elif not pid_alive(st.get("host", ""), st.get("pid", ""), st.get("boot")):  # (extract's carry their pid space)
            st["liveness"] = "dead"
        elif time.time() - st.get("updated_at", 0) > st.get("lease_s", STALE_S):
            st["liveness"] = "stale"
        else:
            st["liveness"] = "running"
        out.append(st)
    return out


def claims(cache: Path) -> list[dict]:
    """The shard claims in `cache/claims/`, each with its `state` (live, dead, expired)."""
    out = []
    for p in sorted((cache / "claims").glob("shard-*.json")):
        c = read_claim(p)
        if c is not None:
            out.append(dict(c, state=claim_state(c)))
    return out


def report(cache: Path) -> dict:
    """Reads only (a read-only cache is reported as well). `verified`: the recorded verdict judged against the shards
    as they are now (`verdict_now`: `bad` the shards still to redo, `redone` and `since` the ones (re)committed since,
    which it does not cover)."""
    m = read_manifest(cache)
    done = committed(m)
    total, tokens_error = shard_count(cache, m)
    damaged = missing_files(cache, m)
    # (stats only, unless a verdict found the file bad: then hashed, to tell whether it was put back since)
    projection = projection_problem(cache, m, check_sha=bool((m.get("verified") or {}).get("projection"))) \
        if m["kind"] == "hidden" else None
    return {
        "cache": str(cache),
        "kind": m["kind"],
        "key": m["key"],
        "complete": not damaged and not tokens_error and not projection and (bool(m.get("complete")) or
                                                          (total is not None and len(done) == total)),
        "tokens_error": tokens_error,
        "num_shards": total,
        "committed": len(done),
        "damaged": damaged,
        "projection_error": projection,
        "pending": None if total is None else sorted(set(range(total)) - set(done)),
        "summary": m.get("summary") or (hidden_summary(m, done) if m["kind"] == "hidden" else {}),
        "verified": verdict_now(m),
        "shards": m["shards"],
        "live": live_status(cache),
        "claims": claims(cache),
    }


def shard_count(cache: Path, m: dict) -> tuple[int | None, str | None]:
    """(num_shards, None), or (None, why) for a count that cannot be checked against what is on disk — a hidden
    cache's not its token cache's (`hidden_num_shards`: unreadable, or the counts differ), an incomplete token cache's
    beyond its entries: pending shards are then not listed, so that no count read from a manifest sizes anything
    before it is checked."""
    if m["num_shards"] is None or m["kind"] == "tokens" and m["num_shards"] <= len(m["shards"]):
        return m["num_shards"], None
    if m["kind"] == "tokens":  # (incomplete: a complete one's count is bounded on reading)
        return None, f"num_shards {m['num_shards']} of an incomplete token cache with {len(m['shards'])} entries"
    try:
        return hidden_num_shards(cache, m, token_cache(cache, m)[1]), None
    except ManifestError as e:
        return None, str(e)


def hidden_summary(m: dict, done: dict) -> dict:
    """What a hidden cache holds, from its shard entries: rows, tokens, bytes, bytes per token, extraction rate."""
    tokens = sum(s.get("tokens", 0) for s in done.values())
    size = sum(f["bytes"] for s in done.values() for f in s.get("files", {}).values())
    compute = sum(s.get("compute_seconds", 0.0) for s in done.values())
    out = {"rows": sum(s.get("rows", 0) for s in done.values()), "tokens": tokens, "bytes": size,
           "bytes_per_token": size / tokens if tokens else 0.0, "layer_ids": m["producer"].get("layer_ids"),
           "quant": m["producer"].get("quant"), "compute_tokens_per_s": tokens / compute if compute else 0.0}
    if p := m.get("projection"):  # projected taps (docs/cache.md): k a tap, and what the calibration kept
        kept, hidden = list((p.get("retained") or {}).values()), (m["producer"].get("target") or {}).get("hidden_size")
        out["projection"] = (f"{p.get('dims')} of {hidden} dims a tap from "
                             f"{p.get('rows')} calibration rows" + (f", energy kept {min(kept):.3f}–{max(kept):.3f}"
                                                                    if kept else "")
                             + f"; {p.get('file')} {str(p.get('sha256'))[:12]}")
    return out


def find_caches(root: Path) -> list[Path]:
    """`root` if it is a cache, else the caches one level below it."""
    if has_manifest(root):
        return [root]
    return sorted(p for p in root.glob("*") if has_manifest(p))
