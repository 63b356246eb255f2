"""`make faults` kept from rotting: the harness on 2 kills (one per stage; seed 14 draws a kill -9 of extraction and a
SIGTERM of training mid-steps, and the training trial's completing run meets a second trainer) ends in its one-line
summary and its JSON, and its comparisons pass a clean copy, catch planted faults, and expect a SIGTERM stop's extra
checkpoint among the kept ones. The contract itself is checked by `make faults` (50 kills, minutes), not here: 2
random kills prove little either way."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bench import faults

REPO = Path(__file__).resolve().parents[1]
SUMMARY = (r"faults: 2 kills \(1 extract, 1 train; (\d) SIGKILL, (\d) SIGTERM\), (\d+) second trainers refused, "
           r"(\d+) shards \(byte-for-byte\) \+ (\d+) checkpoints \(tensor-for-tensor\) compared with a clean run, "
           r"(\d+) debris, (\d+) mismatches \(\d+ s\)")


@pytest.fixture(scope="module")
def harness(tmp_path_factory, qwen35_dir):
    out = tmp_path_factory.mktemp("faults")
    # the suite's tiny Qwen3.5 target is the harness's (same build parameters, so its sidecar matches and the harness
    # reuses it, as on a second `make faults`): no second build of the same bytes
    shutil.copytree(qwen35_dir, out / "target")
    res = subprocess.run([sys.executable, "-m", "bench.faults", "--kills=2", "--seed=14", f"--out={out}"], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    return out, res


def test_two_kills_one_per_stage_each_with_its_rerun_and_a_one_line_summary(harness):
    out, res = harness
    lines = res.stdout.strip().splitlines()
    m = re.fullmatch(SUMMARY, lines[-1])
    assert m, res.stdout[-3000:] + res.stderr[-3000:]
    n_kill, n_term, refused, shards, ckpts, debris, mismatches = map(int, m.groups())
    assert res.returncode == (1 if debris or mismatches else 0), res.stderr[-2000:]
    assert n_kill + n_term == 2 and refused >= 1, res.stdout[-3000:]  # the training trial's run met a second one
    kills = [x for x in lines if re.match(r"\[ ?\d/2\] (extract|train) \S+ (kill|SIGTERM) 1/1 at \d+\.\d\ds \(", x)]
    assert sorted(x.split()[2] for x in kills) == ["extract", "train"], res.stdout[-3000:]
    terms = [x for x in kills if " SIGTERM 1/1 " in x]
    assert len(terms) == n_term and all(re.search(r"\): exit (143|-15) in \d+\.\ds", x) for x in terms), terms
    tally = json.loads((out / "faults.json").read_text())
    assert (tally["kills_total"], tally["signals"], tally["refused"]) == (2, {"kill": n_kill, "term": n_term}, refused)
    assert tally["summary"] == lines[-1]
    assert all(" → rerun " in x for x in kills)  # each says what its rerun found
    assert shards + ckpts > 0 or mismatches  # a trial compared something or said why it could not
    assert re.match(r"clean extract: .*phases start-up .*, tokenize .*, load .*, shards .*, exit ", lines[0])
    kept = list((out / "trials").iterdir())
    assert bool(kept) == bool(mismatches or debris)  # passing trials are removed, failing ones kept


def test_the_comparisons_pass_a_clean_copy_and_catch_planted_faults(harness, tmp_path):
    out, _ = harness
    clean = out / "clean"
    root, run = tmp_path / "cache", tmp_path / "run"
    shutil.copytree(clean / "cache", root)
    shutil.copytree(clean / "run", run)
    v = faults.compare_extract(root, clean / "cache")
    n_shards = sum(len(faults.committed_files(c)) for c in faults.caches(root).values())
    assert (v.compared, v.debris, v.mismatches) == (n_shards, [], []) and n_shards > 2
    v = faults.compare_train(run, clean / "run")
    assert (v.compared, v.debris, v.mismatches) == (3, [], [])
    v = faults.compare_train(run, clean / "run", every=clean / "run-every")  # the every-step run agrees
    assert (v.compared, v.debris, v.mismatches) == (3, [], [])

    hidden = faults.caches(root)["hidden"]
    shard = hidden / "hidden-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 1  # same size, other bytes
    shard.write_bytes(bytes(raw))
    host = socket.gethostname()
    (hidden / f".hidden-00002.safetensors.tmp~{host}~1~abcd1234").write_bytes(b"x")
    (hidden / "claims" / "shard-00002.json").write_text("{}")
    (hidden / ".lock").write_text("x")
    v = faults.compare_extract(root, clean / "cache")
    assert v.mismatches == [f"{hidden.name}: shard 1 differs from the clean run's (manifest or bytes)"]
    assert len(v.debris) == 3 and v.compared == n_shards - 1

    metrics = run / "metrics.jsonl"
    records = metrics.read_text().splitlines()
    metrics.write_text("\n".join(records[:5] + records[4:]) + "\n")  # step 5 recorded twice (a resume that re-ran it)
    last = run / "checkpoints" / "step-00000012" / "model.safetensors"
    weights = load_file(str(last))
    w = weights["fc.weight"].view(-1)
    w[0] = torch.nextafter(w[0], torch.tensor(1.0))  # a last-bit difference in one weight
    with safe_open(str(last), "pt") as f:
        meta = f.metadata()
    save_file(weights, str(last), metadata=meta)  # the same size: complete, only a value differs
    (run / "checkpoints" / f".step-00000014.tmp~{host}~1~abcd1234").mkdir()
    (run / "checkpoints" / "step-00000002").mkdir()  # a step directory without meta.json
    shutil.copytree(run / "checkpoints" / "step-00000008", run / "checkpoints" / "step-00000004")
    (run / "checkpoints" / "step-00000004" / "data.json").unlink()  # half pruned: meta.json lists a missing file
    v = faults.compare_train(run, clean / "run")
    assert v.debris == ["checkpoints/.step-00000014.tmp~" + f"{host}~1~abcd1234", "checkpoints/step-00000002",
                        "checkpoints/step-00000004"]
    assert len(v.mismatches) == 2 and "steps recorded more than once [5]" in v.mismatches[0]
    assert v.mismatches[1] == "step-00000012: model.safetensors differ from the clean run's" and v.compared == 2
    assert json.loads(records[4])["step"] == 5


def test_a_sigterm_stop_checkpoint_is_expected_among_the_kept_ones(harness, tmp_path):
    """A run SIGTERM'd at step 11 keeps step-10, step-11, step-12 (keep_last 3), not the clean run's 8, 10, 12: the
    comparison expects exactly that set, compares step-11 with the every-step clean run, and refuses it otherwise;
    a held or leftover run lock is debris."""
    out, _ = harness
    clean = out / "clean"
    assert faults.kept_steps() == ["step-00000008", "step-00000010", "step-00000012"]
    assert faults.kept_steps([11]) == ["step-00000010", "step-00000011", "step-00000012"]
    assert faults.kept_steps([1, 5]) == faults.kept_steps()  # stops pruned away later: the clean set
    run = tmp_path / "run"
    shutil.copytree(clean / "run", run)
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    shutil.copytree(clean / "run-every" / "checkpoints" / "step-00000011", run / "checkpoints" / "step-00000011")
    v = faults.compare_train(run, clean / "run", [11], clean / "run-every")
    assert (v.compared, v.debris, v.mismatches) == (3, [], [])
    v = faults.compare_train(run, clean / "run", [], clean / "run-every")  # no stop: step-11 has no business here
    assert v.mismatches == ["checkpoints ['step-00000010', 'step-00000011', 'step-00000012'] ≠ ['step-00000008', "
                            "'step-00000010', 'step-00000012'] (clean ['step-00000008', 'step-00000010', "
                            "'step-00000012'])"]
    v = faults.compare_train(run, clean / "run", [11])  # nothing clean to compare step-11 with
    assert v.mismatches == ["step-00000011: no clean checkpoint to compare it with"] and v.compared == 2
    (run / ".run.lock").write_text("{}")
    assert faults.run_debris(run) == [".run.lock"]
