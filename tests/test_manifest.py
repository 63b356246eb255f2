"""Manifest contract: atomic sorted JSON, key refusal, pure merge that raises, concurrent commits, claims."""

import json
import multiprocessing as mp
import time

import pytest

from dflash_offline import manifest as mf


def entry(i, sha="a" * 64):
    return {"index": i, "rows": 1, "files": {f"f{i}": {"bytes": 1, "sha256": sha}}}


def test_open_refuses_other_key_and_names_field(tmp_path):
    mf.open_cache(tmp_path, "tokens", "k1", {"seq_len": 64, "tokenizer": {"x": 1}}, {}, None)
    assert mf.open_cache(tmp_path, "tokens", "k1", {"seq_len": 64, "tokenizer": {"x": 1}}, {}, None)["key"] == "k1"
    with pytest.raises(mf.ManifestError, match="seq_len"):
        mf.open_cache(tmp_path, "tokens", "k2", {"seq_len": 128, "tokenizer": {"x": 1}}, {}, None)
    text = (tmp_path / "manifest.json").read_text()
    assert json.loads(text)["key"] == "k1"
    keys = list(json.loads(text))
    assert keys == sorted(keys)


def test_merge_is_pure_and_raises_on_conflict():
    m = {"num_shards": 3, "shards": []}
    m1 = mf.merge_shard(m, entry(1))
    assert m["shards"] == [] and [s["index"] for s in m1["shards"]] == [1]
    assert mf.merge_shard(m1, entry(1))["shards"] == m1["shards"]  # same bytes again: idempotent
    with pytest.raises(mf.ManifestError, match="already committed"):
        mf.merge_shard(m1, entry(1, sha="b" * 64))
    assert mf.merge_shard(m1, entry(1, sha="b" * 64), redo=True)["shards"][0]["files"]["f1"]["sha256"] == "b" * 64
    with pytest.raises(mf.ManifestError, match="outside"):
        mf.merge_shard(m1, entry(3))


def _committer(cache, indices):
    for i in indices:
        mf.commit_shard(cache, entry(i))


def test_concurrent_commits_lose_nothing(tmp_path):
    mf.open_cache(tmp_path, "tokens", "k", {}, {}, 40)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_committer, args=(tmp_path, range(r, 40, 4))) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert sorted(mf.committed(mf.read_manifest(tmp_path))) == list(range(40))


def test_claims_lease_and_takeover(tmp_path, monkeypatch):
    mf.open_cache(tmp_path, "hidden", "k", {}, {}, 2)
    assert mf.try_claim(tmp_path, 0, lease_s=60)
    monkeypatch.setattr(mf, "worker_id", lambda: "other:1")
    assert not mf.try_claim(tmp_path, 0, lease_s=60)  # live lease held by someone else
    assert mf.try_claim(tmp_path, 1, lease_s=0.01)
    monkeypatch.setattr(mf, "worker_id", lambda: "third:2")
    time.sleep(0.05)
    assert mf.try_claim(tmp_path, 1, lease_s=60)  # expired lease: a successor takes it over
    mf.commit_shard(tmp_path, entry(1))
    mf.release_claim(tmp_path, 1)
    monkeypatch.setattr(mf, "worker_id", lambda: "fourth:3")
    assert not mf.try_claim(tmp_path, 1, lease_s=60)  # committed shards are never claimed again
    assert mf.try_claim(tmp_path, 1, lease_s=60, redo=True)


def test_stale_lock_is_broken(tmp_path):
    mf.open_cache(tmp_path, "tokens", "k", {}, {}, None)
    (tmp_path / ".lock").write_text("dead")
    import os
    old = time.time() - 120
    os.utime(tmp_path / ".lock", (old, old))
    mf.commit_shard(tmp_path, entry(0))
    assert not (tmp_path / ".lock").exists()
