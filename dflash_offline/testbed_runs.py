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
        self.eval_prompts = self.root / "corpus" / "eval.jsonl"  # the prompts evaluation decodes (chosen at regen)
        self.eval_candidates = self.root / "corpus" / "eval-candidates.jsonl"  # every held-out file's opening
        self.eval_greedy = self.root / "corpus" / "eval-candidates-greedy.jsonl"  # the target's greedy answers to them
        self.wall = self.root / "wall.json"  # wall seconds of every invocation (a heartbeat)
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
    doomed = {"target": [p.target, p.root / "corpus"], "regen": [p.regen, Path(str(p.regen) + ".stats.json"), p.eval_prompts, p.eval_greedy,
                                                    Path(str(p.eval_greedy) + ".stats.json")],
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


def answer_text(rec: dict) -> str:
    """A regenerated record's last answer as the target wrote it (its reasoning, if any, then its content)."""
    m = rec["messages"][-1]
    return (m.get("reasoning_content") or "") + m.get("content", "")


def looping_share(path: Path) -> float:
    """Share of the regenerated answers that end in a loop (`pysource.looping`)."""
    from .pysource import looping

    answers = [answer_text(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    return round(sum(map(looping, answers)) / max(len(answers), 1), 4)


def choose_eval_prompts(candidates: Path, greedy: Path, out: Path, n: int, budget: int) -> dict:
    """Write to `out` the `n` evaluation prompts: the candidates (held-out files' openings, in name-hash order) whose
    greedy answer by the target (`greedy`: regenerated records, `budget` new tokens at most) neither loops nor stops
    before half the budget, in order; where fewer than `n` do, the others after them (counted). A reference that loops
    is easy to draft for any drafter and hides the differences the A/B is after; one that stops at once has no verify
    step to measure. Returns the counts."""
    from .pysource import looping

    cands = [json.loads(x) for x in candidates.read_text().splitlines() if x.strip()]
    answers = [json.loads(x) for x in greedy.read_text().splitlines() if x.strip()]
    loops = [looping(answer_text(r)) for r in answers]
    short = [sum(r["regen"]["new_tokens"]) < max(1, budget // 2) for r in answers]
    usable = [not (a or b) for a, b in zip(loops, short, strict=True)]
    order = [i for i, ok in enumerate(usable) if ok] + [i for i, ok in enumerate(usable) if not ok]
    if len(order) < n:
        raise ValueError(f"only {len(order)} held-out prompts were answered for eval_prompts={n}: lower "
                         f"heldout_every or eval_prompts")
    picked = order[:n]
    out.write_text("".join(json.dumps(cands[answers[i]["regen"]["index"]]) + "\n" for i in sorted(picked)))
    return {"candidates": len(answers), "candidates_looping": round(sum(loops) / max(len(loops), 1), 4),
            "candidates_short": round(sum(short) / max(len(short), 1), 4), "chosen": n,
            "chosen_looping": sum(loops[i] for i in picked), "chosen_short": sum(short[i] for i in picked)}


def eval_looping_share(baseline: Path, tokenizer_dir: Path) -> float | None:
    """Share of the target's greedy decodes of the evaluation prompts (the baseline every evaluation compares with,
    in exact mode) that end in a loop; None before the baseline exists."""
    if not baseline.is_file():
        return None
    from transformers import AutoTokenizer

    from .pysource import looping

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    decodes = json.loads(baseline.read_text())["decodes"]
    return round(sum(looping(tok.decode(d["ids"], skip_special_tokens=True)) for d in decodes) / len(decodes), 4)


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
        "looping_frac_eval": eval_looping_share(p.baseline(cfg.eval_tokens), p.target),
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
                  f"ending in a loop; the target's greedy answers to the evaluation prompts: "
                  f"{100 * (r.get('looping_frac_eval') or 0):.0f} % looping"),
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
    head = ("| arm | tokens per verify step, per seed | seeds pooled | spread | Δ vs first | Δ 95 % CI (seeds × prompts) "
            "| verdict | lossless | final loss |\n"
            "|---|---|---|---|---|---|---|---|---|")
    body = [f"| {a['arm']} | {' / '.join(f'{t:.3f}' for t in a['taus'])} | {a['tau_pooled']:.3f} | {a['spread']:.3f} | "
            f"{a['delta_vs_first']:+.3f} ({a['delta_pct']:+.1f} %) | "
            f"{'—' if a['delta_ci95'] is None else '[{:+.3f}, {:+.3f}]'.format(*a['delta_ci95'])} | "
            f"{a.get('verdict', '—')} | "
            f"{'yes' if all(a['lossless']) else 'NO: prompts ' + str(a['mismatches'])} | "
            f"{' / '.join(f'{x:.3f}' for x in a['loss'] if x is not None)} |" for a in r["arms"]]
    judged = r.get("judgement")
    tail = [] if judged is None else ["the yardstick discriminates (null arm's interval holds 0, the known-bad arm's "
                                      "lies below 0): arms ranked" if judged["discriminating"] else
                                      "NOT DISCRIMINATING, arms not ranked: " + "; ".join(judged["why_not"])]
    return "\n".join([head, *body, *tail])


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


T975 = ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (6, 2.447), (7, 2.365), (8, 2.306), (10, 2.228),
        (12, 2.179), (15, 2.131), (20, 2.086), (30, 2.042), (60, 2.000), (120, 1.980), (10**9, 1.960))


def t975(df: float) -> float:
    """Student's t 97.5 % quantile at `df` degrees of freedom (table, linear in 1/df between its rows)."""
    df = max(df, 1.0)
    for (d0, t0), (d1, t1) in zip(T975, T975[1:], strict=False):
        if df <= d1:
            w = (1 / d0 - 1 / df) / (1 / d0 - 1 / d1)
            return t0 + w * (t1 - t0)
    return 1.960


def seed_taus(arm: list[list[tuple]]) -> list[float]:
    """Each seed's τ over the prompts (its tokens over its verify steps)."""
    return [sum(c[0] for c in counts) / max(sum(c[1] for c in counts), 1) for counts in arm]


def sample_var(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def pooled_seed_var(arms: list[list[list[tuple]]]) -> tuple[float, int] | None:
    """One estimate of the variance of a seed's τ from every arm with two seeds or more (each arm's squared deviations
    from its own mean, over Σ (seeds − 1)): training noise, assumed alike across arms (the null arm checks the
    yardstick that rests on it). None when no arm has two seeds."""
    ss = df = 0
    for arm in arms:
        if len(arm) > 1:
            taus = seed_taus(arm)
            ss += sample_var(taus) * (len(taus) - 1)
            df += len(taus) - 1
    return (ss / df, df) if df else None


def delta_ci(a: list[list[tuple]], b: list[list[tuple]], draws: int = 2000, seed: int = 0,
             seed_var: tuple[float, int] | None = None):
    """95 % interval of τ(a) − τ(b), the arms' seeds pooled; `a`, `b` are per seed the `prompt_counts` of the same
    prompts. Two sources of noise, added as variances:
    - prompts: a paired bootstrap (each draw resamples the prompts, the same draw for both arms, every seed's tokens
      and steps pooled on them; prompts differ far more than arms do, so pairing is what makes a difference visible);
    - seeds (training noise): the variance of one seed's τ over the number of seeds, for each arm — `seed_var`
      (variance, degrees of freedom) when given (`pooled_seed_var`: every arm's seeds, one estimate), else each
      arm's own sample variance of its seeds' τ (n − 1).
    The interval is Δ ± t · √(sum), t at the Welch–Satterthwaite degrees of freedom. With two seeds an arm's own
    estimate has one degree of freedom (t = 12.7): the pooled one is what makes two seeds usable. (Resampling the
    seeds instead, as a bootstrap would, cannot be wider than two seeds' range: in simulation 23 % of null
    differences came out significant that way.) With one seed per arm and no `seed_var` the seed term is unknown and
    left out: only the prompts vary."""
    import random

    n = len(a[0])
    if any(len(x) != n for x in (*a, *b)):
        raise ValueError("delta_ci: every seed of both arms must hold the same prompts")
    pool = [[sum(x[i][k] for x in arm) for i in range(n)] for arm in (a, b) for k in (0, 1)]
    ta, sa, tb, sb = (sum(v) for v in pool)
    if not (sa and sb):
        return None
    delta = ta / sa - tb / sb
    rng, boot = random.Random(seed), []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        xa, ya, xb, yb = (sum(v[i] for i in idx) for v in pool)
        if ya and yb:
            boot.append(xa / ya - xb / yb)
    mean = sum(boot) / len(boot)
    var_p = sum((d - mean) ** 2 for d in boot) / max(len(boot) - 1, 1)
    terms = [(var_p, n - 1)]
    if seed_var is not None:
        terms.append((seed_var[0] * (1 / len(a) + 1 / len(b)), seed_var[1]))
    else:
        for arm in (a, b):
            if len(arm) > 1:
                terms.append((sample_var(seed_taus(arm)) / len(arm), len(arm) - 1))
    var = sum(v for v, _ in terms)
    if var <= 0:
        return (delta, delta)
    df = var ** 2 / sum(v ** 2 / d for v, d in terms if d > 0)
    half = t975(df) * var ** 0.5
    return (delta - half, delta + half)


def failed_runs(root: Path, times: dict, evaluated: list[Path]) -> dict:
    """{run relative to `root`: why} for the runs whose job failed (`times[run]["error"]`) and the `evaluated` runs
    whose speculative output differs from the target's greedy output (exact mode: a bug, whatever the drafter)."""
    failed = {str(r.relative_to(root)): t["error"] for r, t in times.items() if "error" in t}
    for run in evaluated:
        if not (e := eval_record(run / "eval.json"))["lossless"]:
            failed[str(run.relative_to(root))] = f"not lossless: prompts {e['mismatches']} differ from the target's"
    return failed


def arm_rows(arms: list[str], results: dict) -> list[dict]:
    """Per arm: τ per seed, τ pooled over its seeds (every seed's prompts' tokens over their verify steps: the
    statistic the interval is about), the mean of the seeds' τ, spread (max − min), sample std, final losses, the
    lossless check per seed, the difference of pooled τ to the first arm's and its 95 % interval (`delta_ci`:
    prompts bootstrapped, seeds' variance pooled over all the arms). `results[arm] = [(eval_record, final loss) per seed]` (arms may have other
    seeds than the first: the null arm is the recipe under other seeds); evaluations of other prompts or token budgets
    than the others' are refused (their prompts cannot be paired)."""
    decoded = {(e["prompts"], e["tokens"], len(e["counts"])) for per_seed in results.values() for e, _ in per_seed}
    if len(decoded) > 1:
        raise ValueError(f"the evaluations to compare decoded different prompts or token budgets {sorted(decoded, key=str)}"
                         f": their prompts cannot be paired; evaluate every arm on the same prompts")
    rows = []
    for arm in arms:
        evals, losses = zip(*results[arm], strict=True)
        taus = [e["tau"] for e in evals]
        mean = sum(taus) / len(taus)
        sd = (sum((t - mean) ** 2 for t in taus) / max(len(taus) - 1, 1)) ** 0.5
        rows.append({"arm": arm or "(recipe)", "taus": taus, "tau_pooled": pooled_tau([e["counts"] for e in evals]),
                     "tau_mean_of_seeds": mean, "spread": max(taus) - min(taus), "std": sd, "loss": list(losses),
                     "lossless": [e["lossless"] for e in evals], "mismatches": [e["mismatches"] for e in evals]})
    counts = {arm: [e["counts"] for e, _ in results[arm]] for arm in arms}
    seed_var = pooled_seed_var(list(counts.values()))
    for arm, r in zip(arms, rows, strict=True):
        r["delta_vs_first"] = r["tau_pooled"] - rows[0]["tau_pooled"]
        r["delta_pct"] = 100 * r["delta_vs_first"] / rows[0]["tau_pooled"]
        r["delta_ci95"] = None if arm == arms[0] else delta_ci(counts[arm], counts[arms[0]], seed_var=seed_var)
        r["seed_sd_pooled"] = None if seed_var is None else seed_var[0] ** 0.5
    return rows


NULL_ARM = "(recipe, other seeds)"  # the null arm's label: the recipe again under seeds no other arm uses


def judge(rows: list[dict], null: str | None, bad: str | None) -> dict:
    """The yardstick's two checks and, when both pass, a verdict per arm (in place: `verdict`). The null arm (the
    first arm's settings under other seeds) must have an interval that contains 0, the known-bad arm (the first arm at
    a quarter of its steps) one that lies below 0; if either fails (or is missing) the yardstick is not
    discriminating and no arm is ranked (`unranked`). Otherwise an arm is `worse` (interval below 0), `better` (above
    0), at `parity` (its interval contains 0 and its Δ lies within the null arm's interval: no larger than the first
    arm shows against itself) or `inconclusive` (its interval contains 0 but its Δ is larger than that: too noisy to
    call; more seeds)."""
    by = {r["arm"]: r for r in rows}
    checks, why = {}, []
    for name, label, ok in (("null", null, lambda lo, hi: lo <= 0 <= hi), ("bad", bad, lambda lo, hi: hi < 0)):
        r = by.get(label) if label else None
        ci = r and r["delta_ci95"]
        checks[name] = {"arm": label, "ci95": ci, "passed": bool(ci) and ok(*ci)}
        if not checks[name]["passed"]:
            what = "not run" if not ci else f"interval [{ci[0]:+.3f}, {ci[1]:+.3f}]"
            want = "contains 0" if name == "null" else "lies below 0"
            why.append(f"the {name} arm ({label}): {what}, where its interval must be one that {want}")
    ranked = not why
    null_ci = checks["null"]["ci95"]
    for r in rows[1:]:
        if r["arm"] in (null, bad):
            kind = "null" if r["arm"] == null else "bad"
            r["verdict"] = f"{'null' if kind == 'null' else 'known-bad'} check: " + (
                "passed" if checks[kind]["passed"] else "FAILED")
            continue
        if not ranked:
            r["verdict"] = "unranked"
            continue
        lo, hi = r["delta_ci95"]
        r["within_null"] = null_ci[0] <= r["delta_vs_first"] <= null_ci[1]
        r["verdict"] = ("worse" if hi < 0 else "better" if lo > 0 else "parity" if r["within_null"] else
                        "inconclusive")
    return {"discriminating": ranked, "checks": checks, "why_not": why}
