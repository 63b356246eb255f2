"""Stage 2: train a DFlash drafter on a hidden-state cache.

    python -m stages.train --recipe=manifests/demo.toml --cache=DIR --run=runs/x [--resume=1] ...
    accelerate launch --num_processes N -m stages.train ...        (one process per GPU; NPROC=N in make)

Sections: config → compute → model → optimizer → data → loop. Fixed shapes everywhere: B rows per micro-batch,
A anchors per row (padded with a keep mask, resampled every step), so the compiled step sees one shape; after the
warm-up step any recompile is an error. The streaming loader splits rows by rank itself (it never goes through
accelerator.prepare). Each row's anchors and noise come from a generator seeded by (seed, the row's place in the
run's sequence of rows), so resumed, 1-process and N-process runs — also a resume on another processes × batch_rows
split of the same global batch — see the same anchors for the same rows. A step draws the blocks of all its
micro-batches first, and divides each one's loss by the step's loss weight over all its micro-batches and processes
(`loss.step_normalizer`). A resume given no recipe (`make train RUN= RESUME=1`) continues with the settings
RUN/config.json records, the command line's replacing theirs (`trainrun.recorded_settings`). The run, in those sections: `dflash_offline.trainrun`; the loop:
`dflash_offline.trainer.Trainer`; what the settings mean on this machine: `dflash_offline.trainsetup`; the metrics
windows and the run's last line: `dflash_offline.metrics`.
"""

from __future__ import annotations

import os
import sys

from dflash_offline.config import ConfigError, configs_from_argv
from dflash_offline.runguard import Interrupted
from dflash_offline.trainrun import recorded_settings, run
from dflash_offline.trainsetup import BenchSwitches, TrainConfig, check_recipe_taps


def main(argv: list[str], switches: BenchSwitches = BenchSwitches()) -> int:
    """The stage on `argv`; `switches` are benchmarks' performance switches (the testbed's training worker passes
    them), not options."""
    from dflash_offline.cli import private_compile_caches, unbuffered

    private_compile_caches()  # before anything compiles: per-rank caches, no autotuner races between processes
    unbuffered()
    recorded, note = recorded_settings(argv)
    try:
        (cfg,) = configs_from_argv([(TrainConfig, "train")], argv, __doc__, defaults=recorded)
    except ConfigError as e:
        if note:  # (a setting that run recorded, refused now: say where it came from)
            raise ConfigError(f"{e} ({note}: give that setting on the command line, or --recipe=)") from None
        raise
    check_recipe_taps(argv, cfg)
    code = 0
    try:
        out = run(cfg, switches, note)
        if int(os.environ.get("RANK", 0)) == 0:
            print(out)
    except Interrupted as e:  # one line, no traceback; 128 + the signal
        if int(os.environ.get("RANK", 0)) == 0:
            print(e.line, file=sys.stderr)
        code = e.code
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # everything is written and closed: end now, so that no destructor of a still-live distributed object
        # (the process group, kept by anything that outlived the run) can hang the exit at interpreter shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
