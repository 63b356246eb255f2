"""The GPU quality yardstick: a realistic target trained from real text, the whole pipeline, real τ as the measure.

    python -m testbed [--dir=build/testbed] [--from_phase=train]          (make testbed [TESTBED_FROM=train])
    python -m testbed --arms="gamma=5;num_anchors=256" --seeds=2           (make testbed-ab ARGS_A= ARGS_B=)
    python -m testbed --sweep=options[,encodings,fp8]                      (make testbed-sweep [SWEEP=])

Phases, each skipped when already done (a rerun resumes; `--from_phase` redoes that phase and every later one):
1. `target`: the Python sources of this interpreter and its packages (`testbed.sources`: deterministic
   selection, held-out files disjoint by name hash, the file list's digest part of the testbed's identity), a BPE
   tokenizer trained on them and a ~120M-parameter Qwen3.5-architecture target trained from scratch for
   `target_s` seconds (`testbed.target`), written to DIR/target like a real checkpoint.
2. `regen`: "continue this file" prompts (a training file's first lines) answered by the target (make regen:
   greedy, batched).
3. `extract`: token cache + hidden cache of the regenerated corpus (manifests/testbed.toml).
4. `train` → `export` → `eval`: the drafter (the recipe's [train], compiled flex on CUDA), its z-lab export, and
   real speculative decoding on `eval_prompts` held-out prompts in exact mode (float32: any difference from the
   target's greedy output fails); an untrained drafter of the same shape is evaluated on the first
   `untrained_prompts` of them while the drafter trains (it needs only the run's config).
The target-alone decodes are made once (DIR/baseline-<tokens>.json), beside the extraction (`--ahead`; else by that
untrained evaluation), and reused by every evaluation against the same target.
Result: DIR/testbed.json and a table (target loss, regen tokens, extraction tok/s, drafter steps and tok/s, τ
trained and untrained, acceptance per position, lossless, wall time per phase).

A/B (`--arms`, `;`-separated arms of space-separated `key=value` settings, "" = the recipe as it is): the phases
above run first where not done yet, then each arm's drafter is trained with `--seeds` seeds on the testbed's cache (a setting of [extract], e.g. `quant=fp8`, gives the
arm its own cache extracted from the same target and corpus), exported and evaluated on the same prompts;
reported: τ per seed, τ with the seeds pooled, spread (max − min), final loss, lossless, each arm's difference of
pooled τ to the first arm's and its 95 % interval by a paired bootstrap over the prompts (every seed's tokens and steps
pooled per prompt). A run made from other settings, cache, prompts or drafter code than asked is made again. `--sweep=` runs
the arms of one or more presets (`SWEEPS`): `options`, the existing options (γ, anchors per row, noise, D-PACE, fp8
cache); `encodings`, the cache encodings (fp8, fp4, projected taps alone and with fp8); `fp8`, float8 training
(linears, lm_head, both; the float8 linears on a GPU only). Jobs run `--parallel` at a time, each compiling with its share of the CPUs (their timings then overlap;
τ does not depend on it). Results in DIR/ab/<label>.json (with each job's seconds per phase) and DIR/testbed.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from dflash_offline.cache.fsio import write_json_atomic
from dflash_offline.config import ConfigError, config_from_argv

from .ab import ab
from .commands import Stopped, log
from .config import TestbedConfig, apply_preset
from .phases import testbed
from .report import ab_table, heartbeat, sweep_results
from .runs import Paths, table


def main(argv: list[str]) -> int:
    from dflash_offline.cli import private_compile_caches
    from dflash_offline.devices import pick_device

    cfg = apply_preset(config_from_argv(TestbedConfig, "testbed", argv, __doc__), argv).resolve()
    device = pick_device(cfg.device, "testbed.device")
    dev = device.type
    if dev == "cpu" and cfg.preset != "micro" and not cfg.summarize:
        raise ConfigError(f"the {cfg.preset} testbed trains a 124M-parameter target and runs every phase on a GPU; "
                          "this machine has none (--preset=micro runs the phases' logic at toy sizes on a CPU)")
    p = Paths(cfg.dir)
    p.root.mkdir(parents=True, exist_ok=True)
    # the compile caches every stage and drafter of the invocation shares, fixed before anything compiles here (the
    # target's training in this process would otherwise set Inductor's default, /tmp/torchinductor_<user>, into the
    # environment the later processes inherit: the stand-ins compiled there, the drafters of a rerun read elsewhere)
    private_compile_caches(0)
    if cfg.from_phase == "target" and not cfg.summarize:  # (a summary redoes nothing: the seconds stay)
        p.wall.unlink(missing_ok=True)
    if not cfg.summarize:
        heartbeat(p, sweep_tag(cfg))
    log(f"testbed {p.root} on {device} (preset {cfg.preset}): {json.dumps(asdict(cfg))}")
    try:
        if cfg.arms or cfg.sweep:
            return finish_ab(cfg, p, *ab(cfg, p, dev, device))
        tb, _ = testbed(cfg, p, dev, device)
    except Stopped as e:
        log(str(e))
        return 3
    if not cfg.summarize:
        write_testbed(p, tb)
        print(p.root / "testbed.json")
    return 0


def end_on_sigterm() -> None:
    """SIGTERM ends the testbed at once (a rerun resumes: phases from state.json, drafters from their runs; no drafter
    in flight is waited for) and, first, every process it started (`worker.end_children`: the stages beside, the
    workers, the stand-ins), which would otherwise go on on the GPU without it; exit status 143."""
    import contextlib
    import os
    import signal

    from .worker import end_children

    ending = []

    def handler(signum, frame):
        if ending:  # (a second SIGTERM while the first ends the children: the first goes on)
            return
        ending.append(signum)
        try:
            n = end_children()
            with contextlib.suppress(OSError):  # (no print: the interrupted code may be writing to stderr)
                os.write(2, f"[testbed] stopped by SIGTERM, with the {n} process(es) it had running; a rerun "
                            f"resumes\n".encode())
        finally:
            os._exit(143)

    signal.signal(signal.SIGTERM, handler)


def write_testbed(p: Paths, tb: dict) -> None:
    write_json_atomic(p.root / "testbed.json", tb)
    print(table(tb))


def ab_label(cfg: TestbedConfig) -> str:
    """An A/B sweep's name: its record is DIR/ab/<label>.json, and its invocations' seconds are told by it."""
    return cfg.label or cfg.sweep.replace(",", "+") or "ab"


def sweep_tag(cfg: TestbedConfig) -> dict:
    """What an invocation's seconds are told by in DIR/wall.json: its label (`sweep`) and the arms it runs (`arms`: a
    digest of the presets of --sweep, or of the first arm and the others in any order), so that two sweeps of other
    arms under one label are told apart, and one sweep summarized under another label is alike; both None: the
    testbed's phases alone."""
    import hashlib

    if not (cfg.arms or cfg.sweep):
        return {"sweep": None, "arms": None}
    arms = [a.strip() for a in cfg.arms.split(";")] if cfg.arms else []
    spec = f"sweep={cfg.sweep}" if cfg.sweep else "arms=" + ";".join([arms[0], *sorted(arms[1:])])
    return {"sweep": ab_label(cfg), "arms": hashlib.sha256(spec.encode()).hexdigest()[:12]}


def finish_ab(cfg: TestbedConfig, p: Paths, r: dict, tb: dict) -> int:
    """Write and print the A/B record `r` (DIR/ab/<label>.json, `--results=`) and the testbed's `tb`; exit status 1
    when a drafter failed or the yardstick did not discriminate."""
    out = p.root / "ab" / f"{ab_label(cfg)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, r)
    if not cfg.summarize:
        write_testbed(p, tb)
    if cfg.results:
        Path(cfg.results).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(cfg.results), sweep_results(r, tb, p, sweep_tag(cfg)))
    print(ab_table(r))
    for run, e in r["failed"].items():
        print(f"FAILED {run}: {e}")
    print(out)
    if cfg.results:
        print(cfg.results)
    if not cfg.summarize:
        print(p.root / "testbed.json")
    unranked = r["judgement"] is not None and not r["judgement"]["discriminating"]
    if r.get("deferred"):
        log(f"stopped early: {len(r['deferred'])} drafter(s) not started within --stop_after_s={cfg.stop_after_s:g}; "
            f"a rerun resumes")
    return 1 if r["failed"] else 3 if r.get("deferred") else 1 if unranked else 0
