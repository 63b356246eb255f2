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

    for f in (Path(__file__).resolve().parents[1] / "bench" / "autotune").glob("*.json"):
        t = json.loads(f.read_text())
        assert {"triton", "fla", "gpu", "kernels"} <= set(t) and all(t["kernels"].values()), f
