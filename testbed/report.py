"""What an A/B sweep reports (`testbed.cli` prints and writes it): the arms' table (`ab_table`) and the results file
(`sweep_results`: code provenance, the wall seconds every invocation spent, kept by `heartbeat`)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from dflash_offline.cache.fsio import write_json_atomic

from .runs import Paths, drafter_code_digest, testbed_code_digest


def ab_table(r: dict) -> str:
    head = ("| arm | tokens per verify step, per seed | seeds pooled | spread | Δ vs first | Δ 95 % CI (seeds × prompts) "
            "| verdict | lossless | final loss |\n"
            "|---|---|---|---|---|---|---|---|---|")
    body = [f"| {a['arm']} | {' / '.join(f'{t:.3f}' for t in a['taus'])} | {a['tau_pooled']:.3f} | {a['spread']:.3f} | "
            f"{a['delta_vs_first']:+.3f} ({a['delta_pct']:+.1f} %) | "
            f"{'—' if a['delta_ci95'] is None else '[{:+.3f}, {:+.3f}]'.format(*a['delta_ci95'])} | "
            f"{a.get('verdict', '—')} | "
            f"{lossless_cell(a)} | "
            f"{' / '.join(f'{x:.3f}' for x in a['loss'] if x is not None)} |" for a in r["arms"]]
    judged = r.get("judgement")
    tail = [] if judged is None else ["the yardstick discriminates (null arm's interval holds 0, the known-bad arm's "
                                      "lies below 0, the seeds' variance known, no check's real decode lossy): arms ranked; "
                                      "parity: |Δ| within the null arm's half-width" if judged["discriminating"] else
                                      "NOT DISCRIMINATING, arms not ranked: " + "; ".join(judged["why_not"])]
    checks = replay_checks(r)
    if checks:
        agree, n = sum(c["agree"] for c in checks), sum(c["prompts"] for c in checks)
        tail.append(f"τ replayed on the target's greedy outputs; {len(checks)} drafters (each graph setting's first) also decoded "
                    f"{n} prompts for real: the replay took the decode's steps on {agree}/{n}"
                    + ("" if agree == n else " (REPLAY DIFFERS: a rounding flip or a bug, see their eval.json)"))
    tail += [f"not ranked: {a} ({why})" for a, why in (r.get("incomplete") or {}).items()]
    return "\n".join([head, *body, *tail])


def replay_checks(r: dict) -> list[dict]:
    """The replay checks of an A/B's arms that decoded prompts for real ({prompts, agree} each)."""
    return [c for a in r["arms"] for c in a.get("replay_check", []) if c["prompts"]]


def lossless_cell(a: dict) -> str:
    """The table's lossless column: the prompts decoded for real and checked (a replayed evaluation checks none)."""
    checked = sum(c or 0 for c in a.get("checked", [None]))
    if not all(a["lossless"]):
        return "NO: prompts " + str(a["mismatches"])
    return f"yes ({checked} decoded)" if checked else "— (replayed)"



def sweep_results(r: dict, tb: dict, p: Paths, sweep: dict) -> dict:
    """The sweep's verdicts in the results-file form (`--results=`): commit, the wall seconds of every invocation
    on DIR summed (cold when the first started on a bare machine and `one_sweep`: no invocation ran other arms than
    this one's — `sweep`, `cli.sweep_tag` — whose drafters the sum would hold too; None where an invocation predates
    the tags; `device_seconds_by_sweep` splits the sum by label and arms), the looping shares, and per arm its τ, spread, Δ, interval,
    lossless check and verdict; the null and known-bad arms apart."""
    import torch

    def arm(a: dict) -> dict:
        lo, hi = a["delta_ci95"] or (None, None)
        return {"label": a["arm"], "tau_pooled": round(a["tau_pooled"], 4), "taus": [round(t, 4) for t in a["taus"]],
                "seeds": a.get("seeds"),
                "spread": round(a["spread"], 4), "delta": round(a["delta_vs_first"], 4), "ci_low": lo, "ci_high": hi,
                "lossless": all(a["lossless"]) if any(a.get("checked", [1])) else None,
                "decoded_for_real": sum(c or 0 for c in a.get("checked", [])),
                "verdict": a.get("verdict"), "within_null": a.get("within_null")}

    judged = r.get("judgement") or {"checks": {}}
    special = {c["arm"]: name for name, c in judged["checks"].items()}
    arms = [arm(a) for a in r["arms"]]
    made = p.baseline(r["config"]["eval_tokens"])  # (its key names the device the evaluations ran on)
    device = json.loads(made.read_text())["key"]["device"] if made.is_file() else (
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    checks = replay_checks(r)
    beat_now(last=True)
    calls = read_wall(p)
    return {**provenance(), "device": device,
            "device_seconds": wall_seconds(p), "invocations": calls, **sweep_seconds(calls, sweep),
            "looping_frac_eval": tb.get("looping_frac_eval"), "looping_frac_regen": (tb.get("regen") or {}).get("looping_frac"),
            "arms": [a for a in arms if a["label"] not in special],
            "null_arm": None, "bad_arm": None,  # (--checks=0: none)
            **{f"{name}_arm": next((a for a in arms if a["label"] == label), None) for label, name in special.items()},
            "discriminating": judged.get("discriminating"), "why_not": judged.get("why_not"), "seeds": r["seeds"],
            "phase_seconds": tb.get("seconds"), "tau_trained": tb.get("tau_trained"), "drafter_run": tb.get("drafter_run"),
            "tau_untrained": tb.get("tau_untrained"), "failed": r["failed"], "parallel": r["parallel"], "gpus": r.get("gpus", 1),
            "overlap_eval": bool(r["config"].get("overlap_eval")), "eval_queue": r["config"].get("eval_queue", 1),
            # (what the arms' caches were made from, read from their manifests: a resumed sweep reuses caches that
            # an earlier invocation made under another --derive_caches)
            "derive_caches": bool(derived := derived_caches(p)), "derived_caches": derived,
            "job_seconds": r.get("job_seconds"),
            "tau_from": "replay" if r["config"].get("replay") else "decode", "incomplete": r.get("incomplete"),
            "replay_check": {"drafters": len(checks), "prompts": sum(c["prompts"] for c in checks),
                             "agree": sum(c["agree"] for c in checks)} if checks else None}


def sweep_seconds(calls: list[dict], sweep: dict) -> dict:
    """`one_sweep` (True: every invocation in `calls` ran the arms of `sweep` or the testbed's phases alone; None:
    one predates the tags) and `device_seconds_by_sweep` (their seconds by label and arms)."""
    by: dict[str, float] = {}
    for w in calls:
        tag = "(untagged)" if "arms" not in w else f"{w['sweep']} ({w['arms']})" if w["arms"] else "(testbed alone)"
        by[tag] = by.get(tag, 0.0) + w["seconds"]
    one = None if any("arms" not in w for w in calls) else all(w["arms"] in (None, sweep["arms"]) for w in calls)
    return {"one_sweep": one, "device_seconds_by_sweep": {k: round(v, 1) for k, v in by.items()}}


def derived_caches(p: Paths) -> list[str]:
    """The arm caches under DIR/cache whose manifest records a source cache (`--from_cache`: derived, not extracted)."""
    from dflash_offline.cache.manifest import has_manifest, read_manifest

    return sorted(d.name for d in (p.root / "cache").glob("hidden-*") if has_manifest(d)
                  and (read_manifest(d).get("config") or {}).get("extract", {}).get("from_cache"))


def provenance() -> dict:
    """The code a result was made with: the commit (`DFLASH_COMMIT` where set — a tree that travelled without its
    repository, a sweep summarized after it ran —, else `git`), whether the tree differed from it, the drafter
    code's digest (what `testbed-job.json` keys on) and the digest of all the code the testbed runs (the tree's
    identity where the commit is only said: `git show COMMIT` can be checked against it)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=30)
        except OSError:
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    digests = {"code_sha256": drafter_code_digest(), "testbed_code_sha256": testbed_code_digest()}
    if given := os.environ.get("DFLASH_COMMIT"):  # (said explicitly: e.g. the commit a summarized sweep ran)
        return {"commit": given, "dirty": None, **digests}
    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status), **digests}


def read_wall(p: Paths) -> list:
    return json.loads(p.wall.read_text()) if p.wall.is_file() else []


def wall_seconds(p: Paths) -> float:
    """Wall seconds of every invocation of the testbed on this directory since its target phase started (or the
    directory was made), summed (a heartbeat keeps them current, so a call killed at its time limit still counts to
    its last beat)."""
    return round(sum(w["seconds"] for w in read_wall(p)), 1)


_beats: list = []  # (this process's heartbeat: `beat_now` records the seconds up to now)


def beat_now(last: bool = False) -> None:
    """Record this invocation's wall seconds now, not at the next beat; `last`: and no more (a results file made
    now holds the seconds DIR/wall.json keeps, which a later summary of the sweep reads again)."""
    for beat in _beats:
        beat(last)


def heartbeat(p: Paths, sweep: dict | None = None, every_s: float = 5.0) -> None:
    """Record this invocation's wall seconds in DIR/wall.json every `every_s` (a daemon thread), after the earlier
    invocations' — all of them, a call killed before the target phase ended included (only `--from_phase=target`
    starts the count anew) — with the sweep it ran (`sweep`: `cli.sweep_tag`'s label and arms; None: the testbed's
    phases alone)."""
    import threading

    runs, t0, lock, stopped = read_wall(p), time.time(), threading.Lock(), []
    runs.append({"start": t0, "seconds": 0.0, **(sweep or {"sweep": None, "arms": None})})

    def beat(last: bool = False):
        with lock:
            if stopped:
                return
            runs[-1]["seconds"] = round(time.time() - t0, 1)
            write_json_atomic(p.wall, runs, durable=False)  # (a report: no fsync for the main thread to wait on)
            if last:
                stopped.append(True)

    def loop():
        while not stopped:
            beat()
            time.sleep(every_s)

    _beats[:] = [beat]
    threading.Thread(target=loop, daemon=True).start()
