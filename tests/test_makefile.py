"""The Makefile is the user's interface: `ARGS=` reaches every stage a target runs, and `make setup` installs again
when the torch it is asked for changes (`TORCH_SPEC=`), not only when pyproject.toml does."""

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# targets whose commands run no stage or benchmark of their own settings (demo: ten stages with fixed settings)
NOT_STAGES = {"help", "setup", "fixtures", "test", "test-gpu", "test-gpu-extract", "test-gpu-train", "lint", "style",
              "clean", "demo"}


def make(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def stage_targets() -> list[str]:
    """Every documented target (`name: ... ## help`) except those that run no stage."""
    text = (REPO / "Makefile").read_text()
    return [t for t in re.findall(r"^([a-z][a-z0-9-]*):[^=\n]*##", text, flags=re.M) if t not in NOT_STAGES]


def test_every_target_that_runs_a_stage_passes_ARGS_through():
    targets = stage_targets()
    assert {"tokenize", "extract", "verify", "train", "regen", "export", "eval", "report", "status"} <= set(targets)
    dropped = {}
    for target in targets:
        cache = "TOKENS=c" if target == "tokenize" else "CACHE=c"  # (make tokenize refuses CACHE=: it names TOKENS=)
        res = make("-n", "-o", ".venv/.installed", target, "ARGS=--probe_arg=1", cache, "RUN=r")
        assert res.returncode == 0, (target, res.stderr)
        runs = [line for line in res.stdout.splitlines() if re.search(r"(-m |LAUNCH\)? ?)((stages|bench)\.|testbed )", line)]
        assert runs, f"make -n {target} runs no stage: {res.stdout}"
        if missing := [line for line in runs if "--probe_arg=1" not in line]:
            dropped[target] = missing
    assert not dropped, f"these targets drop ARGS=: {dropped}"


def test_a_resume_without_RECIPE_passes_no_recipe_where_the_run_recorded_its_settings(tmp_path):
    """`make train RUN= RESUME=1` with RECIPE= not given would resume a run under the default (demo) recipe's
    settings: where RUN/config.json exists it passes no recipe (the stage takes the run's); a RECIPE= given, a
    run not started yet, or no resume pass the recipe as always."""
    run = tmp_path / "r"
    run.mkdir()

    def recipe_flag(*args: str) -> str:
        res = make("-n", "-o", ".venv/.installed", "train", "CACHE=c", *args)
        assert res.returncode == 0, res.stderr
        return re.search(r"--recipe=(\S*)", res.stdout).group(1)

    assert recipe_flag(f"RUN={run}", "RESUME=1") == "manifests/demo.toml"  # (no config.json yet: a fresh start)
    (run / "config.json").write_text("{}")
    assert recipe_flag(f"RUN={run}", "RESUME=1") == "" and recipe_flag(f"RUN={run}", "RESUME=true") == ""
    assert recipe_flag(f"RUN={run}", "RESUME=1", "RECIPE=manifests/x.toml") == "manifests/x.toml"
    assert recipe_flag(f"RUN={run}") == "manifests/demo.toml"


def test_setup_installs_again_when_TORCH_SPEC_changes(tmp_path):
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # a stand-in that records what setup asks of it
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    python.chmod(0o755)

    def setup(spec: str) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        res = make("-s", "setup", f"VENV={venv}", f"PYTHON={python}", f"TORCH_SPEC={spec}")
        assert res.returncode == 0, res.stderr
        return log.read_text().splitlines()[len(before):] if log.exists() else []

    first = setup("torch==2.13.0")
    assert "-m pip install -q torch==2.13.0" in first and "-m pip install -q -e .[dev]" in first
    assert setup("torch==2.13.0") == []  # idempotent
    again = setup("torch==2.12.0")
    assert "-m pip install -q torch==2.12.0" in again and "-m pip install -q -e .[dev]" in again
    assert setup("torch==2.12.0") == []
    assert (venv / ".torch-spec").read_text().strip() == "torch==2.12.0"


def test_the_demo_reads_and_writes_only_under_DEMO_DIR():
    """`make demo DEMO_DIR=D` passes D's target, tokenizer, corpus, cache and run to every stage: the demo recipe's
    own paths (build/demo/...) are only its defaults, and a stage left on them reads another demo's files, or fails
    where none was built."""
    res = make("-n", "-o", ".venv/.installed", "demo", "DEMO_DIR=/elsewhere/d")
    assert res.returncode == 0, res.stderr
    runs = [line for line in res.stdout.splitlines() if "-m stages." in line]
    assert len(runs) >= 9 and not [line for line in runs if "build/demo" in line]
    extract = next(line for line in runs if "-m stages.extract" in line)
    for flag in ("--target=/elsewhere/d/target", "--tokenizer=/elsewhere/d/target", "--corpus=/elsewhere/d/regen.jsonl",
                 "--cache=/elsewhere/d/cache/hidden"):
        assert flag in extract, (flag, extract)
    recipe = (REPO / "manifests" / "demo.toml").read_text()
    assert "build/demo/target" in recipe  # (what the stage would read without those flags)


def test_clean_removes_the_demo_dir_given_and_never_a_cache_inside_it_or_the_repo(tmp_path):
    """`make clean` removes DEMO_DIR= (not a fixed build/demo), refuses when CACHE= or TOKENS= lies inside it (the
    help promised never to touch CACHE=), and never removes /, the home directory, the repository or a folder above
    it."""
    demo = tmp_path / "demo"
    (demo / "cache" / "hidden").mkdir(parents=True)
    for keep in (f"CACHE={demo / 'cache' / 'hidden'}", f"TOKENS={demo / 'cache'}"):
        res = make("-s", "clean", f"DEMO_DIR={demo}", keep)
        assert res.returncode == 2 and "lies inside DEMO_DIR" in res.stderr and demo.is_dir()
    home = tmp_path / "home"  # (a stand-in home: were the check wrong, only it would go)
    (home / "keep").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home)}
    for bad in ("/", str(REPO), str(REPO.parent), str(home), str(home.parent), "/etc", "~", ""):
        res = make("-s", "clean", f"DEMO_DIR={bad}", env=env)
        assert res.returncode in (0, 2) and (home / "keep").is_dir(), bad  # ("~" is a folder of that name here)
        assert bad == "~" or "is not a demo directory; nothing removed" in res.stderr, bad
    assert (REPO / "Makefile").is_file()
    assert make("-s", "clean", f"DEMO_DIR={demo}", f"CACHE={tmp_path / 'elsewhere'}").returncode == 0
    assert not demo.exists()
