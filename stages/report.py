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

import math
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.config import ConfigError, configs_from_argv
from dflash_offline.plots import (
    plot_accuracy,
    plot_accuracy_final,
    plot_eval,
    plot_loss,
    plot_memory,
    plot_tau,
    plot_throughput,
    pyplot,
)
from dflash_offline.runlog import auto_span, eval_tau, final_slot_acc, read_eval, read_metrics, tail_median


@dataclass(frozen=True)
class ReportConfig:
    run: str  # training run directory (holds metrics.jsonl): the directory make train wrote
    out: str = ""  # report directory written; empty = RUN/report
    smooth: int = 0  # EMA span in log records; 0 = automatic, 1 = none

    def resolve(self) -> ReportConfig:
        return self


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
    if positional := [x for x in argv if not x.startswith("-")]:
        raise ConfigError(f"report: the run is now --run={positional[0]} (a positional directory is not read)")
    (cfg,) = configs_from_argv([(ReportConfig, "report")], argv, __doc__)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("matplotlib is not installed: pip install -e '.[report]' (or make setup)") from None
    out = run(cfg.run, cfg.out or None, cfg.smooth)
    for f in sorted(out.iterdir()):
        print(f"  {f.name}")
    print(out)
    return out


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
