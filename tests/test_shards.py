"""The streaming safetensors writer: what it writes is a valid safetensors file (read back by safetensors itself),
its returned checksum is the file's, and identical inputs give identical bytes."""

import errno
import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from dflash_offline.cache.encodings import encode_layer
from dflash_offline.cache.fsio import sha256_file
from dflash_offline.cache.shards import write_hidden_shard, write_safetensors


def test_streamed_safetensors_round_trip_checksum_and_determinism(tmp_path, monkeypatch):
    import dflash_offline.cache.shards as shards

    monkeypatch.setattr(shards, "WRITE_CHUNK", 1000)  # many chunks per tensor: the hash must follow them in order
    g = torch.Generator().manual_seed(0)
    tensors = {
        "hidden.L3": torch.randn(2, 40, 24, generator=g).to(torch.bfloat16),
        "hidden.L1": torch.randn(2, 40, 24, generator=g).to(torch.float8_e4m3fn),
        "scale.L1": torch.rand(2, 40, 1, generator=g),
        "empty": torch.zeros(0, 3),
        "ids": torch.arange(7, dtype=torch.int32)[::2],  # non-contiguous input
    }
    meta = {"dflash": '{"a": 1}'}
    rec = write_safetensors(tmp_path / "a.safetensors", tensors, meta)
    raw = (tmp_path / "a.safetensors").read_bytes()
    head = raw[:8 + int.from_bytes(raw[:8], "little")]
    assert rec == {"bytes": len(raw), "sha256": sha256_file(tmp_path / "a.safetensors"),
                   "header_sha256": hashlib.sha256(head).hexdigest()}
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata() == meta
        assert sorted(f.keys()) == sorted(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape, k
            assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), k
    again = write_safetensors(tmp_path / "b.safetensors", dict(reversed(tensors.items())), meta)
    assert again["sha256"] == rec["sha256"]
    assert not list(tmp_path.glob(".*tmp*"))  # no temp file left behind


def test_streamed_safetensors_refuses_dtypes_it_cannot_store(tmp_path):
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)}, {})


def test_hidden_shards_list_a_digest_of_every_row_of_every_tensor(tmp_path):
    import xxhash

    g = torch.Generator().manual_seed(0)
    tensors = {**encode_layer(torch.randn(3, 8, 16, generator=g), 1, "fp8"),
               **encode_layer(torch.randn(3, 8, 16, generator=g), 5, "fp8")}
    write_hidden_shard(tmp_path / "h.safetensors", tensors, "fp8", [5, 1], {"shard": 0, "key": "k"})
    with safe_open(str(tmp_path / "h.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["dflash"])
        assert meta["row_hash"] == "xxh3_64" and sorted(meta["row_digests"]) == sorted(tensors)
        for name in tensors:
            rows = f.get_tensor(name)
            assert meta["row_digests"][name] == [
                xxhash.xxh3_64_hexdigest(rows[r].contiguous().view(torch.uint8).numpy()) for r in range(3)]


def test_a_failed_write_names_the_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import dflash_offline.cache.shards as shards

    def full_disk(head, names, tensors):
        yield head
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "_chunks", full_disk)
    with pytest.raises(OSError, match="No space left on device") as e:
        write_safetensors(tmp_path / "x.safetensors", {"a": torch.zeros(4)}, {})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []
