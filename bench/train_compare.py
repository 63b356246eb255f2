"""Training throughput of variants at the 27B drafter shapes, each variant in a Python process of its own.

    python -m bench.train_compare --variants=bf16,fp8,fp8+fp8head [--steps=40] [--out=FILE]    (GPU)
    python -m bench.train_compare --variants=bf16,fp8 --tiny --steps=4 --log_every=2          (CPU smoke run)
    python -m bench.train_compare --reference=fp8+fp8head+dflash --variants=fp8+fp8head+dflash2 \
        --recipe=manifests/qwen3.6-27b.toml --seq_len=4096 --weighting=dpace --quant=fp4 --steps=20 --log_every=10
                                                  (GPU: DFlash2 against DFlash in the Qwen3.5/3.6-27B recipes'
                                                   training, at its shapes)

Each run is `python -m bench.train --alone --skip_baseline` (ours only, no baseline) in a fresh process, one after
the other on the same GPU: the reference (`--reference`, bf16 by default) first, the other variants in the order
given, the reference again last. A variant is trainer settings joined by "+" in any order, each set by one part at
most: bf16 or fp8 (linears), fp8head (float8 lm_head GEMMs; fp32 logits without it), dflash or dflash2 (the drafter;
without either the recipe's, else DFlash). Whatever a run leaves
behind in its process (`bench.train --precision=fp8` ran its second bf16 run, after the fp8 one, 18 % slower than
its first; the cause is not found) cannot reach the next run. Each variant is compared with the mean of the two
reference runs, in tok/s and per clock (tok/s per SM MHz), and the two reference runs with each other: their drift
over the call, |a − b| / mean. A drift above 3 % means the GPU changed under the comparison (clock, power, another
job) and the ratios are not to be trusted; the output says so. Options not named here go to every `bench.train` run
as given (e.g. `--rows=chat --log_every=5`). The parent touches no GPU: it only starts the runs and reads their JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench import git_commit

REPO = Path(__file__).resolve().parents[1]
REFERENCE = "bf16"  # the default reference: run first and last
MAX_DRIFT = 0.03  # the reference's first vs last run, relative to their mean: above it the comparison is not trustworthy
SETTINGS = {  # a variant's parts (joined by "+", in any order) → the trainer option each sets (trainsetup.py)
    "bf16": {"precision": "bf16"},
    "fp8": {"precision": "fp8"},
    "fp8head": {"loss_logits": "fp8"},
    "dflash": {"variant": "dflash"},
    "dflash2": {"variant": "dflash2"},
}
DEFAULTS = {"loss_logits": "fp32"}  # what a variant that names no part for it runs with
OWN_OPTIONS = ("precision", "loss_logits", "variant", "alone", "skip_baseline", "workdir", "out")


def options(variant: str) -> dict:
    """The trainer options of `variant` (`DEFAULTS` and its parts', whatever their order), or ValueError for an
    unknown part or two parts setting one option (bf16+fp8, dflash+dflash2)."""
    parts = variant.split("+")
    unknown = [s for s in parts if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)} in {variant!r}; known: {', '.join(SETTINGS)} (joined by +)")
    out, by = dict(DEFAULTS), {}
    for s in parts:
        for k, v in SETTINGS[s].items():
            if k in by:
                raise ValueError(f"{by[k]} and {s} in {variant!r} both set {k}: name one")
            out[k], by[k] = v, s
    return out


def run_order(variants: list[str], reference: str = REFERENCE) -> list[str]:
    """The reference first, the other variants once each in the order given, the reference again last; variants
    that run with the same options (fp8head+fp8 = fp8+fp8head) are one variant, its first spelling."""
    try:
        ref = options(reference)
    except ValueError as e:
        raise ValueError(f"--reference: {e}") from None
    bad, seen, others = [], [ref], []
    for v in variants:
        try:
            o = options(v)
        except ValueError as e:
            bad.append(str(e))
            continue
        if o not in seen:
            seen.append(o)
            others.append(v)
    if bad:
        raise ValueError(f"--variants: {'; '.join(bad)}")
    if not others:
        raise ValueError(f"--variants: name a variant besides {reference} (it runs first and last anyway)")
    return [reference, *others, reference]


def child_command(variant: str, out: Path, args, extra: list[str]) -> list[str]:
    """One `bench.train` run of `variant` alone, its result JSON to `out`."""
    return [sys.executable, "-m", "bench.train", "--alone", "--skip_baseline", f"--steps={args.steps}",
            f"--workdir={args.workdir / 'train'}", f"--out={out}",
            *(f"--{k}={v}" for k, v in options(variant).items()),
            # (--tiny: every variant at the fp8 runs' 16 anchors, the token counts float8 GEMMs need)
            *(["--tiny", "--anchors=16"] if args.tiny else []), *extra]


def run_record(variant: str, ours: dict) -> dict:
    """One run's row, from `bench.train`'s result for ours."""
    gpu = ours["gpu"] or {}
    return {"variant": variant, "precision": ours["precision"], "loss_logits": ours["loss_logits"],
            "drafter": ours["variant"],
            "tok_per_s": ours["tok_per_s"], "ms_per_step": ours["ms_per_step"],
            "sm_mhz": gpu.get("sm_mhz"), "sm_mhz_min": gpu.get("sm_mhz_min"), "power_w": gpu.get("power_w"),
            "peak_gb": ours["peak_gb"], "recompiles": ours["recompiles"], "pid": ours["pid"],
            "bench_train": {k: v for k, v in ours.items() if k != "profile"}}


def per_clock(run: dict) -> float | None:
    return run["tok_per_s"] / run["sm_mhz"] if run["sm_mhz"] else None


def ratios(runs: list[dict], reference: str = REFERENCE) -> dict:
    """Each variant's tok/s, tok/s per SM MHz and peak GB over the mean of the two reference runs' (None where a run
    has no such figure: no GPU samples, no peak on the CPU)."""
    a, b = (r for r in runs if r["variant"] == reference)

    def over(x: dict, of) -> float | None:
        va, vb, vx = of(a), of(b), of(x)
        return vx / ((va + vb) / 2) if va and vb and vx is not None else None

    return {x["variant"]: {"tok_per_s": over(x, lambda r: r["tok_per_s"]), "per_clock": over(x, per_clock),
                           "peak_gb": over(x, lambda r: r["peak_gb"])}
            for x in runs if x["variant"] != reference}


def drift(a: float, b: float) -> tuple[float, bool]:
    """How far the reference's rate moved over the call, |a − b| / mean(a, b), and whether that is within MAX_DRIFT."""
    d = abs(a - b) / ((a + b) / 2)
    return d, d <= MAX_DRIFT


def summary(runs: list[dict], reference: str = REFERENCE) -> dict:
    """`ratios`, `drift`, `drift_ok` of the runs so far (None until both reference runs are in)."""
    refs = [r for r in runs if r["variant"] == reference]
    if len(refs) < 2:
        return {"ratios": None, "drift": None, "drift_ok": None}
    d, ok = drift(refs[0]["tok_per_s"], refs[1]["tok_per_s"])
    return {"ratios": ratios(runs, reference), "drift": d, "drift_ok": ok}


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def print_table(res: dict) -> None:
    print(f"\nbench.train_compare, commit {res['commit']}, {res.get('device')}, torch {res.get('torch')}: "
          f"one process a run, in this order\n\n"
          f"| variant | tok/s | ms/step | SM MHz | board W | peak GB | recompiles | pid |\n"
          f"|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['variant']} | {r['tok_per_s']:,.0f} | {r['ms_per_step']:.1f} | {fmt(r['sm_mhz'], '.0f')} | "
              f"{fmt(r['power_w'], '.0f')} | {r['peak_gb']:.1f} | {r['recompiles']} | {r['pid']} |")
    for f in res["failed"]:
        print(f"| {f['variant']} | failed (exit status {f['returncode']}) | | | | | | |")
    ref = res["reference"]
    if res["drift"] is None:
        print(f"\nno ratios: a {ref} run failed")
        return
    print(f"\n| over the mean of the two {ref} runs | tok/s | per clock (tok/s / MHz) | peak GB |\n|---|---|---|---|")
    for v, r in res["ratios"].items():
        print(f"| {v} | {fmt(r['tok_per_s'], '.3f')} | {fmt(r['per_clock'], '.3f')} | {fmt(r['peak_gb'], '.3f')} |")
    a, b = (r["tok_per_s"] for r in res["runs"] if r["variant"] == ref)
    print(f"\n{ref} drift over the call: {100 * res['drift']:.1f} % ({a:,.0f} first, {b:,.0f} last tok/s)")
    if not res["drift_ok"]:
        print(f"NOT TRUSTWORTHY: the two {ref} runs differ by more than {100 * MAX_DRIFT:.0f} %, so the device changed "
              f"under the comparison (clock, power, another job): the ratios are no measurement; run it again")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # (--variant is bench.train's, refused here: not --variants)
    p.add_argument("--variants", default="bf16,fp8,fp8+fp8head",
                   help=f"comma-separated; each of {', '.join(SETTINGS)} joined by + (e.g. fp8+fp8head+dflash2)")
    p.add_argument("--reference", default=REFERENCE,
                   help="the variant run first and last, whose mean the others are compared with")
    p.add_argument("--steps", type=int, default=40, help="training steps a run (bench.train's --steps)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, float8 emulated")
    p.add_argument("--workdir", type=Path, default=Path("build/bench-train-compare"))
    p.add_argument("--out", type=Path, default=None, help="results JSON (written after each run)")
    p.add_argument("--commit", default=None, help="the commit measured; default: git's HEAD here")
    args, extra = p.parse_known_args()
    taken = [a for a in extra if a.lstrip("-").split("=")[0] in OWN_OPTIONS]
    if taken:
        raise SystemExit(f"bench.train_compare: {' '.join(taken)} is set per variant or by the compare: drop it")
    try:
        order = run_order(args.variants.split(","), args.reference)
    except ValueError as e:
        raise SystemExit(f"bench.train_compare: {e}") from None
    res = {"commit": args.commit or git_commit(), "command": shlex.join(["python", "-m", "bench.train_compare",
                                                                         *sys.argv[1:]]),
           "reference": args.reference, "order": order, "steps": args.steps, "bench_train_args": extra, "runs": [], "failed": []}
    for i, variant in enumerate(order):
        out = args.workdir / "runs" / f"{i}-{variant}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        cmd = child_command(variant, out, args, extra)
        print(f"[bench.train_compare] run {i + 1}/{len(order)}: {variant}: {shlex.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO).returncode
        if rc or not out.exists():
            res["failed"].append({"variant": variant, "position": i, "returncode": rc})
        else:
            child = json.loads(out.read_text())
            res.update({k: child[k] for k in ("device", "torch", "shape", "rows")})
            res["runs"].append(run_record(variant, child["ours"]))
        res.update(summary(res["runs"], args.reference))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))
    print_table(res)
    if res["failed"]:
        raise SystemExit(f"bench.train_compare: {len(res['failed'])} run(s) failed: "
                         f"{', '.join(f['variant'] for f in res['failed'])}")


if __name__ == "__main__":
    main()
