"""The recipes against the drafters they reproduce. Each 27B/8B recipe's drafter, resolved as `make train` resolves
it (`trainsetup.drafter_config`) and written as `make export` writes its config.json (`export.zlab_config`), carries
the reference drafter's fields (layer types, window, RoPE, token ids, shapes) at the real target shapes — config
level, no weights — and fits a model built from the reference config tensor for tensor (on the meta device); the
recipe's [tokenize]/[train] tables carry the reference training settings.

The reference values are literals copied from sgl-project/SpecForge at commit
a6b6b0230009d15ec2a97a57384e6f53f0f96946 (2026-08-08); the targets' config.json fields are the published ones the
pipeline reads. There is no reference for Qwen3.5-27B (see manifests/qwen3.5-27b.toml): its recipe is checked
against the Qwen3.6-27B reference (same shapes) except the attention fields, which are those of SpecForge's
Qwen3.5 drafters (all layers full attention).
"""

import json
from pathlib import Path

import pytest
import torch

from dflash_offline.config import TokenizeConfig, TrainConfig, build_config, read_recipe
from dflash_offline.drafter import DFlashDrafter
from dflash_offline.export import mask_token_for, target_fields, zlab_config
from dflash_offline.trainsetup import drafter_config

REPO = Path(__file__).resolve().parents[1]

# SpecForge configs/qwen3.6-27b-dflash.json (a6b6b02; the file as of b9c2860c219ce1c83bf8c8ef843d98ac0189b6af),
# transformers_version 5.5.3
SPECFORGE_QWEN36_27B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}, "dtype": "bfloat16",
    "eos_token_id": 248044, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "full_attention"],
    "max_position_embeddings": 262144, "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64, "pad_token_id": 248044,
    "rms_norm_eps": 1e-06, "sliding_window": 2048, "tie_word_embeddings": False, "transformers_version": "5.5.3",
    "use_cache": True, "use_sliding_window": True, "vocab_size": 248320, "rope_theta": 10000000, "rope_scaling": None,
}
# SpecForge configs/qwen3-8b-dflash.json (a6b6b02; the file as of ffc4ab79a378a1f5005a89e8f6396f8404600ea5)
SPECFORGE_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "dtype": "bfloat16",
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# the attention fields of SpecForge's Qwen3.5 DFlash drafters (configs/qwen3.5-4b-dflash.json and
# configs/qwen3.5-35b-a3b-dflash.json at a6b6b02: every layer full attention), for the Qwen3.5-27B recipe
QWEN35_ATTENTION = {"layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False}

# reference fields the export does not reproduce, and why (every other field is compared)
NOT_COMPARED = {
    "transformers_version": "the installed transformers' version",
    "pad_token_id": "the export copies the target config's pad id; Qwen3.5/3.6-27B's config.json has none (the "
                    "reference's 248044 is the tokenizer's <|endoftext|>); engines do not read it from a drafter",
    "rope_scaling": "null there; the export states the same as rope_parameters {rope_type: default} (checked)",
}

# the targets' config.json: the published fields the pipeline reads (no weights)
QWEN36_27B_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320,
    "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "eos_token_id": 248044, "dtype": "bfloat16", "tie_word_embeddings": False,
}
QWEN36_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": QWEN36_27B_TEXT, "tie_word_embeddings": False,
              "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 5120}}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 36,
}

# recipe → (target config.json, reference, attention fields that replace the reference's, real tokenizer fixture)
RECIPES = {
    "qwen3.6-27b": (QWEN36_27B, SPECFORGE_QWEN36_27B, {}, "qwen3.6"),
    "qwen3.5-27b": (QWEN36_27B, SPECFORGE_QWEN36_27B, QWEN35_ATTENTION, "qwen3.5"),
    "qwen3-8b": (QWEN3_8B, SPECFORGE_QWEN3_8B, {}, "qwen3"),
}


def target_dir(root: Path, config: dict, tokenizer_json: Path | None = None) -> Path:
    """A target checkpoint directory holding only config.json (+ the tokenizer): the config level."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").touch()  # (`drafter_config` checks that weights are there; it reads none)
    if tokenizer_json is not None:
        (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return root


def resolved_drafter(recipe: str, target: Path):
    """The recipe's DrafterConfig as `make train` resolves it, with the cache's facts taken from the recipe."""
    tables = read_recipe(str(REPO / "manifests" / f"{recipe}.toml"))
    cfg = build_config(TrainConfig, "train", {**tables["train"], "cache": "unused"})
    text = json.loads((target / "config.json").read_text())
    text = text.get("text_config") or text
    facts = {"target": str(target), "layer_ids": tables["extract"]["layer_ids"], "mask_token_id": cfg.mask_token_id,
             "hidden_size": text["hidden_size"], "num_target_layers": text["num_hidden_layers"]}
    return drafter_config(cfg, facts)


def exported_config(recipe: str, target: Path) -> dict:
    """config.json of the recipe's drafter, as `export.export` writes it (same three calls)."""
    dc = resolved_drafter(recipe, target)
    tgt = target_fields(str(target))
    tgt["mask_token"] = mask_token_for(tgt["tokenizer"], dc.mask_token_id)
    return zlab_config(dc, tgt, "bfloat16")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_export_has_the_reference_drafters_fields(recipe, tmp_path):
    target_cfg, ref, attention, _ = RECIPES[recipe]
    out = exported_config(recipe, target_dir(tmp_path / "target", target_cfg))
    expected = {**ref, **attention}
    for key, want in expected.items():
        if key in NOT_COMPARED:
            continue
        if key == "dflash_config":  # the export adds block_size and the mask token's string
            assert {k: out[key][k] for k in want} == want, recipe
        else:
            assert out[key] == want, (recipe, key, out[key], want)
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": ref["rope_theta"]}
    assert out["dflash_config"]["block_size"] == ref["block_size"]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_drafter_fits_a_model_built_from_the_reference_config(recipe, tmp_path):
    """Tensor names and shapes of the recipe's drafter = those of z-lab's DFlashDraftModel (the modeling file the
    export ships) built from the reference config.json: the checkpoint loads where the reference's does."""
    from transformers import Qwen3Config

    from dflash_offline.zlab_dflash import DFlashDraftModel

    target_cfg, ref, attention, _ = RECIPES[recipe]
    dc = resolved_drafter(recipe, target_dir(tmp_path / "target", target_cfg))
    config = Qwen3Config(**{k: v for k, v in {**ref, **attention}.items() if k not in NOT_COMPARED})
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in DFlashDrafter(dc).state_dict().items()}
        theirs = {k: tuple(v.shape) for k, v in DFlashDraftModel(config).state_dict().items()}
    assert ours == theirs
    hidden, taps = ref["hidden_size"], len(ref["dflash_config"]["target_layer_ids"])
    assert ours["fc.weight"] == (hidden, taps * hidden) and len({k.split(".")[1] for k in ours if
                                                                  k.startswith("layers.")}) == 5


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_mask_token_string_is_the_target_tokenizers(recipe, tmp_path, real_fixtures):
    """With the real tokenizer beside the target: dflash_config.mask_token, which SGLang maps back to an id and
    checks, is the tokenizer's <|audio_start|> for 248070 and <|MASK|> (the row SGLang adds) for 151669."""
    fixtures = real_fixtures
    target_cfg, ref, _, tokenizer = RECIPES[recipe]
    out = exported_config(recipe, target_dir(tmp_path / "target", target_cfg, fixtures / tokenizer / "tokenizer.json"))
    assert out["dflash_config"]["mask_token_id"] == ref["dflash_config"]["mask_token_id"]
    assert out["dflash_config"]["mask_token"] == {248070: "<|audio_start|>", 151669: "<|MASK|>"}[
        ref["dflash_config"]["mask_token_id"]]


# SpecForge's training configs (a6b6b02): examples/configs/qwen3.6-27b-dflash-online.yaml (the file as of
# 7d1fbf08e601ccc03158e95e37d1ebc004cd58e3) and examples/configs/qwen3-8b-dflash-online.yaml; rows per optimizer
# step = batch_size per GPU × 8 GPUs (deployment.trainer.nproc_per_node)
SPECFORGE_TRAINING = {
    "qwen3.6-27b": dict(max_length=4096, num_epochs=6, learning_rate=6e-4, warmup_ratio=0.04, max_grad_norm=1.0,
                        num_anchors=512, loss_decay_gamma=7, batch_size=1, gpus=8),
    "qwen3-8b": dict(max_length=3072, num_epochs=6, learning_rate=6e-4, warmup_ratio=0.04, max_grad_norm=1.0,
                     num_anchors=512, loss_decay_gamma=7, batch_size=4, gpus=8),
}
SPECFORGE_TRAINING["qwen3.5-27b"] = SPECFORGE_TRAINING["qwen3.6-27b"]  # (no reference of its own)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_recipe_trains_as_the_reference_training_config(recipe):
    ref = SPECFORGE_TRAINING[recipe]
    tables = read_recipe(str(REPO / "manifests" / f"{recipe}.toml"))
    tok = build_config(TokenizeConfig, "tokenize", tables["tokenize"])
    train = build_config(TrainConfig, "train", {**tables["train"], "cache": "unused"})
    assert tok.seq_len == ref["max_length"] and tok.long_doc == "truncate"  # max_length truncates a sample
    assert (train.epochs, train.lr, train.warmup_ratio, train.warmup_steps, train.grad_clip) == (
        ref["num_epochs"], ref["learning_rate"], ref["warmup_ratio"], -1, ref["max_grad_norm"])
    assert (train.num_anchors, train.gamma, train.block_size) == (ref["num_anchors"], ref["loss_decay_gamma"], 16)
    # the reference's global batch in rows, on any number of processes
    assert train.global_batch_tokens == ref["batch_size"] * ref["gpus"] * tok.seq_len
