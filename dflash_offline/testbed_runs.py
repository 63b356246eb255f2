"""The testbed's bookkeeping (`stages/testbed.py` runs the phases): where everything goes (`Paths`), the phase
record (`state.json`), what a run and an evaluation left (`run_metrics`, `eval_summary`), the result and its table,
and the A/B arms: parsing (`parse_arm`: each key=value goes to [extract] or [train], anything else refused before
anything runs), naming (`slug`), and the per-arm statistics over seeds (`arm_rows`, `ab_table`)."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

from .config import ConfigError, as_dict, did_you_mean
from .manifest import write_json_atomic

PHASES = ("target", "regen", "extract", "train", "export", "eval")


class Paths:
    def __init__(self, root: str):
        self.root = Path(root)
        self.target = self.root / "target"
        self.train_prompts = self.root / "corpus" / "regen-prompts.jsonl"
        self.eval_prompts = self.root / "corpus" / "eval.jsonl"
        self.regen = self.root / "regen.jsonl"
        self.tokens = self.root / "cache" / "tokens"
        self.state = self.root / "state.json"

    def baseline(self, tokens: int) -> Path:
        return self.root / f"baseline-{tokens}.json"

    def hidden(self, slug: str = "") -> Path:
        return self.root / "cache" / (f"hidden-{slug}" if slug else "hidden")

    def run(self, arm: str, seed: int) -> Path:
        return self.root / "runs" / (arm or "base") / f"seed{seed}"


def read_state(p: Paths) -> dict:
    return json.loads(p.state.read_text()) if p.state.is_file() else {"phases": {}}


def write_state(p: Paths, st: dict) -> None:
    write_json_atomic(p.state, st)


def forget_from(p: Paths, st: dict, phase: str) -> None:
    """Remove what `phase` and the later phases made (the target stays unless phase is 'target')."""
    later = PHASES[PHASES.index(phase):]
    for ph in later:
        st["phases"].pop(ph, None)
    doomed = {"target": [p.target, p.root / "corpus"], "regen": [p.regen, Path(str(p.regen) + ".stats.json")],
              "extract": [p.root / "cache"], "train": [p.root / "runs", p.root / "ab"]}
    for ph in later:
        for path in doomed.get(ph, []):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    for run in (p.root / "runs").glob("*/seed*") if phase in ("export", "eval") else []:
        if phase == "export":
            shutil.rmtree(run / "export", ignore_errors=True)
        for name in ("eval.json", "eval-untrained.json"):
            (run / name).unlink(missing_ok=True)
    write_state(p, st)


def looping_share(path: Path) -> float:
    """Share of the regenerated answers that end in a loop (`pysource.looping`)."""
    from .pysource import looping

    answers = [json.loads(x)["messages"][-1]["content"] for x in path.read_text().splitlines() if x.strip()]
    return round(sum(map(looping, answers)) / max(len(answers), 1), 4)


def run_metrics(run: Path) -> dict:
    """The run's last metrics record (loss, accuracy, tok/s) and its step."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [r for r in lines if "loss" in r]
    return last[-1] if last else {}


def eval_summary(path: Path) -> dict:
    r = json.loads(path.read_text())
    return {k: r[k] for k in ("tau_mean", "tau_emitted", "accept_ge", "by_category", "lossless", "mismatches",
                              "num_prompts",
                              "new_tokens", "verify_steps", "draft_ms", "verify_ms", "speedup_engine_est") if k in r}


def result(cfg, p: Paths, st: dict) -> dict:
    ph = st["phases"]
    target = json.loads((p.target / "dflash_target.json").read_text())
    ev = ph.get("eval", {})
    tr, un = ev.get("trained", {}), ev.get("untrained", {})
    return {
        "testbed": str(p.root), "files_digest": target["files"], "target_parameters": target.get("parameters"),
        "target": {k: ph["target"].get(k) for k in ("steps", "tokens", "tok_per_s", "heldout_loss_before",
                                                    "heldout_loss_after", "train_loss_last")},
        "regen": ph.get("regen"), "extract": ph.get("extract"), "train": ph.get("train"),
        "tau_trained": tr.get("tau_mean"), "tau_untrained": un.get("tau_mean"),
        "tau_emitted_trained": tr.get("tau_emitted"), "tau_emitted_untrained": un.get("tau_emitted"),
        "tau_ratio": tr["tau_mean"] / un["tau_mean"] if tr and un else None,
        "accept_ge": tr.get("accept_ge"), "by_category": tr.get("by_category"),
        "lossless": bool(tr.get("lossless")) and bool(un.get("lossless")),
        "seconds": {k: round(v.get("seconds", 0), 1) for k, v in ph.items()},
        "wall_s": round(sum(v.get("seconds", 0) for v in ph.values()), 1),
        "config": as_dict(cfg), "time": time.time(),
    }


def table(r: dict) -> str:
    t, g, x, d = r["target"], r["regen"] or {}, r["extract"] or {}, r["train"] or {}
    rows = [
        ("target", f"{(r['target_parameters'] or 0) / 1e6:.0f}M params, {t['steps']} steps, {(t['tokens'] or 0) / 1e6:.0f}M "
                   f"tokens at {(t['tok_per_s'] or 0) / 1e3:.0f}K tok/s; held-out loss {t['heldout_loss_before']} → "
                   f"{t['heldout_loss_after']}"),
        ("regen", f"{g.get('written')} answers, {g.get('new_tokens')} tokens, {100 * (g.get('looping_frac') or 0):.0f} % "
                  f"ending in a loop"),
        ("extract", f"{x.get('tokens')} row tokens, {x.get('tok_per_s_wall', 0):,.0f} tok/s (wall, load included)"),
        ("drafter", f"{d.get('steps')} steps, loss {d.get('loss') or 0:.3f}, {d.get('tok_per_s') or 0:,.0f} ctx tok/s"),
        ("real τ", f"trained {r['tau_trained'] or 0:.2f} vs untrained {r['tau_untrained'] or 0:.2f} "
                   f"(×{r['tau_ratio'] or 0:.1f}); lossless {r['lossless']}; tokens emitted per verify step "
                   f"{r.get('tau_emitted_trained') or 0:.2f} vs {r.get('tau_emitted_untrained') or 0:.2f}"),
        ("by prompt", " · ".join(f"{k} {v['tau_mean']:.2f} ({v['prompts']})" for k, v in (r["by_category"] or {}).items())),
        ("accept ≥k", " ".join(f"{a:.2f}" for a in (r["accept_ge"] or [])[:8]) + " …"),
        ("wall s", ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()) + f"; total {r['wall_s']:.0f}"),
    ]
    return "\n".join(f"{k:>10}  {v}" for k, v in rows)


def parse_arm(text: str) -> tuple[dict, dict]:
    """'key=value key=value' → (extract settings, train settings); a key of neither stage is an error."""
    from .config import ExtractConfig, TrainConfig

    ext_keys = {f for f in ExtractConfig.__dataclass_fields__} - {"target", "tokens", "hidden_out", "cache_root",
                                                                   "shards", "device", "dry_run"}
    train_keys = {f for f in TrainConfig.__dataclass_fields__} - {"cache", "run", "resume", "seed", "target"}
    ext, train = {}, {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"testbed arm {text!r}: {item!r} is not key=value")
        if key in ext_keys:
            ext[key] = value
        elif key in train_keys:
            train[key] = value
        else:
            raise ConfigError(f"testbed arm {text!r}: {key!r} is no extract or train setting"
                              f"{did_you_mean(key, sorted(ext_keys | train_keys))}")
    return ext, train


JOB_FILE = "testbed-job.json"  # in a drafter's run: what it was made from (`job_identity`)
# what a drafter's training, export and evaluation run: the code whose change makes an earlier drafter stale (not
# the testbed's orchestration, nor the target's build, which the cache key covers)
DRAFTER_CODE = ("dflash_offline/*.py", "stages/train.py", "stages/export.py", "stages/evaluate.py")
NOT_DRAFTER_CODE = ("testbed.py", "testbed_runs.py", "pysource.py")


@functools.cache
def drafter_code_digest() -> str:
    """SHA-256 over the sources a drafter's training, export and evaluation run (`DRAFTER_CODE`)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted({f for pattern in DRAFTER_CODE for f in root.glob(pattern)} - {
            root / "dflash_offline" / name for name in NOT_DRAFTER_CODE}):
        h.update(f"{f.relative_to(root)}\0".encode() + f.read_bytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def stale_job(run: Path, identity: dict) -> str | None:
    """Why the drafter in `run` was made from something else than `identity` (its settings, cache, prompts, code),
    or None when it was not (or there is none yet)."""
    if not run.exists():
        return None
    f = run / JOB_FILE
    if not f.is_file():
        return f"{f.name} is missing (made by older code)"
    before = json.loads(f.read_text())
    changed = [k for k in sorted(set(before) | set(identity)) if before.get(k) != identity.get(k)]
    return f"made with another {', '.join(changed)}" if changed else None


def slug(text: str) -> str:
    return "-".join(x.replace("=", "").replace(".", "p").replace(",", "_") for x in text.split()) or "base"


def cache_complete(cache: Path) -> bool:
    if not (cache / "manifest.json").is_file():
        return False
    m = json.loads((cache / "manifest.json").read_text())
    return all(s["status"] == "committed" for s in m["shards"]) and len(m["shards"]) == m["num_shards"]


def ab_table(r: dict) -> str:
    head = ("| arm | tokens per verify step, per seed | seeds pooled | spread | Δ vs first | Δ 95 % CI (prompts) | lossless "
            "| final loss |\n"
            "|---|---|---|---|---|---|---|---|")
    body = [f"| {a['arm']} | {' / '.join(f'{t:.3f}' for t in a['taus'])} | {a['tau_pooled']:.3f} | {a['spread']:.3f} | "
            f"{a['delta_vs_first']:+.3f} ({a['delta_pct']:+.1f} %) | "
            f"{'—' if a['delta_ci95'] is None else '[{:+.3f}, {:+.3f}]'.format(*a['delta_ci95'])} | "
            f"{'yes' if all(a['lossless']) else 'NO: prompts ' + str(a['mismatches'])} | "
            f"{' / '.join(f'{x:.3f}' for x in a['loss'] if x is not None)} |" for a in r["arms"]]
    return "\n".join([head, *body])


def prompt_counts(eval_json: Path) -> list[tuple[float, int]]:
    """Per prompt of an evaluation: (tokens its verify steps emitted, verify steps) — the tokens as decoded, not the
    drafts a last step accepted past eos or the budget (evaluations of older code: τ × steps)."""
    return [(p.get("emitted", p["tau_mean"] * p["steps"]), p["steps"]) if p["steps"] else (0.0, 0)
            for p in json.loads(eval_json.read_text())["per_prompt"]]


def eval_record(eval_json: Path) -> dict:
    """What the A/B table takes from an evaluation: τ, per-prompt counts, the lossless check, what was decoded."""
    r = json.loads(eval_json.read_text())
    return {"tau": r.get("tau_emitted", r["tau_mean"]), "counts": prompt_counts(eval_json),
            "lossless": bool(r.get("lossless", True)),
            "mismatches": r.get("mismatches", []), "prompts": r.get("prompt_ids_sha256"),
            "tokens": r.get("max_new_tokens")}


def pooled_tau(seeds: list[list[tuple]]) -> float:
    """τ of every seed's prompts together: their tokens over their verify steps (`prompt_counts` per seed)."""
    tokens, steps = (sum(c[k] for counts in seeds for c in counts) for k in (0, 1))
    return tokens / steps if steps else float("nan")


def paired_delta_ci(a: list[list[tuple]], b: list[list[tuple]], draws: int = 2000, seed: int = 0):
    """95 % interval of τ(a) − τ(b) over prompts (paired bootstrap): a, b are per seed the `prompt_counts` of the
    same prompts; each draw resamples the prompts and pools every seed's tokens and steps on them."""
    import random

    n = len(a[0])
    if any(len(x) != n for x in (*a, *b)):
        raise ValueError("paired_delta_ci: every seed of both arms must hold the same prompts")
    pool = [[sum(x[i][k] for x in arm) for i in range(n)] for arm in (a, b) for k in (0, 1)]
    rng, deltas = random.Random(seed), []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        ta, sa, tb, sb = (sum(v[i] for i in idx) for v in pool)
        if sa and sb:
            deltas.append(ta / sa - tb / sb)
    deltas.sort()
    return (deltas[int(0.025 * len(deltas))], deltas[int(0.975 * len(deltas)) - 1]) if deltas else None


def failed_runs(root: Path, times: dict, evaluated: list[Path]) -> dict:
    """{run relative to `root`: why} for the runs whose job failed (`times[run]["error"]`) and the `evaluated` runs
    whose speculative output differs from the target's greedy output (exact mode: a bug, whatever the drafter)."""
    failed = {str(r.relative_to(root)): t["error"] for r, t in times.items() if "error" in t}
    for run in evaluated:
        if not (e := eval_record(run / "eval.json"))["lossless"]:
            failed[str(run.relative_to(root))] = f"not lossless: prompts {e['mismatches']} differ from the target's"
    return failed


def arm_rows(arms: list[str], results: dict, seeds) -> list[dict]:
    """Per arm: τ per seed, τ pooled over its seeds (every seed's prompts' tokens over their verify steps: the
    statistic the interval is about), the mean of the seeds' τ, spread (max − min), sample std, final losses, the
    lossless check per seed, the difference of pooled τ to the first arm's and its paired-bootstrap 95 % interval over
    the prompts. `results[(arm, seed)] = (eval_record, final loss)`; evaluations of other prompts or token budgets
    than the others' are refused (their prompts cannot be paired)."""
    decoded = {(e["prompts"], e["tokens"], len(e["counts"])) for e, _ in results.values()}
    if len(decoded) > 1:
        raise ValueError(f"the evaluations to compare decoded different prompts or token budgets {sorted(decoded, key=str)}"
                         f": their prompts cannot be paired; evaluate every arm on the same prompts")
    rows = []
    for arm in arms:
        evals, losses = zip(*(results[(arm, seed)] for seed in seeds), strict=True)
        taus = [e["tau"] for e in evals]
        mean = sum(taus) / len(taus)
        sd = (sum((t - mean) ** 2 for t in taus) / max(len(taus) - 1, 1)) ** 0.5
        rows.append({"arm": arm or "(recipe)", "taus": taus, "tau_pooled": pooled_tau([e["counts"] for e in evals]),
                     "tau_mean_of_seeds": mean, "spread": max(taus) - min(taus), "std": sd, "loss": list(losses),
                     "lossless": [e["lossless"] for e in evals], "mismatches": [e["mismatches"] for e in evals]})
    first = [results[(arms[0], seed)][0]["counts"] for seed in seeds]
    for arm, r in zip(arms, rows, strict=True):
        r["delta_vs_first"] = r["tau_pooled"] - rows[0]["tau_pooled"]
        r["delta_pct"] = 100 * r["delta_vs_first"] / rows[0]["tau_pooled"]
        r["delta_ci95"] = None if arm == arms[0] else paired_delta_ci(
            [results[(arm, seed)][0]["counts"] for seed in seeds], first)
    return rows
