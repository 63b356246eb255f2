"""Progress reporting: the status snapshot other programs read, written without stalling the thread that feeds the
device (no fsync, which can wait behind gigabytes of shard or checkpoint writes), while the manifest stays durable."""

import json
import os

from dflash_offline.manifest import commit_shard, open_cache, read_manifest
from dflash_offline.progress import Progress


def test_status_snapshots_are_complete_and_never_fsynced_but_manifest_commits_are(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    status = tmp_path / "status.json"
    p = Progress("extract", 10, "row", status, every_s=0.0, disable=True)
    for i in range(10):
        p.update(1, tokens=100, last_shard=i)
        snap = json.loads(status.read_text())  # always a whole JSON document (atomic rename)
        assert snap["done"] == i + 1 and snap["tokens"] == 100 * (i + 1) and snap["last_shard"] == i
    assert json.loads(status.read_text())["state"] == "running"
    assert p.close("done")["state"] == "done" and json.loads(status.read_text())["state"] == "done"
    assert synced == []
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # no temp files left behind
    cache = tmp_path / "cache"
    cache.mkdir()
    open_cache(cache, "hidden", "k" * 64, {"p": 1}, {}, num_shards=1)
    before = len(synced)
    commit_shard(cache, {"index": 0, "rows": 1, "tokens": 1, "files": {}})
    assert len(synced) > before and read_manifest(cache)["shards"][0]["index"] == 0  # durable: fsynced
