"""Progress reporting: the status snapshot other programs read, written off the thread that feeds the device (a
file write there can stall for most of a second while shards or checkpoints flush) and without fsync, while the
manifest stays durable."""

import json
import os
import time

from dflash_offline import progress
from dflash_offline.cache.manifest import commit_shard, open_cache, read_manifest
from dflash_offline.progress import Progress


def test_a_slow_disk_never_blocks_update_and_the_final_status_is_complete(tmp_path, monkeypatch):
    writes = []
    real = progress.write_json_atomic

    def slow(path, obj, durable=True):
        time.sleep(0.3)  # a write waiting behind a flush
        writes.append(obj["done"])
        real(path, obj, durable)

    monkeypatch.setattr(progress, "write_json_atomic", slow)
    status = tmp_path / "status.json"
    p = Progress("train", 20, "step", status, every_s=0.0, disable=True)
    t0 = time.perf_counter()
    for i in range(20):
        p.update(1, tokens=10, last=i)
    assert time.perf_counter() - t0 < 0.29  # 20 updates, none waited for a 0.3 s write
    snap = p.close("done")
    final = json.loads(status.read_text())
    assert final == json.loads(json.dumps(snap)) and final["done"] == 20 and final["state"] == "done"
    assert final["tokens"] == 200 and final["last"] == 19
    assert 2 <= len(writes) < 20 and writes[-1] == 20  # coalesced while one is in flight; the final one last


def test_status_is_never_fsynced_but_manifest_commits_are(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    status = tmp_path / "status.json"
    p = Progress("extract", 10, "row", status, every_s=0.0, disable=True)
    for _ in range(10):
        p.update(1, tokens=100)
        time.sleep(0.01)
    p.close("done")
    assert json.loads(status.read_text())["done"] == 10  # counted although the bar is disabled
    assert synced == []
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # no temp files left behind
    cache = tmp_path / "cache"
    cache.mkdir()
    open_cache(cache, "hidden", "k" * 64, {"p": 1}, {}, num_shards=1)
    before = len(synced)
    commit_shard(cache, {"index": 0, "rows": 1, "tokens": 1, "files": {}})
    assert len(synced) > before and read_manifest(cache)["shards"][0]["index"] == 0  # durable: fsynced
