"""The A/B statistics (`testbed.ab` runs the sweep): what each arm's evaluations say and how far to trust it — τ
pooled over seeds, the interval of a difference (`delta_ci`: the prompts' paired bootstrap plus the seeds' variance
pooled over the arms), the verdicts of the null and known-bad arms that decide whether arms are ranked (`judge`), and
the runs that failed (`failed_runs`)."""

from __future__ import annotations

import json
from pathlib import Path


def prompt_counts(eval_json: Path) -> list[tuple[float, int]]:
    """Per prompt of an evaluation: (tokens its verify steps emitted, verify steps) — the tokens as decoded, not the
    drafts a last step accepted past eos or the budget (evaluations of older code: τ × steps)."""
    return [(p.get("emitted", p["tau_mean"] * p["steps"]), p["steps"]) if p["steps"] else (0.0, 0)
            for p in json.loads(eval_json.read_text())["per_prompt"]]


def eval_record(eval_json: Path) -> dict:
    """What the A/B table takes from an evaluation: τ, per-prompt counts, the lossless check, what was decoded."""
    r = json.loads(eval_json.read_text())
    return {"tau": r.get("tau_emitted", r["tau_mean"]), "counts": prompt_counts(eval_json),
            "lossless": bool(r.get("lossless", True)), "checked": r.get("lossless_prompts", r.get("num_prompts")),
            "replay_check": r.get("replay_check"),
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
    yardstick that rests on it) and independent between them — each arm trains under seeds of its own
    (`ab.arm_seeds`): arms sharing seeds would share their noise, and these pairs would count one difference many
    times. None when no arm has two seeds."""
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
    if len(boot) < 2:  # (almost every draw hit prompts without a verify step: no spread to measure)
        return None
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


def arm_rows(arms: list[str], results: dict, apart: tuple[str, ...] = ()) -> list[dict]:
    """Per arm: τ per seed, τ pooled over its seeds (every seed's prompts' tokens over their verify steps: the
    statistic the interval is about), the mean of the seeds' τ, spread (max − min), sample std, final losses, the
    lossless check per seed, the difference of pooled τ to the first arm's and its 95 % interval (`delta_ci`:
    prompts bootstrapped, seeds' variance pooled over the arms but those `apart`). `results[arm] = [(eval_record,
    final loss) per seed]` (arms may have other seeds than the first: the null arm is the recipe under other seeds);
    evaluations of other prompts or token budgets than the others' are refused (their prompts cannot be paired).
    `apart`: arms whose seeds do not estimate the others' training noise — the known-bad arm, at a quarter of the
    steps, learns in another regime (τ 1.1–3.2 in the recorded sweeps, far below the recipe's) and its seeds' spread is not theirs:
    pooled, it lowered the seeds' sd in 18 of the 22 recorded sweeps (narrower intervals: more null misses) and
    doubled it in one (0.026 → 0.055, `8f72974`), and the null check, which must judge the yardstick the arms rest
    on, would depend on the arm meant to fail."""
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
                     "lossless": [e["lossless"] for e in evals], "mismatches": [e["mismatches"] for e in evals],
                     "checked": [e.get("checked") for e in evals],
                     "replay_check": [e["replay_check"] for e in evals if e.get("replay_check")]})
    counts = {arm: [e["counts"] for e, _ in results[arm]] for arm in arms}
    seed_var = pooled_seed_var([c for arm, c in counts.items() if arm not in apart])
    for arm, r in zip(arms, rows, strict=True):
        # (an arm apart: its own seeds' spread joins the others' in its interval, which the others' alone would not hold)
        own = seed_var if arm not in apart else pooled_seed_var(
            [c for a, c in counts.items() if a not in apart or a == arm])
        r["delta_vs_first"] = r["tau_pooled"] - rows[0]["tau_pooled"]
        r["delta_pct"] = 100 * r["delta_vs_first"] / rows[0]["tau_pooled"]
        r["delta_ci95"] = None if arm == arms[0] else delta_ci(counts[arm], counts[arms[0]], seed_var=own)
        r["seed_sd_pooled"] = None if seed_var is None else seed_var[0] ** 0.5
    return rows


def null_remedy(seeds: int) -> str:
    """What to do when the null arm's interval misses 0: a 95 % interval does so in one sweep of 20 by chance (and
    more often when its seeds' variance, estimated from few seeds, came out small); more seeds settle it, and a
    rerun keeps every drafter done (a run is keyed by its settings and seed, and an arm's i-th seed does not depend
    on how many there are: `ab.arm_seeds`)."""
    more = f"--seeds={seeds + 1}" if seeds else "more --seeds"
    return (f" (by chance in one sweep of 20, or the seeds' variance was underestimated: rerun with {more} (SEEDS=); "
            f"in the same --dir every drafter done is kept)")


NULL_ARM = "(recipe, other seeds)"  # the null arm's label: the recipe again under seeds no other arm uses


def judge(rows: list[dict], null: str | None, bad: str | None) -> dict:
    """The yardstick's checks and, when they pass, a verdict per arm (in place: `verdict`). The first arm must be
    lossless (every arm is compared with it), the null arm (the first arm's settings under other seeds) must have an
    interval that contains 0 and the known-bad arm (the first arm at a quarter of its steps) one that lies below 0,
    both lossless where decoded (under `--replay=1` the null and known-bad arms' drafters only replay: nothing to check); and the
    seeds' variance must be known (two seeds or more per arm: with one, no interval holds the training noise, and in
    simulation a null arm misses 0 in most sweeps). If any fails (or an arm is missing) the yardstick is not
    discriminating and no arm is ranked (`unranked`). An arm whose drafter is not lossless is `FAILED` whether ranked
    or not (a bug, whatever its τ); a ranked one is `worse` (interval below 0), `better` (above 0), at `parity` (its
    interval contains 0 and |Δ| is no larger than the null arm's interval reaches either side of its centre: what the
    first arm shows against itself — the band is centred on 0, the null arm's own Δ being noise) or `inconclusive`
    (its interval contains 0 but |Δ| is larger than that: too noisy to call; more seeds); one without an interval
    (no verify step to resample) `no interval`. `within_null` is recorded for the arms whose interval contains 0."""
    by = {r["arm"]: r for r in rows}
    lossy = lambda r: bool(r) and not all(r.get("lossless", [True]))  # noqa: E731
    checks, why = {}, []
    if rows and lossy(rows[0]):
        why.append(f"the first arm ({rows[0]['arm']}) is not lossless: its drafters' output differs from the "
                   f"target's, and every arm is compared with it")
    for name, label, ok in (("null", null, lambda lo, hi: lo <= 0 <= hi), ("bad", bad, lambda lo, hi: hi < 0)):
        r = by.get(label) if label else None
        ci = r and r["delta_ci95"]
        checks[name] = {"arm": label, "ci95": ci, "passed": bool(ci) and ok(*ci) and not lossy(r)}
        if lossy(r):
            why.append(f"the {name} arm ({label}) is not lossless: its drafters' output differs from the target's")
        elif not checks[name]["passed"]:
            what = ("not run" if not r else "no interval (no verify step to resample)" if not ci else
                    f"interval [{ci[0]:+.3f}, {ci[1]:+.3f}]")
            want = "contains 0" if name == "null" else "lies below 0"
            why.append(f"the {name} arm ({label}): {what}, where its interval must be one that {want}"
                       + (null_remedy(len(rows[0].get("taus") or ())) if name == "null" and ci else ""))
    if rows and rows[0].get("seed_sd_pooled") is None:
        why.append("one seed per arm: the seeds' variance is unknown, so no interval holds the training noise; "
                   "rerun with --seeds=2 or more (SEEDS=); in the same --dir every drafter done is kept")
    ranked = not why
    null_ci = checks["null"]["ci95"]
    for r in rows[1:]:
        if r["arm"] in (null, bad):
            kind = "null" if r["arm"] == null else "bad"
            r["verdict"] = f"{'null' if kind == 'null' else 'known-bad'} check: " + (
                "passed" if checks[kind]["passed"] else "FAILED")
            continue
        if lossy(r):
            r["verdict"] = "FAILED"
            continue
        if not ranked:
            r["verdict"] = "unranked"
            continue
        if r["delta_ci95"] is None:
            r["verdict"] = "no interval"
            continue
        lo, hi = r["delta_ci95"]
        if hi < 0 or lo > 0:
            r["verdict"] = "worse" if hi < 0 else "better"
            continue
        r["within_null"] = abs(r["delta_vs_first"]) <= (null_ci[1] - null_ci[0]) / 2
        r["verdict"] = "parity" if r["within_null"] else "inconclusive"
    return {"discriminating": ranked, "checks": checks, "why_not": why}
