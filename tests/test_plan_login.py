"""The storage plan from a login node, and the tokenizer that follows the target.

`make extract DRY_RUN=1 RECIPE=manifests/qwen3.6-27b.toml TARGET=<dir>` on a directory that holds the Qwen3.6-27B
config.json and its real tokenizer, and no weights, prints the whole plan (sizes per encoding, free space, read
bandwidth, H200 rates, regen and verify rows, GPU-hours) in under a minute on a 2-core machine and writes nothing; so
does the hub id `Qwen/Qwen3.6-27B` found in a local HF cache laid out as the hub client lays it out, offline. The
tokenizer of stage 1a: `--tokenizer=` when given, else the target's own when it holds one, else the recipe's.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_recipes import QWEN36_27B

from dflash_offline.config import ExtractConfig, TokenizeConfig, configs_from_argv
from dflash_offline.targetid import TargetError, resolve_checkpoint
from fixtures import democorpus
from stages import extract

REPO = Path(__file__).resolve().parents[1]
RECIPE = "manifests/qwen3.6-27b.toml"
HUB_ID = "Qwen/Qwen3.6-27B"
REV = "5f1c0a3e9b7d2c4f6a8e0b1d3c5e7f9a2b4d6c8e"  # a commit id, as the hub client names snapshots
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def config_only_target(root: Path, tokenizer: Path | None) -> Path:
    """A Qwen3.6-27B checkpoint directory as a login node may hold it: config.json (+ the tokenizer), no weights."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(QWEN36_27B, indent=2))
    for name in TOKENIZER_FILES if tokenizer else ():
        (root / name).write_bytes((tokenizer / name).read_bytes())
    return root


def hub_cache(hub: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """`files` as the hub client caches a download of `repo_id`: blobs named by their hash, the snapshot's files
    linking to them, refs/main naming the snapshot's revision. Returns the snapshot directory."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    for d in (repo / "blobs", snapshot, repo / "refs"):
        d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(REV)
    return snapshot


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time: a write anywhere changes it."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def login(tmp_path_factory, real_fixtures):
    """(root, target directory, 350-conversation corpus, HF hub cache holding the same target as Qwen/Qwen3.6-27B)."""
    root = tmp_path_factory.mktemp("login")
    target = config_only_target(root / "ckpt" / "Qwen3.6-27B", real_fixtures / "qwen3.6")
    corpus = democorpus.write_jsonl(root / "data" / "regen" / "pilot.jsonl", 350, seed=3)
    hub = root / "hf" / "hub"
    hub_cache(hub, HUB_ID, {p.name: p.read_bytes() for p in sorted(target.iterdir())})
    return root, target, corpus, hub


def make_dry_run(root: Path, corpus: Path, hub: Path, target: str) -> tuple[subprocess.CompletedProcess, float]:
    """The documented command, offline, on a machine without a GPU; (result, wall seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(root / "hf"),
           "CUDA_VISIBLE_DEVICES": ""}
    # (-o: the stage, not the install, is under test: make test set the venv up first)
    cmd = ["make", "-s", "-o", ".venv/.installed", "extract", "DRY_RUN=1", f"RECIPE={RECIPE}", f"TARGET={target}",
           f"CORPUS={corpus}", f"ARGS=--cache_root={root / 'cache'}", f"PYTHON={sys.executable}", "VENV=.venv"]
    t0 = time.perf_counter()
    # its own process group: a time-out ends the stage's processes too, not make alone (a hung stage was left behind)
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return res, time.perf_counter() - t0


def check_plan(out: str) -> None:
    """The plan of the 27B recipe with H200 figures (device=auto on a machine without a GPU)."""
    assert "no GPU here: kernels and timing not checked" in out, out
    assert "dry run without weights" in out
    assert "storage plan: " in out and " × 4,096 = " in out and "5 taps × hidden 5,120" in out
    assert "  bf16                  51,200" in out and "  fp4 (chosen)          14,420" in out  # (the recipe: fp4)
    assert re.search(r"fp4 \(chosen\).*  parity\n", out) and re.search(r"  fp4 k=1280 .*  not judged\n", out), out
    assert "training reads at 8 GPUs" in out
    assert "free where the cache goes" in out and "→ fits, keeping min_free_gb=2" in out
    assert "rate: extract 12,045 row tok/s per H200 (measured at Qwen3.5-27B shapes" in out
    # (the recipe trains DFlash2 in fp8 with fp8 logits and D-PACE: bf16 DFlash's 18,681 × their speed-up × D-PACE's
    # cost, plus DFlash2's added time — as measured in that training — not sped up by float8)
    assert "rate: train 18,041 context tok/s per H200 (estimate: 9,633 measured" in out
    assert ("×0.777 for variant=dflash2 against DFlash's bf16 step: its added time as measured at the Qwen3.5/3.6-27B "
            "recipes' drafter") in out
    assert "×1.36 for precision=fp8 loss_logits=fp8" in out and "DFlash2's added time" in out
    assert "regen: " in out and "answer tokens in this corpus" in out and "--plan_regen_tok_s=R" in out
    assert "verify: re-hashes " in out and "GPU-h at the extraction rate, on one GPU" in out
    assert "GPU-hours: extract " in out and ", verify " in out and "train 6 epochs" in out
    last = out.strip().splitlines()[-1]
    assert "dry run ok" in last and last.endswith("kernels not checked here; no weights loaded, nothing written")


def test_a_27b_plan_from_config_and_tokenizer_alone_in_under_a_minute_writing_nothing(login):
    root, target, corpus, hub = login
    before = tree(root)
    res, seconds = make_dry_run(root, corpus, hub, str(target))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert f"tokenizer: {target} (the target's own)" in out  # the recipe names Qwen/Qwen3.6-27B, not cached here
    check_plan(out)
    assert tree(root) == before and not (root / "cache").exists()  # nothing written, not even the token cache
    print(f"make extract DRY_RUN=1 (Qwen3.6-27B config + tokenizer, 350 conversations): {seconds:.1f} s")
    assert seconds < 60, f"the dry run took {seconds:.0f} s"


def test_a_hub_id_resolves_offline_from_the_local_hf_cache(login):
    root, _, corpus, hub = login
    before = tree(root)
    res, _ = make_dry_run(root, corpus, hub, HUB_ID)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert f"tokenizer: {HUB_ID} (the target's own)" in out
    assert f"target {hub / 'models--Qwen--Qwen3.6-27B' / 'snapshots' / REV} taps [1, 16, 31, 46, 61]" in out
    check_plan(out)
    assert tree(root) == before


def test_a_hub_id_missing_from_the_cache_is_one_line_naming_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TargetError) as e:
        resolve_checkpoint(HUB_ID, need=("tokenizer",), field="tokenize.tokenizer")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"tokenize.tokenizer '{HUB_ID}': no such directory, and not in the "
                                              f"local HF cache {tmp_path / 'hub'} (")
    assert "HF_HUB_CACHE or HF_HOME" in msg and f"huggingface-cli download {HUB_ID}" in msg
    snapshot = hub_cache(tmp_path / "hub", HUB_ID, {"config.json": b"{}", "tokenizer.json": b"{}"})
    assert resolve_checkpoint(HUB_ID, need=("config", "tokenizer")) == snapshot
    with pytest.raises(TargetError, match=r"has no \*\.safetensors weights"):  # a real run needs the weights
        resolve_checkpoint(HUB_ID, field="extract.target")


# --- which tokenizer: --tokenizer > the target's own > the recipe's ------------------------------------------------


def stage_configs(argv: list[str]) -> tuple[str, str]:
    """(tokenizer, why) as `make extract` resolves them from this command line."""
    why: dict = {}
    _, tok = configs_from_argv([(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")], argv, "",
                               defaults=extract.tokenizer_default(argv, why))
    return tok.tokenizer, why.get("tokenizer", "named by --tokenizer")


@pytest.fixture
def dirs(tmp_path):
    """A target with its tokenizer, one without (config + weights), a tokenizer alone."""
    out = {}
    for name, files in (("with_tok", ("config.json", *TOKENIZER_FILES)), ("bare", ("config.json", "model.safetensors")),
                        ("tok", TOKENIZER_FILES)):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
        out[name] = str(tmp_path / name)
    return out


def test_the_tokenizer_follows_the_target_unless_named(dirs, tmp_path):
    base = [f"--recipe={REPO / RECIPE}", "--corpus=data/regen/pilot.jsonl"]  # the recipe names Qwen/Qwen3.6-27B twice
    assert stage_configs(base + [f"--target={dirs['with_tok']}"]) == (dirs["with_tok"], "the target's own")
    assert stage_configs(base + [f"--target={dirs['with_tok']}", f"--tokenizer={dirs['tok']}"]) == \
        (dirs["tok"], "named by --tokenizer")
    tok, why = stage_configs(base + [f"--target={dirs['bare']}"])
    assert (tok, why) == (HUB_ID, "the recipe's [tokenize] tokenizer: the target holds no tokenizer files")
    # no TARGET=: the recipe's target goes with the recipe's tokenizer
    assert stage_configs(base + ["--target="]) == (HUB_ID, "the recipe's [tokenize] tokenizer")
    # a recipe that names no tokenizer: the target's, whichever it is
    bare_recipe = tmp_path / "r.toml"
    bare_recipe.write_text(f'[extract]\ntarget = "{dirs["bare"]}"\n')
    assert stage_configs([f"--recipe={bare_recipe}", "--corpus=x.jsonl"]) == (dirs["bare"], "the target's")
