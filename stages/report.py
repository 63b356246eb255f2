"""PNG plots and a summary page of a training run.

    python -m stages.report --run=runs/x [--out=runs/x/report] [--smooth=0]
    make report RUN=runs/x

Reads `RUN/metrics.jsonl` (one JSON object per log step, written by `make train`) and, when present,
`RUN/eval.json` (real acceptance length from `make eval`), and writes into `RUN/report/`:

- `loss.png`        training loss (log scale), learning rate and gradient norm over steps;
- `accuracy.png`    teacher-forced accuracy of every block slot k = 1..B−1 over steps (slot k predicts the token k
                    positions after the anchor; later slots are harder);
- `accuracy_final.png`  the same per-slot accuracy at the end of the run as bars, with the probability that slots
                    1..k are all right (the product the simulated τ sums);
- `tau.png`         simulated acceptance length `1 + Σ_k Π_{i≤k} acc_i` and mean per-block τ (1 + leading correct
                    slots) over steps, with the real τ from `eval.json` when there is one;
- `throughput.png`  training tokens/s, share of wall time spent waiting for data, model-FLOP utilization and
                    recompiles;
- `memory.png`      reserved and peak allocated GPU memory (only when the run logged them, i.e. on GPU);
- `eval.png`        from `eval.json` (and `eval-untrained.json`): the share of verify steps that accepted at least k
                    drafts, k = 1..B−1 (real speculative decoding; τ = 1 + the sum of the bars), and the mean accepted
                    length per prompt category when the prompts carried one;
- `index.md`        the figures with the final numbers.

Noisy curves are drawn raw (faint) and smoothed (an exponential moving average; `--smooth=N` sets its span in log
records, 0 = automatic). A resumed run may log a step twice: the later record wins. Needs matplotlib (the Agg
backend: no display).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FIGSIZE = (10, 5.5)
DPI = 110
EVAL_TAU_KEYS = ("tau_mean", "tau", "real_tau", "acceptance_length", "mean_acceptance_length", "accept_length",
                 "mean_accept_len", "avg_accept_length")


# --- reading -------------------------------------------------------------------------------------------------


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


# --- drawing -------------------------------------------------------------------------------------------------


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "axes.titlesize": 12, "axes.labelsize": 11,
                         "legend.fontsize": 9, "figure.titlesize": 14, "figure.titleweight": "bold"})
    return plt


def noisy(ax, xs, ys, span: int, color, label: str, lw: float = 2.0) -> None:
    """Raw values faint, the smoothed curve on top (the raw line alone when there is nothing to smooth)."""
    if span > 1:
        ax.plot(xs, ys, color=color, alpha=0.25, lw=1)
        ax.plot(xs, ema(ys, span), color=color, lw=lw, label=f"{label} (EMA over {span} log records)")
    else:
        ax.plot(xs, ys, color=color, lw=lw, marker="o" if len(xs) <= 30 else None, ms=3, label=label)


def finish(fig, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_loss(plt, recs, out: Path, span: int, run_name: str) -> Path:
    xs, ys = series(recs, "loss")
    gx, gy = series(recs, "grad_norm")
    lx, ly = series(recs, "lr")
    rows = 3 if gy else 2
    fig, axes = plt.subplots(rows, 1, figsize=(FIGSIZE[0], 7.5 if rows == 3 else 6.5), sharex=True,
                             gridspec_kw={"height_ratios": [2.2] + [1] * (rows - 1)})
    ax = axes[0]
    noisy(ax, xs, ys, span, "C0", "training loss")
    if ys and min(ys) > 0:
        ax.set_yscale("log")
        plain = plt.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        if max(ys) / min(ys) < 30:  # less than ~1.5 decades: label the minor ticks too
            ax.yaxis.set_minor_formatter(plain)
    ax.set_ylabel("loss (weighted CE, log scale)")
    ax.set_title(f"final {ys[-1]:.4g} at step {xs[-1]}" if ys else "no loss logged")
    ax.legend(loc="upper right")
    ax = axes[1]
    ax.plot(lx, ly, color="C2", lw=2)
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if rows == 3:
        ax = axes[2]
        noisy(ax, gx, gy, span, "C3", "grad norm (before clipping)", lw=1.5)
        ax.set_ylabel("gradient norm")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("optimizer step")
    return finish(fig, out / "loss.png", f"Loss and learning rate — {run_name}")


def slot_colors(plt, n: int):
    cmap = plt.get_cmap("viridis")
    return [cmap(0.9 * k / max(n - 1, 1)) for k in range(n)]


def plot_accuracy(plt, recs, out: Path, span: int, run_name: str) -> Path | None:
    xs, rows = slot_matrix(recs)
    if not rows:
        return None
    n = len(rows[0])
    colors = slot_colors(plt, n)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for k in range(n):
        ys = [r[k] for r in rows]
        ax.plot(xs, ema(ys, span), color=colors[k], lw=1.8, label=f"slot {k + 1}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("teacher-forced accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("slot k predicts the token k positions after the block's anchor"
                 + (f"; EMA over {span} log records" if span > 1 else ""))
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 if n <= 16 else 2, title="block slot")
    return finish(fig, out / "accuracy.png", f"Accuracy per block slot — {run_name}")


def plot_accuracy_final(plt, recs, out: Path, run_name: str) -> Path | None:
    acc, where = final_slot_acc(recs)
    if not acc:
        return None
    n = len(acc)
    ks = list(range(1, n + 1))
    fig, ax = plt.subplots(figsize=FIGSIZE)
    bars = ax.bar(ks, [a if math.isfinite(a) else 0 for a in acc], color=slot_colors(plt, n), alpha=0.85,
                  label="accuracy of slot k")
    for b, a in zip(bars, acc, strict=True):
        if math.isfinite(a):
            ax.annotate(f"{a:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    cp = cumprod(acc)
    ax.plot(ks, cp, color="C3", marker="o", lw=2, label=r"P(slots 1..k all right) = $\Pi_{i \leq k}\,\mathrm{acc}_i$")
    ax.set_xticks(ks)
    ax.set_xlabel("block slot k (tokens after the anchor)")
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1.08)
    ax.set_title(f"{where}; simulated τ = 1 + Σ of the red curve = {1 + sum(cp):.2f}")
    ax.legend(loc="upper right")
    return finish(fig, out / "accuracy_final.png", f"Final accuracy per block slot — {run_name}")


def plot_tau(plt, recs, out: Path, span: int, run_name: str, ev: dict | None, base: dict | None) -> Path | None:
    sx, sy = series(recs, "sim_tau")
    bx, by = series(recs, "block_tau")
    if not sy and not by:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if sy:
        noisy(ax, sx, sy, span, "C0", r"simulated τ = $1 + \Sigma_k\,\Pi_{i \leq k}\,\mathrm{acc}_i$")
    if by:
        noisy(ax, bx, by, span, "C1", "block τ = mean(1 + leading correct slots)")
    if (real := eval_tau(ev)) is not None:
        at = f" at step {ev['step']}" if isinstance(ev.get("step"), int) else ""
        ax.axhline(real, color="C3", ls="--", lw=1.8, label=f"real τ (speculative decoding{at}) = {real:.2f}")
        if at:
            ax.plot([ev["step"]], [real], "*", color="C3", ms=14)
    if (untrained := eval_tau(base)) is not None:
        ax.axhline(untrained, color="C7", ls=":", lw=1.5, label=f"real τ of the untrained drafter = {untrained:.2f}")
    width = max((len(r.get("acc") or []) for r in recs), default=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("acceptance length τ (tokens per target step)")
    ax.set_ylim(bottom=0.95)  # τ >= 1; a little room so a line at 1 (an untrained drafter) stays visible
    last = [f"simulated {sy[-1]:.2f}" if sy else "", f"block {by[-1]:.2f}" if by else ""]
    ax.set_title(f"teacher-forced, at step {max(sx + bx)}: {', '.join(x for x in last if x)}"
                 + (f" (at most {width + 1})" if width else ""))
    ax.legend(loc="lower right")
    return finish(fig, out / "tau.png", f"Acceptance length — {run_name}")


def plot_throughput(plt, recs, out: Path, span: int, run_name: str) -> Path | None:
    tx, ty = series(recs, "tok_per_s")
    wx, wy = series(recs, "data_wait_frac")
    fx, fy = series(recs, "flop_frac")
    if not ty:
        return None
    has_mfu = any(v > 0 for v in fy)
    rows = 3 if has_mfu else 2
    fig, axes = plt.subplots(rows, 1, figsize=(FIGSIZE[0], 7.5 if rows == 3 else 6.5), sharex=True,
                             gridspec_kw={"height_ratios": [2] + [1] * (rows - 1)})
    ax = axes[0]
    if len(tx) > 2:  # the first log window includes compilation: a marker, not the start of the curve
        ax.plot(tx[:1], ty[:1], "x", color="C7", ms=8, mew=2, label="first log window (warm-up / compile; left out)")
        tx, ty = tx[1:], ty[1:]
    noisy(ax, tx, ty, span, "C0", "training tokens/s (all processes)")
    med = tail_median(recs, "tok_per_s")
    if med is not None:
        ax.axhline(med, color="C7", ls=":", lw=1.2, label=f"median, second half: {med:,.0f} tok/s")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    # recompiles after warm-up are bugs: mark where the counter grew
    rx, ry = series(recs, "recompiles")
    grew = [x for x, (a, b) in zip(rx[1:], zip(ry, ry[1:], strict=False), strict=False) if b > a]
    for i, x in enumerate(grew):
        ax.axvline(x, color="C3", lw=1, alpha=0.6, label="recompile" if i == 0 else None)
    ax.set_title(f"recompiles: {int(ry[-1]) if ry else 0} in total" + (" (red lines)" if grew else ""))
    ax.legend(loc="lower right")
    ax = axes[1]
    ax.plot(wx, [100 * v for v in wy], color="C1", lw=1.8)
    ax.set_ylabel("data wait (% of time)")
    ax.set_ylim(bottom=0, top=max(5.0, 110 * max(wy, default=0)))
    if has_mfu:
        ax = axes[2]
        ax.plot(fx, [100 * v for v in fy], color="C2", lw=1.8)
        ax.set_ylabel("MFU (% of bf16 peak)")
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("optimizer step")
    return finish(fig, out / "throughput.png", f"Throughput — {run_name}")


def plot_memory(plt, recs, out: Path, run_name: str) -> Path | None:
    rx, ry = series(recs, "reserved_gb")
    px, py = series(recs, "peak_gb")
    if not ry and not py:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if ry:
        ax.plot(rx, ry, color="C0", lw=2, label="reserved by the caching allocator")
    if py:
        ax.plot(px, py, color="C1", lw=2, ls="--", label="peak allocated")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GPU memory (GiB, rank 0)")
    ax.set_ylim(bottom=0, top=1.15 * max(ry + py))
    flat = ""
    if len(ry) > 2:
        growth = ry[-1] - ry[1]
        flat = f"reserved after warm-up: {ry[1]:.1f} → {ry[-1]:.1f} GiB ({growth:+.2f})"
    ax.set_title(flat or "memory")
    ax.legend(loc="lower right")
    return finish(fig, out / "memory.png", f"GPU memory — {run_name}")


def finite_list(v) -> list[float] | None:
    ok = isinstance(v, list) and v and all(isinstance(x, int | float) and math.isfinite(x) for x in v)
    return [float(x) for x in v] if ok else None


def plot_eval(plt, out: Path, run_name: str, ev: dict | None, base: dict | None) -> Path | None:
    acc, real = finite_list((ev or {}).get("accept_ge")), eval_tau(ev)
    if acc is None or real is None:
        return None
    cats = {c: v for c, v in (ev.get("by_category") or {}).items()
            if isinstance(v, dict) and isinstance(v.get("tau_mean"), int | float) and math.isfinite(v["tau_mean"])}
    fig, axes = plt.subplots(1, 2 if cats else 1, figsize=FIGSIZE, squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2] if cats else [1]})
    ax, ks = axes[0][0], list(range(1, len(acc) + 1))
    step = f"step {ev['step']}" if isinstance(ev.get("step"), int) else "the drafter"
    ax.bar(ks, acc, color=slot_colors(plt, len(acc)), alpha=0.85, label=f"{step}: real τ = {real:.2f}")
    if (base_acc := finite_list((base or {}).get("accept_ge"))) is not None and eval_tau(base) is not None:
        ax.plot(list(range(1, len(base_acc) + 1)), base_acc, color="C7", marker="o", lw=1.5,
                label=f"untrained: real τ = {eval_tau(base):.2f}")
    ax.set_xticks(ks)
    ax.set_xlabel("k (drafts after the anchor)")
    ax.set_ylabel("share of verify steps accepting ≥ k drafts")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{ev.get('num_prompts', '?')} prompts, {ev.get('verify_steps', '?')} verify steps; "
                 f"τ = 1 + Σ bars")
    ax.legend(loc="upper right")
    if cats:
        ax = axes[0][1]
        names = sorted(cats)
        bars = ax.bar(names, [cats[c]["tau_mean"] for c in names], color="C0", alpha=0.85)
        for b, c in zip(bars, names, strict=True):
            ax.annotate(f"{cats[c]['tau_mean']:.2f} ({cats[c].get('prompts', '?')})",
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.axhline(real, color="C3", ls="--", lw=1.5, label=f"all prompts: {real:.2f}")
        ax.set_ylabel("mean accepted length τ")
        ax.set_ylim(bottom=0)
        ax.set_title("per prompt category (prompts)")
        ax.tick_params(axis="x", labelrotation=30 if len(names) > 4 else 0)
        ax.legend(loc="best")
    return finish(fig, out / "eval.png", f"Acceptance in real speculative decoding — {run_name}")


# --- summary page --------------------------------------------------------------------------------------------


def fmt(v, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, spec)


def final_numbers(recs: list[dict], ev: dict | None) -> list[tuple[str, str]]:
    last = recs[-1]
    acc, where = final_slot_acc(recs)
    rows = [
        ("last logged step", str(last["step"])),
        ("loss", fmt(last.get("loss"))),
        ("simulated τ (teacher-forced)", fmt(last.get("sim_tau"), ".3f")),
        ("block τ (teacher-forced)", fmt(last.get("block_tau"), ".3f")),
    ]
    if real := eval_tau(ev):
        rows.append(("real τ (eval.json)", fmt(real, ".3f")))
        if isinstance(ev.get("speedup"), int | float):
            rows.append(("speed-up over the target alone (eval.json)", f"×{fmt(ev['speedup'], '.2f')}"))
        if all(isinstance(ev.get(k), int | float) for k in ("draft_ms", "verify_ms", "speedup_engine_est")):
            rows.append(("draft / verify ms per step (eval.json)",
                         f"{fmt(ev['draft_ms'], '.2f')} / {fmt(ev['verify_ms'], '.2f')}"))
            rows.append(("engine speed-up estimate τ / (1 + draft/verify) (eval.json)",
                         f"×{fmt(ev['speedup_engine_est'], '.2f')}"))
    if acc:
        rows.append((f"accuracy slot 1 / {len(acc)} ({where})", f"{fmt(acc[0], '.3f')} / {fmt(acc[-1], '.3f')}"))
    rows += [
        ("learning rate", fmt(last.get("lr"), ".3g")),
        ("grad norm", fmt(last.get("grad_norm"), ".3g")),
        ("tokens/s (median, second half)", fmt(tail_median(recs, "tok_per_s"), ",.0f")),
        ("ms/step (median, second half)", fmt(tail_median(recs, "ms_per_step"), ".1f")),
        ("data wait (median, second half)", fmt((tail_median(recs, "data_wait_frac") or 0) * 100, ".2f") + " %"),
    ]
    mfu = tail_median(recs, "flop_frac")
    if mfu:
        rows.append(("MFU (median, second half)", fmt(mfu * 100, ".1f") + " %"))
    rows.append(("recompiles", str(last.get("recompiles", "–"))))
    if "reserved_gb" in last:
        rows.append(("GPU memory reserved / peak (GiB)", f"{fmt(last.get('reserved_gb'), '.2f')} / "
                                                         f"{fmt(last.get('peak_gb'), '.2f')}"))
    return rows


def eval_fields(ev: dict) -> list[tuple[str, str]]:
    """Scalar fields of eval.json, one level of nesting flattened (`teacher_forced.sim_tau`); lists left out."""
    rows = []
    for k, v in ev.items():
        if k in ("config", "per_prompt", "time"):
            continue
        items = [(f"{k}.{kk}", vv) for kk, vv in v.items()] if isinstance(v, dict) else [(k, v)]
        for name, val in items:
            if isinstance(val, float):
                rows.append((name, fmt(val)))
            elif isinstance(val, bool | int | str) or val is None:
                rows.append((name, str(val)))
    return rows


CAPTIONS = {
    "loss.png": "Loss (log scale), learning rate and gradient norm.",
    "accuracy.png": "Teacher-forced accuracy of each block slot over training.",
    "accuracy_final.png": "Per-slot accuracy at the end, and the chance that slots 1..k are all right.",
    "tau.png": "Simulated and per-block acceptance length (teacher-forced), and the real τ when evaluated.",
    "throughput.png": "Training tokens/s, data wait, MFU; red lines mark recompiles.",
    "memory.png": "Reserved and peak GPU memory: should be flat after warm-up.",
    "eval.png": "Real speculative decoding: share of verify steps accepting at least k drafts, τ per prompt category.",
}


def write_index(out: Path, run: Path, recs, ev, figures: list[Path], notes: list[str]) -> Path:
    lines = [f"# Training report — {run.name}", "", f"Run `{run}`, {len(recs)} log records, "
             f"steps {recs[0]['step']}–{recs[-1]['step']}.", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in final_numbers(recs, ev)]
    if ev:
        lines += ["", "## eval.json", "", "| field | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in eval_fields(ev)]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Figures", ""]
    for f in figures:
        lines += [f"### {f.name}", "", CAPTIONS.get(f.name, ""), "", f"![{f.stem}]({f.name})", ""]
    path = out / "index.md"
    path.write_text("\n".join(lines))
    return path


# --- the run -------------------------------------------------------------------------------------------------


def run(run_dir: str | Path, out: str | Path | None = None, smooth: int = 0) -> Path:
    """Write the figures and index.md; returns the report directory."""
    run_dir = Path(run_dir)
    recs, notes = read_metrics(run_dir / "metrics.jsonl")
    ev = read_eval(run_dir)
    out = Path(out) if out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    span = smooth or auto_span(len(recs))
    plt = pyplot()
    name = run_dir.resolve().name
    base = read_eval(run_dir, "eval-untrained.json")
    figures = [plot_loss(plt, recs, out, span, name), plot_accuracy(plt, recs, out, span, name),
               plot_accuracy_final(plt, recs, out, name), plot_tau(plt, recs, out, span, name, ev, base),
               plot_throughput(plt, recs, out, span, name), plot_memory(plt, recs, out, name),
               plot_eval(plt, out, name, ev, base)]
    figures = [f for f in figures if f is not None]
    write_index(out, run_dir, recs, ev, figures, notes)
    return out


def main(argv: list[str]) -> Path:
    p = argparse.ArgumentParser(prog="python -m stages.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="", help="training run directory (holds metrics.jsonl)")
    p.add_argument("--out", default="", help="report directory (default RUN/report)")
    p.add_argument("--smooth", default="", help="EMA span in log records (default 0 = automatic, 1 = none)")
    p.add_argument("run_pos", nargs="?", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    run_dir = a.run or a.run_pos
    if not run_dir:
        raise ValueError("no run: pass --run=DIR (RUN= in make), the directory make train wrote")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("matplotlib is not installed: pip install -e '.[report]' (or make setup)") from None
    out = run(run_dir, a.out or None, int(a.smooth or 0))
    for f in sorted(out.iterdir()):
        print(f"  {f.name}")
    print(out)
    return out


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
