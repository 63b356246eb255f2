"""One process for every evaluation of a testbed invocation (`python -m testbed.evalworker`, started by
`commands.EvalWorker`): `stages.evaluate` as a process of its own paid ≈ 20 s per drafter on the H200 host before its
first prompt (Python, torch, transformers, fla and CUDA start-up, the target loaded again); here they are paid once.

Protocol: one JSON object a line on stdin, `{"argv": [stages.evaluate's arguments], "log": PATH or null}`; the
evaluation's output (file descriptors 1 and 2: Python's, the libraries' and C's alike) goes into PATH (null: this
process's stderr), and the answer is one line `{"rc": N}` on the original stdout, N as `python -m stages.evaluate`
would exit (0, 1 = not lossless, 2 = a refused input). An unexpected error is written into the log as a traceback and
answered `{"rc": 1, "fatal": true}`; the process then exits (its CUDA state may be broken), and the caller starts a
new one for the next request. The target is loaded once per (checkpoint, device, dtype) and kept: evaluations only
read it (the drafter reads its embedding and lm_head; each decode has caches of its own; every testbed evaluation
runs in the same exact mode) — the CPU test compares an evaluation here with one in a process of its own."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from pathlib import Path


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


def run_one(main, argv: list[str], log: str | None, err_fd: int) -> tuple[int, bool]:
    """(exit status, fatal) of `main(argv)` with fds 1 and 2 in `log` (or `err_fd`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if log else os.dup(err_fd)
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    rc, fatal = 1, False
    try:
        rc = main(argv) or 0
    except SystemExit as e:  # (the config parser's exit on a bad flag)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except ValueError as e:  # as run_cli: a refused input, one line
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        rc, fatal = 1, True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return rc, fatal


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; fd 1 itself goes to the logs from now on
    err_fd = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # (a stray print between requests never reaches the answer channel)
    os.close(null)
    from dflash_offline.autotune import from_env

    from_env()
    from dflash_offline import evalrun
    from stages import evaluate

    evalrun.load_target = keep_loaded(evalrun.load_target)
    for line in sys.stdin:
        job = json.loads(line)
        rc, fatal = run_one(evaluate.main, job["argv"], job.get("log"), err_fd)
        free_memory()
        reply.write(json.dumps({"rc": rc, "fatal": fatal}) + "\n")
        if fatal:
            break


def free_memory() -> None:
    """The drafter of the evaluation just ended, given back (training processes share the GPU)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
