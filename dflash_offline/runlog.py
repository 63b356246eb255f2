"""A training run's records as numbers: metrics.jsonl and eval.json read back, series, smoothing, final values.

`metrics.py` writes metrics.jsonl (one JSON object per log step); this module reads it for the report
(`stages/report.py`) and its figures (`plots.py`). Reading is forgiving where a run leaves honest debris — a cut
last line from a kill mid-write, a step logged twice by a resumed run (the later record wins), a non-finite loss
— and says what it dropped in notes rather than failing. Everything else is pure functions of the records: a
metric's finite (step, value) series, an exponential moving average that leaves gaps as gaps, per-slot accuracy
rows and their final mean, the product the simulated τ sums, and medians over the second half of a run (the
first record, with compilation and warm-up, left out). `make eval`'s JSON is read as it is; its real τ is found
under any of the names in `EVAL_TAU_KEYS`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

EVAL_TAU_KEYS = ("tau_mean", "tau", "real_tau", "acceptance_length", "mean_acceptance_length", "accept_length",
                 "mean_accept_len", "avg_accept_length")


def read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """Records sorted by step (the last record of a step wins) and notes about what was dropped."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist: RUN= must be a training run directory (make train RUN=...)")
    by_step: dict[int, dict] = {}
    bad, dupes = [], 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
            except (ValueError, KeyError, TypeError):
                bad.append(line_no)
                continue
            dupes += step in by_step
            by_step[step] = rec
    notes = []
    if bad:
        notes.append(f"{len(bad)} unreadable line(s) of {path.name} skipped (line {', '.join(map(str, bad[:5]))}"
                     f"{', …' if len(bad) > 5 else ''}); a run killed mid-write leaves a cut last line")
    if dupes:
        notes.append(f"{dupes} step(s) logged twice (a resumed run): the later record is plotted")
    nonfinite = [s for s, r in by_step.items() if not isinstance(r.get("loss"), int | float)
                 or not math.isfinite(r["loss"])]
    if nonfinite:
        notes.append(f"{len(nonfinite)} log record(s) with a non-finite or missing loss (first at step "
                     f"{min(nonfinite)}) are not plotted: the run diverged or logged nothing there")
    if not by_step:
        raise ValueError(f"{path} has no metrics yet: the run logs every log_every steps")
    return [by_step[s] for s in sorted(by_step)], notes


def read_eval(run: Path, name: str = "eval.json") -> dict | None:
    """`make eval`'s JSON (real τ `tau_mean`, speed-up, lossless check, teacher-forced estimate), if any."""
    p = run / name
    if not p.is_file():
        return None
    try:
        obj = json.loads(p.read_text())
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def eval_tau(ev: dict | None) -> float | None:
    if not ev:
        return None
    for key in EVAL_TAU_KEYS:
        v = ev.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of a scalar metric (records without it are left out)."""
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def ema(ys: list[float], span: int) -> list[float]:
    if span <= 1:
        return list(ys)
    a, out, m = 2 / (span + 1), [], None
    for y in ys:
        if not math.isfinite(y):  # a slot without labels in that window: a gap, not a NaN forever after
            out.append(math.nan)
            continue
        m = y if m is None else a * y + (1 - a) * m
        out.append(m)
    return out


def auto_span(n: int) -> int:
    return 1 if n < 30 else max(2, n // 25)


def slot_matrix(recs: list[dict]) -> tuple[list[int], list[list[float]]]:
    """Steps and per-slot accuracy rows (NaN where a slot had no label)."""
    xs, rows = [], []
    width = max((len(r.get("acc") or []) for r in recs), default=0)
    for r in recs:
        acc = r.get("acc")
        if not isinstance(acc, list) or not acc:
            continue
        row = [float(a) if isinstance(a, int | float) and a is not None else math.nan for a in acc]
        rows.append(row + [math.nan] * (width - len(row)))
        xs.append(r["step"])
    return xs, rows


def final_slot_acc(recs: list[dict]) -> tuple[list[float], str]:
    """Per-slot accuracy averaged over the last ~10% of log records (at most 20): one record is noisy."""
    xs, rows = slot_matrix(recs)
    if not rows:
        return [], ""
    n = min(20, max(1, len(rows) // 10))
    tail = rows[-n:]
    mean = []
    for k in range(len(tail[0])):
        vals = [r[k] for r in tail if math.isfinite(r[k])]
        mean.append(sum(vals) / len(vals) if vals else math.nan)
    where = f"step {xs[-1]}" if n == 1 else f"mean of the last {n} log records, steps {xs[-n]}–{xs[-1]}"
    return mean, where


def cumprod(vals: list[float]) -> list[float]:
    out, p = [], 1.0
    for v in vals:
        p *= v if math.isfinite(v) else 0.0
        out.append(p)
    return out


def tail_median(recs: list[dict], key: str) -> float | None:
    """Median over the second half of the run, without the first record (compile / warm-up)."""
    _, ys = series(recs[1:] if len(recs) > 2 else recs, key)
    if not ys:
        return None
    ys = sorted(ys[len(ys) // 2:])
    return ys[len(ys) // 2]
