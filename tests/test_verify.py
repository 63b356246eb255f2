"""make verify on CPU: a value change the checksums cannot see (the manifest was updated too) is caught and named;
batched recompute finds exactly what row-by-row finds, with one forward per batch; device=cuda without CUDA is
refused before anything is read."""

import json
import re
import shutil

import pytest
import torch

from dflash_offline.config import VerifyConfig
from dflash_offline.manifest import read_manifest
from dflash_offline.shards import hidden_shard_name, read_hidden, write_hidden_shard
from stages import verify


def copy_cache(hidden_cache, tmp_path):
    """The shared cache's root (hidden + token caches, linked by a relative path) copied, so it can be tampered."""
    shutil.copytree(hidden_cache.parent, tmp_path / "root")
    return tmp_path / "root" / hidden_cache.name


def scale_row(cache, shard: int, row: int, layer_pos: int, factor: float) -> None:
    """Rewrite `shard` with one row of one layer scaled, and record the new file's checksum in the manifest."""
    m = read_manifest(cache)
    ids, path = m["config"]["layer_ids"], cache / hidden_shard_name(shard)
    x = read_hidden(path, ids).chunk(len(ids), dim=-1)
    tensors = {f"hidden.L{lid}": t.clone() for lid, t in zip(ids, x, strict=True)}
    tensors[f"hidden.L{ids[layer_pos]}"][row] *= factor
    rec = write_hidden_shard(path, tensors, "bf16", ids, {"shard": shard, "key": m["key"]})
    entry = next(s for s in m["shards"] if s["index"] == shard)
    assert entry["files"][path.name]["sha256"] != rec["sha256"]
    entry["files"][path.name] = rec
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))


def test_changed_values_with_a_matching_checksum_name_the_shard_and_row(hidden_cache, tmp_path, capsys):
    cache = copy_cache(hidden_cache, tmp_path)
    m = read_manifest(cache)
    assert m["num_shards"] >= 3
    shard, row = next((i, r) for i, r in verify.sample_rows(m, 2, set()) if i == 1)  # a row the sample checks
    lid = m["config"]["layer_ids"][1]
    scale_row(cache, shard, row, 1, 1.1)
    cfg = VerifyConfig(cache=str(cache), rows=2, device="cpu").resolve()
    assert verify.check_files(cache, read_manifest(cache), (cache / m["config"]["tokens_dir"]).resolve()) == []
    with pytest.raises(SystemExit) as exit_:
        verify.main([f"--cache={cache}", "--rows=2", "--device=cpu"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    err = re.search(rf"BAD shard {shard}: row {row} layer {lid}: rel err (\S+) > 0.02\n", out)
    assert err and float(err[1]) == pytest.approx(0.1, abs=2e-3), out
    assert out.count("BAD shard") == 1
    assert f"SHARD={shard}\n" in out and "hash " in out and "load " in out and "recompute " in out
    v = read_manifest(cache)["verified"]
    assert v["ok"] is False and [b["shard"] for b in v["bad"]] == [shard]
    assert v["max_rel_err"] == pytest.approx(0.1, abs=2e-3) and v["rows_per_shard"] == cfg.rows
    assert set(v["phase_seconds"]) == {"hash", "load", "recompute"}


def test_batched_recompute_equals_row_by_row_with_one_forward_per_batch(hidden_cache, tmp_path):
    from dflash_offline.target import load_target

    cache = copy_cache(hidden_cache, tmp_path)
    m = read_manifest(cache)
    scale_row(cache, 0, 3, 0, 1.01)  # within tol: errors to compare, none below the bf16 noise floor
    scale_row(cache, 2, 5, 2, 1.05)  # over tol
    m = read_manifest(cache)
    picked = verify.sample_rows(m, 8, set())  # every row of every shard
    assert len(picked) % 3 and len({i for i, _ in picked}) >= 3  # batches straddle shards, the last one padded
    model = load_target(m["config"]["extract"]["target"], m["config"]["layer_ids"], device="cpu",
                        dtype=torch.bfloat16)
    forward, calls = model.tapped_layers, []
    model.tapped_layers = lambda *rows: calls.append(rows[0].shape[0]) or forward(*rows)
    tokens_dir = (cache / m["config"]["tokens_dir"]).resolve()
    by_row = verify.recompute(cache, m, tokens_dir, model, picked, 0.02, batch_rows=1)
    assert calls == [1] * len(picked)
    calls.clear()
    batched = verify.recompute(cache, m, tokens_dir, model, picked, 0.02, batch_rows=3)
    assert calls == [3] * -(-len(picked) // 3)  # fixed shape, the last batch padded
    assert batched == by_row
    bad, worst = batched
    assert [(b["shard"], b["reason"].split(":")[0]) for b in bad] == [(2, f"row 5 layer {m['config']['layer_ids'][2]}")]
    assert worst == pytest.approx(0.05, abs=2e-3)


def test_device_cuda_without_cuda_is_refused_before_reading_anything(hidden_cache, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    cache = copy_cache(hidden_cache, tmp_path)
    monkeypatch.setattr(verify, "read_manifest", lambda *a: pytest.fail("read the manifest"))
    with pytest.raises(ValueError, match="verify.device=cuda but CUDA is not available"):
        verify.verify(cache, VerifyConfig(cache=str(cache), device="cuda").resolve())
    assert "verified" not in json.loads((cache / "manifest.json").read_text())
