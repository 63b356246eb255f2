"""One process for every evaluation of a testbed invocation (`python -m testbed.evalworker`, started by
`commands.EVAL_WORKER`, a `worker.Worker`: the protocol is `testbed/worker.py`'s): `stages.evaluate` as a process of
its own paid ≈ 20 s per drafter on the H200 host before its first prompt (Python, torch, transformers, fla and CUDA
start-up, the target loaded again); here they are paid once. Exit statuses as `python -m stages.evaluate`'s: 0, 1 =
not lossless, 2 = a refused input. The target is loaded once per (checkpoint, device, dtype) and kept: evaluations
only read it (the drafter reads its embedding and lm_head; each decode has caches of its own; every testbed
evaluation runs in the same exact mode) — the CPU test compares an evaluation here with one in a process of its
own. After each evaluation its drafter's memory is given back (`worker.free_memory`: trainings share the GPU)."""

from __future__ import annotations

import functools
from pathlib import Path

from .worker import import_ahead, serve


def keep_loaded(load):
    """`evalrun.load_target`, each (checkpoint, device, dtype) loaded once."""

    @functools.wraps(load)
    def cached(target_dir, device, dtype):
        key = (str(Path(target_dir).resolve()), str(device), str(dtype))
        if key not in cached.loaded:
            cached.loaded.clear()  # one target at a time in memory
            cached.loaded[key] = load(target_dir, device, dtype)
        return cached.loaded[key]

    cached.loaded = {}
    return cached


def load():
    """stages.evaluate's main, its target loads kept; what its first evaluation would import — torch, transformers,
    the evaluation's code, the testbed target's modeling code (fla's kernels with it, where installed) — imported now
    and CUDA started (`worker.import_ahead`: the testbed starts this worker ahead, beside the extraction). Importing
    Triton compiles nothing: exact mode's `TRITON_F32_DEFAULT` (`evaluation.exact_float32`) is read when a kernel
    compiles."""
    from dflash_offline import evalrun
    from stages import evaluate

    import_ahead("torch", "transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.auto.modeling_auto",
                 "transformers.models.auto.tokenization_auto", "dflash_offline.evaluation", "dflash_offline.speculate",
                 "dflash_offline.target")
    evalrun.load_target = keep_loaded(evalrun.load_target)
    return evaluate.main


if __name__ == "__main__":
    serve(load)
