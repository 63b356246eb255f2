"""A real OpenAI-compatible server for the tests: `transformers serve` (transformers' own, the `transformers[serving]`
extra) on a free loopback port, float32 on the CPU — what `make regen ENGINE=` talks to in CI."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable() -> str | None:
    """The Python that runs `transformers serve` (`TRANSFORMERS_CLI`): this one, when transformers' CLI and its
    serving extra import here."""
    import importlib.util

    from transformers.utils.import_utils import is_serve_available

    cli = importlib.util.find_spec("transformers.cli.transformers") is not None
    return sys.executable if cli and is_serve_available() else None


# the `transformers` command, in a Python that imported dflash_offline first: a Qwen3.5's Gated DeltaNet then runs
# transformers' torch functions on the CPU also where fla imports (Triton installed, no GPU), as in every stage
# (target.route_gated_deltanet_by_device); the server is transformers' own all the same
TRANSFORMERS_CLI = ("import sys, dflash_offline; from transformers.cli.transformers import main; "
                    "sys.argv[0] = 'transformers'; sys.exit(main())")


def serve(model: Path | str, port: int, log: Path, env: dict) -> subprocess.Popen:
    """`transformers serve model` on 127.0.0.1:port; returns once /health answers (at most 120 s), else fails the test
    with the end of the server's log."""
    exe = executable()
    assert exe, "transformers[serving] is not installed: make setup (pip install -e '.[dev]')"
    with open(log, "w") as f:
        proc = subprocess.Popen([exe, "-c", TRANSFORMERS_CLI, "serve", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"transformers serve did not come up (exit {proc.poll()}): {log.read_text()[-2000:]}")
        time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
