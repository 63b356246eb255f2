"""The report's figures: one PNG per aspect of a training run, drawn with matplotlib's Agg backend (no display).

Each `plot_*` takes the pyplot module (`pyplot()` imports it, selects Agg and sets the house style), the run's
records (`runlog.read_metrics`), the report directory and the run's name, and returns the PNG it wrote — or None
when the run logged nothing it could show (memory on a CPU run, eval.png without an eval.json). Noisy curves are
drawn raw and faint with their EMA on top (`noisy`); per-slot colours run along one colormap (`slot_colors`) so
slot k has the same colour in every figure. The numbers come from `runlog.py`; this module only draws.
"""

from __future__ import annotations

import math
from pathlib import Path

from .runlog import cumprod, ema, eval_tau, final_slot_acc, series, slot_matrix, tail_median

FIGSIZE = (10, 5.5)
DPI = 110


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
