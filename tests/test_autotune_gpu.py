"""Autotuner choices recorded by one process and pinned in another (make test-gpu): the pinned process runs the
recorded config without timing the candidates, and computes the same numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPO = Path(__file__).resolve().parents[1]

KERNEL = '''
import json, sys, time
import torch, triton, triton.language as tl
from dflash_offline import autotune
autotune.from_env()
benched = []

@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128, 256) for w in (2, 4)],
                 key=["n"])
@triton.jit
def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

original = double._bench
double._bench = lambda *a, **k: benched.append(1) or original(*a, **k)
x = torch.randn(1 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
y = torch.empty_like(x)
double[lambda m: (triton.cdiv(x.numel(), m["BLOCK"]),)](x, y, x.numel())
torch.cuda.synchronize()
print(json.dumps({"benched": len(benched), "best": double.best_config.kwargs, "ok": bool(torch.equal(y, x * 2))}))
'''


def _run(script: Path, env: dict) -> dict:
    """The kernel in a process of its own with `env` — and none of the caller's DFLASH_AUTOTUNE_* (a suite that
    records or pins its own choices must not record this test's, nor pin them here). From a file: Triton reads a
    @jit function's source, so `python -c` fails ("@jit functions should be defined in a Python file")."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_AUTOTUNE_")}
    # (the script's folder is sys.path[0], not the repo's: the repo goes first on PYTHONPATH)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    if not script.exists():
        script.write_text(KERNEL)
    r = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**base, "PYTHONPATH": path, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_recorded_choice_is_pinned_in_a_later_process_without_autotuning(tmp_path):
    from dflash_offline.autotune import merge

    rec = _run(tmp_path / "kernel.py", {"DFLASH_AUTOTUNE_RECORD": str(tmp_path / "rec"), "TRITON_CACHE_DIR": str(tmp_path / "t1")})
    assert rec["benched"] > 0 and rec["ok"]
    table = merge(sorted((tmp_path / "rec").glob("*.json")))
    (tmp_path / "table.json").write_text(json.dumps(table))
    assert any(name.endswith(".double") for name in table["kernels"])
    pinned = _run(tmp_path / "kernel.py", {"DFLASH_AUTOTUNE_PIN": str(tmp_path / "table.json"), "TRITON_CACHE_DIR": str(tmp_path / "t2")})
    assert pinned == {"benched": 0, "best": rec["best"], "ok": True}
    other = {**table, "triton": "0.0"}  # recorded with another Triton: ignored, the kernel autotunes again
    (tmp_path / "other.json").write_text(json.dumps(other))
    again = _run(tmp_path / "kernel.py", {"DFLASH_AUTOTUNE_PIN": str(tmp_path / "other.json"), "TRITON_CACHE_DIR": str(tmp_path / "t3")})
    assert again["benched"] > 0
