"""The A/B sweep (`--arms`, `--sweep`): every arm × seed trained, exported and evaluated on the testbed's target
and prompts; with the checks, the null arm (the first arm under other seeds) and the known-bad arm (a quarter of its
steps) run right after the first arm, in that order, then the other arms (`ab`). The statistics are
`testbed.stats`'."""

from __future__ import annotations

import hashlib
import time

from dflash_offline.config import ConfigError, as_dict

from .commands import Job, Stopped, log
from .config import SWEEPS, TestbedConfig
from .phases import recorded_job, testbed
from .runs import (
    Paths,
    eval_looping_share,
    eval_summary,
    parse_arm,
    read_state,
    recorded_seconds,
    run_metrics,
    slug,
)
from .scheduler import default_parallel, gpu_ids
from .stats import NULL_ARM, arm_rows, eval_record, failed_runs, judge


def recipe_steps(cfg, settings: dict) -> int:
    """The steps a drafter of these [train] `settings` trains: theirs, else `train_args`', else `train_steps`, else
    the recipe's, else TrainConfig's default."""
    from dflash_offline.config import read_recipe
    from dflash_offline.trainsetup import STEPS_DEFAULT

    if "steps" in settings:
        return int(settings["steps"])
    for kv in cfg.train_args.split():
        if kv.startswith("steps="):
            return int(kv.split("=", 1)[1])
    return cfg.train_steps or int(read_recipe(cfg.drafter_recipe).get("train", {}).get("steps", STEPS_DEFAULT))


def check_arms(cfg, first: str) -> tuple[str, str]:
    """(null arm label, known-bad arm settings) for a sweep whose first arm is `first`: the null arm is that arm
    under other seeds; the known-bad arm is that arm at a quarter of its steps."""
    ext, train = parse_arm(first)
    bad = {**ext, **train, "steps": max(1, recipe_steps(cfg, train) // 4)}
    null = NULL_ARM if not first else f"({first}, other seeds)"
    return null, " ".join(f"{k}={v}" for k, v in bad.items())


def sweep_arms(names: str, cuda: bool) -> list[str]:
    """The arms of the comma-separated presets `names`, each once, in order (the recipe first); without CUDA, not the
    float8 linears (torchao's float8 training needs CUDA)."""
    arms = list(dict.fromkeys(a for name in names.split(",") for a in SWEEPS[name]))
    return arms if cuda else [a for a in arms if "precision=fp8" not in a]


def summary_record(cfg: TestbedConfig, p: Paths) -> tuple[dict, dict]:
    """`--summarize`: the testbed record from what its phases recorded (DIR/state.json), nothing run."""
    ph = read_state(p)["phases"]
    if not ph:
        raise ConfigError(f"testbed.summarize: {p.state} records no phase: nothing to summarize under {p.root}")
    looping = (eval_looping_share(p.baseline(cfg.eval_tokens), p.target) if (p.target / "tokenizer.json").is_file()
               else None)
    base = recorded_job(cfg, p, ph).run
    tau = {k: eval_summary(base / f).get("tau_mean") if (base / f).is_file() else None
           for k, f in (("tau_trained", "eval.json"), ("tau_untrained", "eval-untrained.json"))}
    return {"regen": ph.get("regen"), "looping_frac_eval": looping, **tau, "drafter_run": ph.get("eval", {}).get("run"),
            "seconds": {k: round(v.get("seconds", 0), 1) for k, v in ph.items()}}, {}


def refuse_repeats(arms: list[str]) -> None:
    keys = [tuple(sorted(a.split())) for a in arms]  # (the same settings in another order are the same arm)
    if len(set(keys)) < len(arms):
        same = [a or '""' for a, k in zip(arms, keys, strict=True) if keys.count(k) > 1]
        raise ConfigError(f"testbed.arms: {', '.join(dict.fromkeys(same))} given twice (the same settings train the "
                          f"same drafters: they would share their runs); to see the noise of one arm, give it more "
                          f"--seeds (SEEDS=) and read its spread")


OWN_SEEDS = 1 << 20  # an arm's own seeds lie in [2^20, 2^31), drawn anew for another first seed (--seed)


def arm_seeds(cfg: TestbedConfig, arm: str, null: bool = False) -> list[int]:
    """The `cfg.seeds` seeds `arm` trains under: the recipe ('') the first seed and the next ones (its first is the
    testbed's own drafter); any other arm, and the null arm (`null`: `arm` again under other seeds), seeds of its own
    drawn from its settings (in any order) and the seed's index, so that more --seeds, another sweep or --summarize
    with other arms keep the drafters done. Arms that shared seeds shared their training noise (the same initial
    weights and batch order): in 7 of 11 sweeps every arm's seed 0 − seed 1 had the same sign. The seeds' variance,
    pooled over the arms as if each arm's were its own, then held little more than one arm's worth of information,
    and the null arm (the only one on other seeds) missed 0 more often than 1 in 20 (8–16 % in simulation,
    docs/testbed.md; a test in tests/test_testbed.py)."""
    key = ("null " if null else "") + " ".join(sorted(arm.split()))
    if not key:
        return [cfg.seed + i for i in range(cfg.seeds)]
    return [OWN_SEEDS + int(hashlib.sha256(f"{cfg.seed}:{key}#{i}".encode()).hexdigest()[:8], 16) % (2**31 - OWN_SEEDS)
            for i in range(cfg.seeds)]


def sweep_jobs(cfg: TestbedConfig, p: Paths, arms: list[str], null: str | None, bad: str | None) -> tuple[list, dict]:
    """(the drafters of `arms` × seeds, in the order they run; the arms' own caches {name: [extract] settings}).
    Every arm is parsed and checked before anything runs, and trains under seeds of its own (`arm_seeds`). With the
    checks, the null arm's drafters (the first arm again, under its own seeds: its runs sit beside that arm's) and the
    known-bad arm's come right after the first arm's."""
    parsed = [parse_arm(a) for a in arms]  # every arm checked before anything runs
    refuse_repeats(arms)
    key = lambda ext: " ".join(f"{k}={v}" for k, v in sorted(ext.items()))  # noqa: E731
    caches = {slug(key(ext)): ext for ext, _ in parsed if ext}
    jobs = [Job(arm, p.run(slug(arm) if arm else "", seed), p.hidden(slug(key(ext))) if ext else p.hidden(), seed,
                train) for arm, (ext, train) in zip(arms, parsed, strict=True) for seed in arm_seeds(cfg, arm)]
    if cfg.checks:
        first = jobs[0]
        null_jobs = [Job(null, p.run(slug(arms[0]) if arms[0] else "", seed), first.cache, seed, first.settings)
                     for seed in arm_seeds(cfg, arms[0], null=True)]
    else:
        null_jobs = []
    seen: dict[int, str] = {}
    for j in jobs + null_jobs:  # (2^31 seeds: two drafters drawing one is unheard of, but would pair their noise)
        if j.seed in seen:
            raise ConfigError(f"testbed: the arms {seen[j.seed]!r} and {j.arm or '(recipe)'!r} drew the same seed "
                              f"{j.seed}: pass another --seed (every arm's seeds are drawn anew)")
        seen[j.seed] = j.arm or "(recipe)"
    if not cfg.checks:
        return jobs, caches
    bad_jobs = [j for j in jobs if j.arm == bad]
    # arm-major, the checks right after the first arm: a sweep stopped early has whole arms and its checks (the
    # first arm's cache meanwhile serves while the other arms' caches are extracted)
    return jobs[: cfg.seeds] + null_jobs + bad_jobs + [j for j in jobs[cfg.seeds:] if j.arm != bad], caches


def evaluated_arms(arms: list[str], jobs: list) -> tuple[list[str], dict]:
    """(the arms whose every drafter is evaluated, {other arm: how many of its drafters are}), the others logged."""
    complete = [a for a in arms if all((j.run / "eval.json").is_file() for j in jobs if j.arm == a)]
    incomplete = {a or "(recipe)": f"{sum((j.run / 'eval.json').is_file() for j in jobs if j.arm == a)} of "
                  f"{sum(j.arm == a for j in jobs)} drafters evaluated" for a in arms if a not in complete}
    for a, why in incomplete.items():
        log(f"{a}: not ranked, {why}")
    return complete, incomplete


def sweep_rows(complete: list[str], jobs: list, bad: str | None) -> list[dict]:
    """The table's rows (`arm_rows`) of the `complete` arms from their runs' evaluations and final losses, each
    with its seeds; the known-bad arm `bad` apart from the seeds' variance the other arms' intervals pool."""
    rows = arm_rows(complete, {a: [(eval_record(j.run / "eval.json"), run_metrics(j.run).get("loss"))
                                   for j in jobs if j.arm == a] for a in complete}, apart=(bad,) if bad else ())
    for row, a in zip(rows, complete, strict=True):
        row["seeds"] = [j.seed for j in jobs if j.arm == a]
    return rows


def ab(cfg: TestbedConfig, p: Paths, dev: str, device) -> tuple[dict, dict]:
    """Every arm × seed trained, exported and evaluated on the testbed's target and prompts, beside the testbed's own
    phases where they are not done yet (see the module doc); with `checks`, also the null arm (the recipe under seeds
    of its own: `arm_seeds`) and the known-bad arm (a quarter of the steps), which decide whether the arms are ranked
    (`judge`). Returns (A/B record, testbed record)."""
    arms = sweep_arms(cfg.sweep, device.type == "cuda" or cfg.summarize) if cfg.sweep else [a.strip() for a in cfg.arms.split(";")]
    null, bad = check_arms(cfg, arms[0]) if cfg.checks else (None, None)
    if bad and bad not in arms:
        arms.append(bad)
    jobs, caches = sweep_jobs(cfg, p, arms, null, bad)
    if cfg.checks:
        arms.append(null)
    gpus = len(gpu_ids(cfg, dev)) or 1  # (refuses more GPUs than the machine shows, before anything runs)
    parallel = cfg.parallel or default_parallel(device, gpus)
    log(f"{len(arms)} arms × {cfg.seeds} seeds = {len(jobs)} drafters, {parallel} at a time"
        + (f" on {gpus} GPUs" if gpus > 1 else "")
        + (f" (checks: the null arm {null}, the known-bad arm {bad})" if cfg.checks else ""))
    t0 = time.perf_counter()
    tb, times = summary_record(cfg, p) if cfg.summarize else testbed(cfg, p, dev, device, jobs, parallel, caches)
    complete, incomplete = evaluated_arms(arms, jobs)
    if arms[0] not in complete and any("deferred" in t for t in times.values()):
        raise Stopped(f"stopped before every drafter of the first arm ({arms[0] or '(recipe)'}) was evaluated: "
                      f"--stop_after_s={cfg.stop_after_s:g}; a rerun resumes")
    if arms[0] not in complete:
        raise RuntimeError(f"the first arm ({arms[0] or '(recipe)'}) has no evaluation for every seed: nothing to "
                           f"compare with; see the logs under {p.root / 'runs'}")
    rows = sweep_rows(complete, jobs, bad)
    judgement = judge(rows, null, bad) if cfg.checks else None
    failed = failed_runs(p.root, times, [j.run for j in jobs if j.arm in complete])
    return {"testbed": str(p.root), "seeds": cfg.seeds, "arms": rows, "judgement": judgement, "failed": failed,
            "incomplete": incomplete, "deferred": sorted(str(r.relative_to(p.root)) for r, t in times.items()
                                                         if "deferred" in t),
            "recipe": cfg.drafter_recipe, "seconds": round(time.perf_counter() - t0, 1), "parallel": parallel, "gpus": gpus,
            "job_seconds": {str(r.relative_to(p.root)): {**(recorded_seconds(r) if "reused" in t else {}),
                                                          **{k: v if isinstance(v, str) else round(v, 1)
                                                             for k, v in t.items()}} for r, t in times.items()},
            "config": as_dict(cfg), "time": time.time()}, tb
