"""dflash_offline.autotune on the CPU: merging recorded tables (the recording and pinning themselves need Triton and a
GPU: tests/test_autotune_gpu.py)."""

import json

import pytest

from dflash_offline.autotune import merge


def test_tables_of_one_machine_merge_and_other_versions_are_refused(tmp_path):
    head = {"triton": "3.6.0", "fla": "0.6.0", "gpu": "NVIDIA H200"}
    cfg = {"kwargs": {"BT": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
    a = {**head, "kernels": {"fla.k": [[[64, "torch.bfloat16"], cfg]]}}
    b = {**head, "kernels": {"fla.k": [[[64, "torch.bfloat16"], cfg], [[128, "torch.float32"], cfg]],
                             "fla.j": [[[1], cfg]]}}
    for name, t in (("a", a), ("b", b), ("c", {**a, "gpu": "NVIDIA H100"})):
        (tmp_path / f"{name}.json").write_text(json.dumps(t))
    m = merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert {k: m[k] for k in head} == head and len(m["kernels"]["fla.k"]) == 2 and len(m["kernels"]["fla.j"]) == 1
    with pytest.raises(ValueError, match="H100"):
        merge([tmp_path / "a.json", tmp_path / "c.json"])


def test_unsettled_choices_keep_the_first_record_and_a_directory_pins_the_matching_table(tmp_path, monkeypatch):
    from dflash_offline import autotune

    head = {"triton": "3.6.0", "fla": "0.6.0", "gpu": "NVIDIA H200"}
    cfg = {"kwargs": {"BT": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
    (tmp_path / "a.json").write_text(json.dumps({**head, "kernels": {"fla.k": [[[64], cfg]]}}))
    (tmp_path / "b.json").write_text(json.dumps({**head, "kernels": {"fla.k": [[[64], {**cfg, "num_warps": 8}]]}}))
    with pytest.raises(ValueError, match="not settled"):
        merge([tmp_path / "a.json", tmp_path / "b.json"])
    m = merge([tmp_path / "b.json", tmp_path / "a.json"], first_wins=True)
    assert m["kernels"]["fla.k"] == [[[64], {**cfg, "num_warps": 8}]] and m["unsettled"] == [["fla.k", [64]]]
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "h100.json").write_text(json.dumps({**m, "gpu": "NVIDIA H100"}))
    (tables / "h200.json").write_text(json.dumps(m))
    monkeypatch.setattr(autotune, "versions", lambda: dict(head))
    assert autotune.table_for(str(tables))[0] == tables / "h200.json"
    monkeypatch.setattr(autotune, "versions", lambda: {**head, "fla": "0.7.0"})
    assert autotune.table_for(str(tables)) == (None, {})


def test_the_shipped_tables_load_and_name_their_versions():
    from pathlib import Path

    tables = sorted((Path(__file__).resolve().parents[1] / "bench" / "autotune").glob("*.json"))
    assert tables  # (bench/device_call.sh pins from there)
    for f in tables:
        t = json.loads(f.read_text())
        assert {"triton", "fla", "gpu", "kernels"} <= set(t) and all(t["kernels"].values()), f
        model = next(w for w in t["gpu"].split() if w[:1].isalpha() and w[1:2].isdigit())  # (H200, H100, A100…)
        assert f.name == f"{model.lower()}-triton{t['triton']}-fla{t['fla']}.json", f
        assert all(len({json.dumps(k) for k, _ in rows}) == len(rows) for rows in t["kernels"].values()), f


def test_a_merged_table_merges_again_keeping_its_unsettled_keys_and_the_cli_takes_key_value_flags(tmp_path):
    import subprocess
    import sys

    head = {"triton": "3.6.0", "fla": "0.6.0", "gpu": "NVIDIA H200"}
    cfg = {"kwargs": {}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
    (tmp_path / "1.json").write_text(json.dumps({**head, "kernels": {"fla.k": [[[64], cfg]]}}))
    (tmp_path / "2.json").write_text(json.dumps({**head, "kernels": {"fla.k": [[[64], {**cfg, "num_warps": 8}]]}}))
    (tmp_path / "3.json").write_text(json.dumps({**head, "kernels": {"fla.j": [[[1], cfg]]}}))
    cli = [sys.executable, "-m", "dflash_offline.autotune", "merge"]
    r = subprocess.run(cli + [f"--out={tmp_path / 't.json'}", str(tmp_path / "1.json"), str(tmp_path / "2.json")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error:") and "not settled" in r.stderr  # (no traceback)
    r = subprocess.run(cli + [f"--out={tmp_path / 't.json'}", "--first_wins=1", str(tmp_path / "1.json"),
                              str(tmp_path / "2.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    again = merge([tmp_path / "t.json", tmp_path / "3.json"], first_wins=True)
    assert again["unsettled"] == [["fla.k", [64]]] and set(again["kernels"]) == {"fla.k", "fla.j"}
    assert again["kernels"]["fla.k"] == [[[64], cfg]]
    r = subprocess.run(cli + [f"--out={tmp_path / 'u.json'}", "--first_wins", "--bogus=1", str(tmp_path / "1.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--bogus" in r.stderr


def test_the_pinned_table_of_a_directory_is_the_matching_file_and_junk_there_is_passed_over(tmp_path, monkeypatch,
                                                                                            capsys):
    from dflash_offline import autotune
    from dflash_offline.cache.fsio import sha256_file

    head = {"triton": "3.6.0", "fla": "0.6.0", "gpu": "NVIDIA H200"}
    (tmp_path / "a-list.json").write_text("[1, 2]")
    (tmp_path / "b-cut.json").write_text('{"triton": "3.6')
    (tmp_path / "c-h200.json").write_text(json.dumps({**head, "kernels": {}}))
    monkeypatch.setattr(autotune, "versions", lambda: dict(head))
    monkeypatch.setenv("DFLASH_AUTOTUNE_PIN", str(tmp_path))
    assert autotune.pinned_table() == sha256_file(tmp_path / "c-h200.json")
    monkeypatch.setattr(autotune, "versions", lambda: {**head, "gpu": "NVIDIA B200"})
    assert autotune.pinned_table() is None
    assert autotune.table_for(str(tmp_path)) == (None, {})
    err = capsys.readouterr().err
    assert "a-list.json: unreadable" in err and "b-cut.json: unreadable" in err and "c-h200.json" in err
    assert autotune.table_for(str(tmp_path / "missing.json"), warn=False) == (None, {})


def test_a_pin_asked_for_where_triton_is_absent_pins_nothing_and_raises_nothing(tmp_path, monkeypatch):
    """`DFLASH_AUTOTUNE_PIN` set on a machine without Triton (a CPU venv: the test session's conftest and every stage
    call `from_env`): nothing is pinned, nothing is imported that is not there."""
    from dflash_offline import autotune

    monkeypatch.setattr(autotune, "versions", lambda: {"triton": None, "fla": None, "gpu": "cpu"})
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # (import triton → ImportError, as without it)
    monkeypatch.setenv("DFLASH_AUTOTUNE_PIN", str(tmp_path))
    assert autotune.pin(str(tmp_path)) == 0
    autotune.from_env()
