"""The streaming safetensors writer: what it writes is a valid safetensors file (read back by safetensors itself),
its returned checksum is the file's, and identical inputs give identical bytes."""

import pytest
import torch
from safetensors import safe_open

from dflash_offline.manifest import sha256_file
from dflash_offline.shards import write_safetensors


def test_streamed_safetensors_round_trip_checksum_and_determinism(tmp_path, monkeypatch):
    import dflash_offline.shards as shards

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
    assert rec == {"bytes": (tmp_path / "a.safetensors").stat().st_size, "sha256": sha256_file(tmp_path / "a.safetensors")}
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
