"""Benchmarks (GPU): python -m bench.extract, python -m bench.train; --tiny runs a CPU smoke version."""

import os
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The commit measured: `DFLASH_COMMIT` where set (a tree copied to a GPU machine has no .git), else git's HEAD."""
    if given := os.environ.get("DFLASH_COMMIT"):
        return given
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None
