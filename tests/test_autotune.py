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
