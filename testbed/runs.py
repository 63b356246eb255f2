"""The testbed's bookkeeping (`testbed.phases` runs the phases): where everything goes (`Paths`), the phase
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

from dflash_offline.cache.fsio import write_json_atomic
from dflash_offline.cache.manifest import has_manifest, read_manifest
from dflash_offline.config import ConfigError, as_dict, did_you_mean, removed

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
    if "regen" in later:  # (the target-alone decodes of the prompts it chose, with the target that answered them)
        doomed["regen"] += sorted(p.root.glob("baseline-*.json"))
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
    """Share of the regenerated answers that end in a loop (`sources.looping`)."""
    from .sources import looping

    answers = [answer_text(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    return round(sum(map(looping, answers)) / max(len(answers), 1), 4)


def choose_eval_prompts(candidates: Path, greedy: Path, out: Path, n: int, budget: int, first: int = 0) -> dict:
    """Write to `out` the `n` evaluation prompts: the candidates (held-out files' openings, in name-hash order) whose
    greedy answer by the target (`greedy`: regenerated records, `budget` new tokens at most) neither loops nor stops
    before half the budget, in order; where fewer than `n` do, the others after them (counted), those answered before
    those the target ends at once. A reference that loops is easy to draft for any drafter and hides the differences
    the A/B is after; one that stops at once has no verify step to measure: refused when no prompt of the file, or
    of its `first` prompts (what the untrained drafter is evaluated on), has an answer. Returns the counts."""
    from .sources import looping

    cands = [json.loads(x) for x in candidates.read_text().splitlines() if x.strip()]
    answers = [json.loads(x) for x in greedy.read_text().splitlines() if x.strip()]
    loops = [looping(answer_text(r)) for r in answers]
    tokens = [sum(r["regen"]["new_tokens"]) for r in answers]
    short = [t < max(1, budget // 2) for t in tokens]
    usable = [not (a or b) for a, b in zip(loops, short, strict=True)]
    answered = [t > 0 for t in tokens]
    order = sorted(range(len(answers)), key=lambda i: (not usable[i], not answered[i]))  # (stable: candidate order)
    if len(order) < n:
        raise ValueError(f"only {len(order)} held-out prompts were answered for eval_prompts={n}: lower "
                         f"heldout_every or eval_prompts")
    picked = order[:n]  # (the usable first: the untrained drafter's `first` among them)
    head = picked[: first or n]
    if not any(answered[i] for i in head):  # (τ would be 0 tokens over 0 steps)
        which = f"the first {len(head)} of the {n} evaluation prompts" if len(head) < n else f"the {n} evaluation prompts"
        raise ValueError(f"the target answers none of {which}: its greedy answer to each ends at once ({greedy}; "
                         f"{len(answers) - sum(answered)} of {len(answers)} candidates), so no drafter can be measured "
                         f"against it. It is too little trained: give its phase more time (--target_s=, and "
                         f"--target_steps= where that capped it) and rerun from it (--from_phase=target)")
    out.write_text("".join(json.dumps(cands[answers[i]["regen"]["index"]]) + "\n" for i in picked))
    return {"candidates": len(answers), "candidates_looping": round(sum(loops) / max(len(loops), 1), 4),
            "candidates_short": round(sum(short) / max(len(short), 1), 4), "chosen": n,
            "chosen_looping": sum(loops[i] for i in picked), "chosen_short": sum(short[i] for i in picked)}


def eval_looping_share(baseline: Path, tokenizer_dir: Path) -> float | None:
    """Share of the target's greedy decodes of the evaluation prompts (the baseline every evaluation compares with,
    in exact mode) that end in a loop; None before the baseline exists."""
    if not baseline.is_file():
        return None
    from transformers import AutoTokenizer

    from .sources import looping

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
        "tau_trained": tr.get("tau_mean"), "tau_untrained": un.get("tau_mean"), "drafter_run": ev.get("run"),
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
    from dflash_offline.evaluation import tau_text

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
        ("by prompt", " · ".join(f"{k} {tau_text(v['tau_mean'])} ({v['prompts']})" for k, v in (r["by_category"] or {}).items())),
        ("accept ≥k", " ".join(f"{a:.2f}" for a in (r["accept_ge"] or [])[:8]) + " …"),
        ("wall s", ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()) + f"; total {r['wall_s']:.0f}"),
    ]
    return "\n".join(f"{k:>10}  {v}" for k, v in rows)


def parse_arm(text: str) -> tuple[dict, dict]:
    """'key=value key=value' → (extract settings, train settings); a key of neither stage is an error."""
    from dflash_offline.config import ExtractConfig, setting_names
    from dflash_offline.trainsetup import TrainConfig

    ext_keys = {f for f in ExtractConfig.__dataclass_fields__} - {"target", "tokens", "cache", "cache_root",
                                                                   "shards", "device", "dry_run"}
    train_keys = set(setting_names(TrainConfig)) - {"cache", "run", "resume", "seed", "target"}
    ext, train = {}, {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"testbed arm {text!r}: {item!r} is not key=value")
        if key in ext or key in train:
            raise ConfigError(f"testbed arm {text!r}: {key!r} is given twice")
        if key in ext_keys:
            ext[key] = value
        elif key in train_keys:
            train[key] = value
        else:
            raise ConfigError(f"testbed arm {text!r}: {key!r} is no extract or train setting"
                              f"{removed('train', key) or did_you_mean(key, sorted(ext_keys | train_keys))}")
    return ext, train


JOB_FILE = "testbed-job.json"  # in a drafter's run: what it was made from (`job_identity`)
SECONDS_FILE = "testbed-seconds.json"  # in a drafter's run: its seconds per phase and its timeline (wall clock)
# what a drafter's training, export and evaluation run: the code whose change makes an earlier drafter stale (not
# the testbed's orchestration, nor the target's build, which the cache key covers)
DRAFTER_CODE = ("dflash_offline/**/*.py", "stages/train.py", "stages/export.py", "stages/evaluate.py")
# everything a testbed run executes: its own package, every stage it starts, the library, the fixtures that build its
# tokenizer and model config (and what they read: recipes)
TESTBED_CODE = ("dflash_offline/**/*.py", "stages/*.py", "testbed/**/*.py", "fixtures/**/*.py", "manifests/*.toml")


def code_digest(patterns: tuple[str, ...], root: Path | None = None) -> str:
    """SHA-256 over the files under `root` (the repository) that `patterns` match, each with its path."""
    root = root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted({f for pattern in patterns for f in root.glob(pattern)}):
        h.update(f"{f.relative_to(root)}\0".encode() + f.read_bytes())
    return h.hexdigest()


@functools.cache
def drafter_code_digest() -> str:
    """SHA-256 over the sources a drafter's training, export and evaluation run (`DRAFTER_CODE`)."""
    return code_digest(DRAFTER_CODE)


@functools.cache
def testbed_code_digest() -> str:
    """SHA-256 over all the code a testbed run executes (`TESTBED_CODE`, the files present: untracked ones too), taken
    by the invocation that writes the results: what a results file was made with, whatever commit it names."""
    return code_digest(TESTBED_CODE)


def recorded_seconds(run: Path) -> dict:
    """What a drafter's job took when it was made (RUN/testbed-seconds.json; {} for one made by older code)."""
    f = run / SECONDS_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def stale_job(run: Path, identity: dict) -> str | None:
    """Why the drafter in `run` was made from something else than `identity` (its settings, cache, prompts, code),
    or None when it was not (or there is none yet)."""
    if not run.exists():
        return None
    f = run / JOB_FILE
    if not f.is_file():
        return f"{f.name} is missing (made by older code)"
    before = json.loads(f.read_text())
    # (stages.train's arguments compared as a set: an arm's settings were listed in the order it gave them before
    # 89e0665, sorted since — the same drafter either way)
    same = lambda k: (sorted(before.get(k) or []) == sorted(identity.get(k) or []) if k == "train"  # noqa: E731
                      else before.get(k) == identity.get(k))
    changed = [k for k in sorted(set(before) | set(identity)) if not same(k)]
    return f"made with another {', '.join(changed)}" if changed else None


def slug(text: str) -> str:
    return "-".join(x.replace("=", "").replace(".", "p").replace(",", "_") for x in text.split()) or "base"


def cache_complete(cache: Path) -> bool:
    if not has_manifest(cache):
        return False
    m = read_manifest(cache)
    return all(s["status"] == "committed" for s in m["shards"]) and len(m["shards"]) == m["num_shards"]
