"""One process for the drafters' trainings of a testbed invocation (`python -m testbed.trainworker`, started by
`commands.TRAIN_WORKERS`, `worker.Workers`: the protocol is `testbed/worker.py`'s), `stages.train.main` for one
request after another: a process per drafter pays Python's, torch's, transformers' and CUDA's start each time; here
once. Each training still loads the target's embedding and lm_head itself. Exit statuses as `python -m stages.train`'s
(2 = a refused input, 128 + the signal when a signal stopped the run).

Between two trainings the process is put back as a fresh one would be for the next (`fresh_process`; dynamo's state
before the next, where its graphs differ: `keep_graphs`). What
`trainrun.run` leaves behind, found by training one drafter after another in one process:
- torch.compile's in-memory state: `torch._dynamo.reset()` before a training whose graphs may differ from the last
  one's. Left, each drafter of other shapes or settings would add graphs to the same functions until dynamo's
  `recompile_limit` (8 a function) turned the rest eager or into an error under `fullgraph`; reset, such a run
  compiles its own graphs (or loads them from Inductor's caches: 15–22 s a drafter on the H200), so its warm-up count
  and `recompiles` (differences of one process-wide counter, `metrics.compiled_graphs`) are its own. A request that
  differs from the last one only in `SAME_GRAPHS` (an arm's further seed, the null arm after the first arm, the
  known-bad arm's fewer steps, a resume) runs the last one's compiled graphs instead (`keep_graphs`; its log says so,
  and its warm-up step compiles none). Dynamo's guards still decide: where they reject the kept graphs, that run
  compiles its own beside them and the next one resets, so a function never holds more than twice one run's graphs.
  Inductor's and Triton's on-disk caches and the kernels already imported stay: a fresh process would load the same.
- accelerate's singletons (`AcceleratorState`, `PartialState`, `GradientState`): reset. A second `Accelerator` with
  the same settings works on the kept ones, but they keep the first run's settings: an `Accelerator` with others
  is refused ("already initialized").
- the CUDA allocator: its cache emptied (other processes share the GPU) and its peak statistics reset: a run's
  `peak_gb` and final "peak … GB allocated" are torch's peak since the last reset, which would otherwise be the
  largest of every earlier run.
Kept on purpose: a resident cache's rows (`--bench_resident=1`, the testbed's `--resident=1`) stay on the device for
the next resident training on the same cache, which reads none (`dataset.keep_resident_rows`: the same batches; ≈ 3 s
a drafter for the testbed's ≈ 8 GB on an H100), and are given back before a training on another `--cache=` or a
streamed one starts (they stay held while the drafter is evaluated, in another process, and after the worker's last
training until it ends: ≈ 8 GB of an 80 GB GPU in the testbed).
Put back by the run itself (`trainsetup.kept_process_state`, `runguard.StopSignals`): the recompile guard, TF32,
the GC's freeze and callbacks, the SIGTERM/SIGINT handlers. Not reset, and need not be: the random generators
(every run seeds Python's, numpy's and torch's, CPU and CUDA, before its first draw: accelerate's `set_seed`), the
environment (the run sets only the compile cache directories, with setdefault: the same each time); a run leaves no
thread of its own (tqdm's monitor and Inductor's compile threads stay, for the next run) and no open file. What still
differs from a process of its own: a warning Python shows once per process appears in the first training's log only,
and off CUDA the "peak RSS" of a run's last line is the worker's. The CPU tests compare drafters trained here, the second
of a worker (after one with other settings: the same graphs compiled) and a third that differs from it only in its
seed and steps (no graph compiled), with their twins trained by `python -m stages.train`: equal weights."""

from __future__ import annotations

from .worker import free_memory, import_ahead, serve

RESIDENT = "--bench_resident=1"  # a request's argument (first-class in no stage): BenchSwitches(resident=True)
SAME_GRAPHS = ("--run", "--seed", "--steps", "--resume")  # settings a training's compiled graphs do not depend on
# the last request's `graph_identity` (None: reset before the next), its graphs; its --cache= when resident ("rows")
_last = {"graphs": None, "count": 0, "rows": None}


def load():
    """stages.train's main, with the bench switch `RESIDENT` taken out of a request's arguments; a resident cache's
    rows stay on the device for the next resident training on that cache (`dataset.keep_resident_rows`), given back
    before a training that streams. What its first training would import — torch, accelerate, transformers' auto
    classes, dynamo, Inductor, flex attention, the drafter's code — imported now and CUDA started
    (`worker.import_ahead`: the testbed starts this worker ahead, beside the extraction)."""
    from dflash_offline.cli import private_compile_caches
    from dflash_offline.dataset import keep_resident_rows, release_kept_rows
    from dflash_offline.trainsetup import BenchSwitches
    from stages import train

    private_compile_caches()  # (as stages.train's main does, before Inductor's import sets its default directory)
    import_ahead("torch", "accelerate", "transformers.models.auto.modeling_auto", "torch._dynamo",
                 "torch._inductor.compile_fx", "torch.nn.attention.flex_attention", "dflash_offline.drafter",
                 "dflash_offline.trainer", "dflash_offline.loss")
    keep_resident_rows()

    def main(argv: list[str]) -> int:
        from dflash_offline.metrics import compiled_graphs
        from dflash_offline.progress import log

        cache = next((a for a in argv if a.startswith("--cache=")), None) if RESIDENT in argv else None
        if cache is None or cache != _last.get("rows"):  # a streamed training, or another cache's: given back first
            release_kept_rows()
        _last["rows"] = cache
        kept = keep_graphs(graph_identity(argv))
        if kept:
            log(f"[worker] the last training's {kept} compiled graphs kept (its settings but seed, run, steps or "
                f"resume): dynamo's guards decide whether they run; the warm-up step compiles what they reject")
        rc, before = 1, compiled_graphs()
        try:
            rc = train.main([a for a in argv if a != RESIDENT], BenchSwitches(resident=RESIDENT in argv))
            return rc
        finally:
            graphs = compiled_graphs() - before
            # refused, stopped or failed; or the kept graphs rejected (graphs compiled beside them): the next resets
            _last.update(graphs=None if rc or (kept and graphs) else _last["graphs"],
                         count=kept if kept and not graphs else graphs)

    return main


def graph_identity(argv: list[str]) -> tuple[str, ...]:
    """A request's arguments but those its compiled graphs do not depend on (`SAME_GRAPHS`)."""
    return tuple(a for a in argv if a.split("=", 1)[0] not in SAME_GRAPHS)


def keep_graphs(identity: tuple[str, ...]) -> int:
    """Before a training: keep dynamo's compiled graphs where the last training had the same `identity` (and ended
    with status 0, its graphs accepted: else `main` forgot it), else reset them. The graphs kept (0: reset)."""
    import torch

    kept = _last["count"] if identity == _last["graphs"] else 0  # (none compiled: nothing to keep)
    if not kept:
        torch._dynamo.reset()
    _last["graphs"] = identity
    return kept


def fresh_process() -> None:
    """What a training leaves in the process, reset (see the module doc)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    free_memory()
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    serve(load, fresh_process)
