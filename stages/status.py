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

from dflash_offline.cache.manifest import MANIFEST, NOT_COMMITTED, ManifestError, not_covered, shard_list
from dflash_offline.cache.report import find_caches, report
from dflash_offline.cli import refusal
from dflash_offline.config import ConfigError, configs_from_argv


@dataclass(frozen=True)
class StatusConfig:
    cache: str  # a token or hidden-state cache directory, or a directory of caches (each one below it is listed)
    json: bool = False  # print one machine-readable JSON object (a list of them for several caches) instead of the table
    all: bool = False  # list every shard, not the first 10 and last 5 of more than 20

    def resolve(self) -> StatusConfig:
        return self


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
    verdict = fmt_verdict(r["verified"], r["cache"], r["projection_error"] is None) if r["kind"] == "hidden" else ""
    if verdict.startswith("FAILED"):  # (committed and whole on disk, but its last make verify found bad shards)
        state += ", verify FAILED"
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
        print(f"  verified: {verdict}")
    for k, v in r["summary"].items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    for st in r["live"]:
        age = time.time() - st.get("updated_at", 0)
        rank = "" if st.get("rank") is None else f" rank {st['rank']}"
        who = f"{st.get('host', '?')}:{st.get('pid', '?')}{rank}"
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


def readable(cache: Path) -> dict:
    """`report(cache)`, or {"cache", "error"} for a cache whose manifest cannot be read (the line a stage would end
    with for it)."""
    try:
        return report(cache)
    except (ValueError, OSError) as e:
        line = refusal(e) or f"error: {type(e).__name__}: {e}"  # (an unreadable file: its line too)
        return {"cache": str(cache), "error": line.removeprefix("error: ")}


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


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
