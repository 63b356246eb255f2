"""GPU end-to-end check of the extraction stage (make test-gpu-extract): CUDA extraction equals the CPU path."""

import pytest
import torch

from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import hidden_shard_name, read_hidden
from dflash_offline.config import ExtractConfig, TokenizeConfig
from stages import extract

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_packed_extraction_equals_cpu_per_document(tmp_path, qwen35_dir, chat_corpus):
    caches = {}
    for device in ("cpu", "cuda"):
        tok = TokenizeConfig(corpus=[str(chat_corpus)], tokenizer=str(qwen35_dir), cache_root=str(tmp_path / "c"),
                             seq_len=256, rows_per_shard=4, workers=1, max_docs=60).resolve()
        ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(tmp_path / "c"), num_draft_layers=3,
                            device=device, batch_rows=2, cache=str(tmp_path / device)).resolve()
        caches[device] = extract.run(ext, tok)
    m = read_manifest(caches["cuda"])
    assert m["key"] == read_manifest(caches["cpu"])["key"]  # the device is not part of the identity
    ids = m["config"]["layer_ids"]
    for i in range(m["num_shards"]):
        a = read_hidden(caches["cpu"] / hidden_shard_name(i), ids, dtype=torch.float32)
        b = read_hidden(caches["cuda"] / hidden_shard_name(i), ids, dtype=torch.float32)
        assert ((a - b).norm() / a.norm()).item() < 3e-2, i
