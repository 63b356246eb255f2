"""Print a cache's shard table and summary, and any live status of a job writing it.

    python -m stages.status --cache=DIR [--json=1] [--all=1]        (make status CACHE=DIR [JSON=1])

DIR is a token or hidden-state cache directory (or a parent directory: every cache below it is listed).
`--json=1` prints one machine-readable JSON object instead; `--all=1` lists every shard instead of a compact table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.claims import claim_state, read_claim
from dflash_offline.cache.fsio import pid_alive
from dflash_offline.cache.manifest import (
    MANIFEST,
    NOT_COMMITTED,
    ManifestError,
    committed,
    has_manifest,
    hidden_num_shards,
    missing_files,
    not_covered,
    projection_problem,
    read_manifest,
    shard_list,
    token_cache,
    verdict_now,
)
from dflash_offline.config import ConfigError, configs_from_argv

STALE_S = 300.0  # a running writer with no lease of its own that has not updated its status this long is stale


@dataclass(frozen=True)
class StatusConfig:
    cache: str  # a token or hidden-state cache directory, or a directory of caches (each one below it is listed)
    json: bool = False  # print one machine-readable JSON object (a list of them for several caches) instead of the table
    all: bool = False  # list every shard, not the first 10 and last 5 of more than 20

    def resolve(self) -> StatusConfig:
        return self


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


def shard_seconds(s: dict) -> float:
    """A shard's time: tokenize writes `seconds`; extract `compute_seconds` + `write_seconds` (overlapping)."""
    return s.get("seconds") or max(s.get("compute_seconds", 0.0), s.get("write_seconds", 0.0))


def fmt_verdict(v: dict | None, cache: str = "...", projection_ok: bool = False) -> str:
    """The verdict as `verdict_now` judges it (a recorded one is shown as it stands): ok; FAILED, naming the shards
    still as it found them and the command that redoes them; or, where every shard it named was (re)committed since,
    the repair awaiting `make verify` — never a redo of what was redone. Shards (re)committed since are named as not
    covered; shards it found not committed are to be finished, not redone; a projection file it found bad that
    `projection_ok` says matches the manifest now awaits `make verify`."""
    if not v:
        return f"never verified (make verify CACHE={cache})"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(v.get("at", 0)))
    verify = f"make verify CACHE={cache}"
    since = f"; not covered: {not_covered(v)}" if v.get("since") else ""
    if v.get("ok"):
        err = f", max rel err {v['max_rel_err']:.2e}" if v.get("max_rel_err") is not None else ""
        return f"ok at {when} ({v.get('rows_per_shard')} rows/shard recomputed{err}){since and f'{since} ({verify})'}"
    if v.get("projection"):
        if projection_ok:  # (the file hashes as the manifest records it again: put back since)
            return (f"FAILED at {when} on the projection file, which matches the manifest now: put back since? run "
                    f"{verify} ({v['projection'].split(';')[0]})")
        return f"FAILED at {when}: {v['projection']}"
    found = [b for b in v.get("bad", []) if "shard" in b]
    pending = shard_list({b["shard"] for b in found if b.get("reason") == NOT_COMMITTED})
    if bad := shard_list({b["shard"] for b in found if b.get("reason") != NOT_COMMITTED}):
        also = f"; shards {pending} not committed then" if pending else ""
        return (f"FAILED at {when}: shards {bad} (redo: make extract CACHE={cache} SHARD={bad}, then make verify)"
                f"{also}{since}")
    if pending:
        return (f"FAILED at {when}: shards {pending} were not committed yet (finish the extraction: make extract "
                f"CACHE={cache}, then make verify){since}")
    if not v.get("redone"):  # (a verdict edited by hand: no result to show)
        return f"FAILED at {when}, naming no shard ({verify})"
    return f"repaired, awaiting {verify}: the verdict of {when} is out of date: {not_covered(v)}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


def print_report(r: dict, show_all: bool) -> None:
    total = "?" if r["num_shards"] is None else r["num_shards"]
    state = "complete" if r["complete"] else "DAMAGED" if r["damaged"] or r["projection_error"] else "incomplete"
    print(f"{r['cache']}  [{r['kind']} cache, key {r['key'][:12]}, {r['committed']}/{total} shards committed, {state}]")
    rows = r["shards"] if show_all or len(r["shards"]) <= 20 else r["shards"][:10] + r["shards"][-5:]
    print(f"  {'shard':>5} {'status':<10} {'rows':>6} {'tokens':>10} {'bytes':>9} {'sec':>7}  sha256")
    for s in rows:
        size = sum(f["bytes"] for f in s.get("files", {}).values())
        sha = ",".join(f["sha256"][:10] for f in s.get("files", {}).values())
        print(f"  {s['index']:>5} {s['status']:<10} {s.get('rows', 0):>6} {s.get('tokens', 0):>10,} "
              f"{fmt_bytes(size):>9} {shard_seconds(s):>7.3g}  {sha}")
    if len(rows) < len(r["shards"]):
        print(f"  … {len(r['shards']) - len(rows)} more (use --all=1)")
    if r["pending"]:
        print(f"  pending shards: {shard_list(r['pending'])}")
    if r["damaged"]:
        bad = sorted({b["shard"] for b in r["damaged"]})
        print(f"  {len(bad)} committed shard(s) damaged on disk: {shard_list(bad)} ({r['damaged'][0]['reason']}"
              f"{' …' if len(r['damaged']) > 1 else ''}); `make extract CACHE={r['cache']}` redoes them")
    if r["projection_error"]:
        print(f"  BAD projection: {r['projection_error']}")
    if r["tokens_error"]:
        print(f"  shard count unchecked: {r['tokens_error']}")
    if r["kind"] == "hidden":
        print(f"  verified: {fmt_verdict(r['verified'], r['cache'], r['projection_error'] is None)}")
    for k, v in r["summary"].items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    for st in r["live"]:
        age = time.time() - st.get("updated_at", 0)
        who = f"{st.get('host', '?')}:{st.get('pid', '?')} rank {st.get('rank', '?')}"
        eta = f", eta {st.get('eta_s') or 0:.0f}s" if st["liveness"] == "running" else ""
        progress = f"{st.get('done')}/{st['total']}" if st.get("total") else f"{st.get('done')}"
        print(f"  {st['liveness']:<8} {st.get('stage')} {who}: {progress} "
              f"{st.get('tokens_per_s', 0):,.0f} tok/s{eta} "
              f"({'ended' if st['liveness'] in ('done', 'failed', 'interrupted') else 'updated'} {age:.0f}s ago)")
    for c in r["claims"]:
        left = c.get("expires", 0) - time.time()
        what = {"live": f"for {left:.0f}s more", "dead": "but its process is gone: the next run takes it over",
                "expired": f"lease expired {-left:.0f}s ago: the next run takes it over"}[c["state"]]
        print(f"  claimed: shard {c['index']} by {c.get('worker')} rank {c.get('rank', '?')} ({c['state']}), {what}")



def find_caches(root: Path) -> list[Path]:
    if has_manifest(root):
        return [root]
    return sorted(p for p in root.glob("*") if has_manifest(p))


def main(argv: list[str]) -> int:
    if positional := [x for x in argv if not x.startswith("-")]:
        raise ConfigError(f"status: the cache is now --cache={positional[0]} (a positional directory is not read)")
    (cfg,) = configs_from_argv([(StatusConfig, "status")], argv or ["--help"], __doc__)
    root = Path(cfg.cache)
    caches = find_caches(root)
    if not caches:
        raise ManifestError(f"no cache at {root} (no {MANIFEST} there or one level below)")
    if len(caches) == 1:  # (one cache: its error is the stage's one line)
        reports = [report(caches[0])]
    else:  # a directory of caches: one unreadable manifest is reported in its place, the others still are
        reports = [readable(c) for c in caches]
    if cfg.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1, sort_keys=True))
    else:
        for r in reports:
            print(f"{r['cache']}: error: {r['error']}") if "error" in r else print_report(r, cfg.all)
    return 2 if any("error" in r for r in reports) else 0


def readable(cache: Path) -> dict:
    """`report(cache)`, or {"cache", "error"} for a cache whose manifest cannot be read (its one line)."""
    try:
        return report(cache)
    except (ValueError, OSError) as e:
        from dflash_offline.cli import refusal

        line = refusal(e) or f"error: {type(e).__name__}: {e}"  # (an unreadable file: its line too)
        return {"cache": str(cache), "error": line.removeprefix("error: ")}


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
