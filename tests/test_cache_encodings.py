"""A new cache encoding is one registry entry: a test-only encoding (int8 codes + a float32 scale per token and
layer, tensors named `q` and `scale`), registered here and nowhere else, goes through extract → verify → train on the
tiny target. A consumer that kept a list of encodings or tensor names of its own (config, plan, writer, reader,
verify, the trainer's stream) fails here."""

import json
import struct

import pytest
import torch
from test_extract import encoded_extraction, shard_files
from test_train import cfg, losses

from dflash_offline import dataset as ds
from dflash_offline import storage
from dflash_offline.cache import encodings
from dflash_offline.cache.encodings import Encoding
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import hidden_shard_name, read_hidden
from dflash_offline.config import ExtractConfig, VerifyConfig
from stages import train, verify


def int8_encode(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """[..., H] → int8 codes [..., H] and a float32 scale [..., 1] per token: x ≈ q · scale, |q| ≤ 127."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return {"q": (x.float() / scale).round().clamp(-127, 127).to(torch.int8), "scale": scale}


def int8_decode(parts: dict[str, torch.Tensor], dtype) -> torch.Tensor:
    return (parts["q"].float() * parts["scale"].float()).to(dtype)


# a relative error per row of ≈ 0.5 % on the tiny target's states (a step of amax/127, rounded): held to 3 %
INT8 = Encoding("int8", "int8 values + a float32 scale per token and layer (a test's)",
                {"q": (torch.int8, lambda h: h), "scale": (torch.float32, lambda h: 1)},
                encode=int8_encode, decode=int8_decode, rel_tol=0.03)


@pytest.fixture
def int8(monkeypatch):
    monkeypatch.setitem(encodings.ENCODINGS, INT8.name, INT8)  # registered for this test only
    return INT8


def test_the_registry_sizes_and_refuses_by_its_entries(int8):
    assert ExtractConfig(target="t", quant="int8").resolve().quant == "int8"
    assert encodings.bytes_per_token("int8", 5, 5120) == 5 * (5120 + 4)
    p = storage.storage_plan(rows=4, seq_len=64, doc_tokens=200, k=3, hidden=64, quant="int8", need=0, shards="1/1",
                             free=1 << 40, fits=True, min_free_gb=0, allow_overfill=False, gpus=1, epochs=None,
                             rate={}, gpu=False)
    assert p["encodings"]["int8"]["bytes_per_token"] == 3 * (64 + 4) and "int8 k=32" in p["encodings"]
    with pytest.raises(ValueError, match="quantization 'int4' is not one of bf16, fp8, fp4, int8"):
        encodings.get("int4")
    with pytest.raises(ValueError, match="already registered"):
        encodings.register(INT8)


def test_a_registered_encoding_round_trips_through_extract_verify_and_train(tmp_path, qwen35_dir, chat_corpus, int8):
    bf16, cache, a, b, real = encoded_extraction(tmp_path, qwen35_dir, chat_corpus, "int8")
    m = read_manifest(cache)
    ids, H = m["config"]["layer_ids"], m["producer"]["target"]["hidden_size"]
    assert m["producer"]["quant"] == "int8"
    err = ((b[real] - a[real]).norm() / a[real].norm()).item()
    assert 0 < err < INT8.rel_tol and (b[~real] == 0).all()  # padding stays exactly 0

    # the shard holds the encoding's tensors, sized as the registry says
    path = shard_files(cache)[0]
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    rows = m["shards"][0]["rows"]
    assert {k for k in header if k != "__metadata__"} == {f"{t}.L{lid}" for t in ("q", "scale") for lid in ids}
    assert header[f"q.L{ids[0]}"]["dtype"] == "I8" and header[f"scale.L{ids[0]}"]["shape"] == [rows, 128, 1]
    assert path.stat().st_size == rows * 128 * encodings.bytes_per_token("int8", len(ids), H) + 8 + n

    # make verify holds it to its own tolerance, and catches a value change the checksums cannot see
    v = verify.verify(cache, VerifyConfig(cache=str(cache), rows=2, device="cpu").resolve())
    assert v["ok"] and 0 < v["max_rel_err"] < INT8.rel_tol, v

    # the trainer's stream hands out the decode of what the shards hold, and a run trains on it
    info = ds.open_hidden_cache(cache, ids, require_verified=True)
    with ds.HiddenStream(info, 2) as s:
        picks, batch = s.rows_of(0, 0), next(s)
    for slot, (shard, row) in enumerate(picks):
        want = read_hidden(cache / hidden_shard_name(shard), ids, rows=slice(row, row + 1))[0]
        assert torch.equal(batch["hidden"][slot], want) and batch["hidden"].dtype == torch.bfloat16
    train.run(cfg(cache, tmp_path / "run-int8", steps=2, ckpt_every=2))
    train.run(cfg(bf16, tmp_path / "run-bf16", steps=2, ckpt_every=2))
    got, ref = losses(tmp_path / "run-int8"), losses(tmp_path / "run-bf16")
    assert len(got) == 2 and got == pytest.approx(ref, rel=0.02) and got != ref
