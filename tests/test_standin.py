"""The stand-in checkpoints (tests/standin.py) are what a user's Qwen3.6-27B / Qwen3-8B look like to the pipeline:
the real tokenizer, vocabulary, layer pattern and file layout (sharded safetensors + index, the VL wrapper), found by
hub id in an offline HF cache; scaled down in width and depth only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import standin  # noqa: E402

PROBE = """
import json, sys, torch
from dflash_offline.targetid import resolve_checkpoint
from dflash_offline.target import default_layer_ids, load_target, read_target_info
from transformers import AutoTokenizer
for target in sys.argv[1:]:
    path = resolve_checkpoint(target, need=("config", "weights", "tokenizer"))
    info = read_target_info(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    layers = default_layer_ids(info.num_layers, 2)
    t = load_target(path, layers, "cpu", torch.float32, mode="per_doc")
    print(json.dumps({"path": str(path), "layers": info.num_layers, "hidden": info.hidden_size,
                      "vocab": info.vocab_size, "arch": info.arch, "types": list(info.layer_types), "prompt": len(ids),
                      "taps": layers}))
"""


@pytest.fixture(scope="module")
def q36(tmp_path_factory, real_fixtures):
    root = tmp_path_factory.mktemp("standin")
    out = standin.build(root / "q36", "qwen3.6")
    return out, standin.hub_snapshot(out, root / "hub", "Qwen/Qwen3.6-27B"), root / "hub"


def _probe(targets: list[str], hub: Path) -> list[dict]:
    """What the pipeline reads of each target (a directory or a hub id), in one process."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", PROBE, *targets], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.strip().splitlines()[-len(targets):]]


def test_the_qwen36_stand_in_has_the_real_layout_and_resolves_by_hub_id_offline(q36):
    out, snap, hub = q36
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and not cfg["tie_word_embeddings"]
    text = cfg["text_config"]
    assert text["vocab_size"] == 248320 and text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] * 1 + [
        "linear_attention"] * 3 + ["full_attention"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded, as released
    assert any(k.startswith("model.language_model.layers.") for k in index["weight_map"])
    assert any(k.startswith("model.visual.") for k in index["weight_map"])  # the tower the pipeline must not load
    by_dir, by_id = _probe([str(out), "Qwen/Qwen3.6-27B"], hub)
    assert by_id["path"] == str(snap) and {k: v for k, v in by_id.items() if k != "path"} == {
        k: v for k, v in by_dir.items() if k != "path"}
    assert by_dir["vocab"] == 248320 and by_dir["layers"] == 8 and by_dir["hidden"] == 64
    assert by_dir["types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and by_dir["prompt"] > 3
    assert json.loads((out / "dflash_standin.json").read_text())["released"]["num_hidden_layers"] == 64


def test_the_qwen3_stand_in_is_a_dense_text_model_with_the_released_vocabulary(tmp_path, real_fixtures):
    out = standin.build(tmp_path / "q3", "qwen3", depth=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 151936
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    with pytest.raises(ValueError, match="every 4 layers"):
        standin.build(tmp_path / "bad", "qwen3.5", depth=6)
