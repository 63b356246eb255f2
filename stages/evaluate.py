"""Evaluate the exported drafter by real speculative decoding with its target (the final τ), plus a teacher-forced
estimate.

    python -m stages.evaluate --run=RUN [--export=DIR | --step=N] --prompts=FILE.jsonl [--num_prompts=16
                              --max_new_tokens=128] [--dtype=auto|float32|bfloat16] [--untrained=1] [--cache=HELD_OUT]

What is measured is the artifact users ship: the z-lab export directory, loaded as users load it
(`AutoModel.from_pretrained(DIR, trust_remote_code=True)`, i.e. its own dflash.py, weights checked against the
SHA-256 in its provenance), drafting with its `draft_block`. `--export=DIR` names it (make EXPORT=; a DIR
that does not exist yet receives a fresh export of the run); without it the run's checkpoint (`--step`, default the
latest) is exported into RUN/eval-export first. The JSON records the artifact (path, weights and modeling-file
SHA-256, run, step). `--untrained=1` measures a fresh drafter (the run's config and seed, the trainer's step 0) in
the same modeling code, the baseline a trained drafter must beat (a run on projected taps: that drafter folded with
its cache's projection, as export folds a trained one).

For each prompt (a chat record `{"messages": [...]}`, optionally with a `category`, cut after its first —
`--turn=last`: last — user turn and rendered with the target's chat template and `add_generation_prompt=True`) the
target generates greedily alone and with the drafter (`dflash_offline.speculate`: the target side — verification,
acceptance, cache rollback — is the engine's job and lives there). Reported: real τ (tokens per verify step), its
histogram and the share of verify steps accepting at least k drafts (k = 1..B-1), τ per prompt category, draft /
verify / rollback ms per step, tok/s of both decodes, and speed-ups (see `speedups`), target forward counts, and
the teacher-forced estimate (per-slot accuracy → simulated τ, and the per-block τ) of the same weights on a few
batches of a hidden cache — the run's own training cache unless `--cache=` names a held-out one.

`--replay=1` measures τ without the target verifying (`speculate.replay_generate`): the target's greedy output
(the target-alone decode, e.g. from `--baseline`) is fed through the target once per prompt, and the drafter drafts
step after step along it exactly as in a real decode, a step accepting the drafts that equal the output's next
tokens. Same steps, same emitted tokens, hence the same `tau_emitted` (the drafts a last step would accept past eos
or the budget are not checked, so `tau_mean` can only be lower), at one target forward per prompt instead of one or
two per step; the first `--check_prompts` prompts are also decoded for real — the lossless check and the speed
figures come from them (none without), and `replay_check` counts the prompts whose replay took the decode's steps.
`--baseline_only=1` writes the `--baseline` file and stops (no drafter, no report; without `--run`, `--target`,
`--prompts` and `--baseline=FILE` say what it decodes and where, `--template_kwargs` standing for the run's corpus
settings): an evaluation to come reuses it where its prompts come out the same tokens — the testbed makes it beside
its extraction.
`--replay_batch=N` drafts at up to N anchors in one batched forward of the shipped model instead of a call a step
(float32 and this version's modeling code only; `speculate.ExportedDrafter.draft_anchors`).

Lossless check, by `--dtype` (target and drafter compute dtype): in float32 (exact mode) every speculative output
must equal the target's greedy output, any difference fails (TF32 is switched off on CUDA); in bfloat16 a block
forward and token-by-token forwards round differently, so where outputs part one full forward of the target
measures its top-2 logit margin there, and a margin <= `--tie_tol` is a rounding tie (`exact` false, `lossless`
still true; margins of all differences in `tie_margin_hist`); any other difference fails. auto = float32 on a CPU or
when the target's fp32 weights take at most half the GPU's memory, else bfloat16. A failure still writes the JSON
(RUN/eval.json, RUN/eval-untrained.json, or `--out=`) and exits 1.
"""

from __future__ import annotations

import sys

from dflash_offline.config import config_from_argv
from dflash_offline.evalrun import EvalConfig, baseline_only, evaluate, write_report
from dflash_offline.evaluation import table


def main(argv: list[str]) -> int:
    from dflash_offline.cli import unbuffered

    unbuffered()
    cfg = config_from_argv(EvalConfig, "eval", argv, __doc__)
    if cfg.baseline_only:
        made = baseline_only(cfg)
        print(f"{made['file']}: the target-alone decodes of {made['prompts']} prompts "
              f"{'already there' if made['reused'] else 'written'} ({made['seconds']:.1f}s)")
        return 0
    report = evaluate(cfg)
    out = write_report(cfg, report)
    print(table(report))
    print(out)
    if not report["lossless"]:
        what = "differs from" if report["mode"] == "exact" else "differs beyond a rounding tie from"
        print(f"error: speculative output {what} the target's greedy output in prompts {report['mismatches']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
