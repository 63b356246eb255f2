"""The recipes against the drafters they reproduce. Each 27B/8B recipe's drafter, resolved as `make train` resolves
it (`trainsetup.drafter_config`) and written as `make export` writes its config.json (`export.zlab_config`), carries
the reference drafter's fields (layer types, window, RoPE, token ids, shapes) at the real target shapes — config
level, no weights — and fits a model built from the reference config tensor for tensor (on the meta device); the
recipe's [tokenize]/[train] tables carry the reference training settings.

The reference values are literals copied from sgl-project/SpecForge at commit
a6b6b0230009d15ec2a97a57384e6f53f0f96946 (2026-08-08); the targets' config.json fields are the published ones the
pipeline reads. There is no reference for Qwen3.5-27B (see manifests/qwen3.5-27b.toml): its recipe is checked
against the Qwen3.6-27B reference (same shapes) except the attention fields, which are those of SpecForge's
Qwen3.5 drafters (all layers full attention). The Qwen3.5/3.6-27B recipes train that shape as DFlash2 (z-lab's
class and conv/selector fields added, `references`); with `--variant=dflash` their export is SpecForge's drafter.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_offline.config import TokenizeConfig, build_config, read_recipe
from dflash_offline.drafter import DFlashDrafter
from dflash_offline.export import mask_token_for, target_fields, zlab_config
from dflash_offline.trainsetup import TrainConfig, drafter_config

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

# Qwen3.8-27B: the Qwen3.6-27B architecture and config keys (issue #37); only the chat template differs
QWEN38_27B = QWEN36_27B
# z-lab's published DFlash2 drafter for it (z-lab/Qwen3.8-27B-DFlash2, model card; restated in issue #37 — the
# checkpoint itself is not readable here), in the field layout of z-lab/dflash tests/fixtures/dflash2-config.json
# (commit 0a7587c04af47b56024ef80f44c0926e795a540b: the four DFlash2 settings flat in dflash_config beside
# block_size, mask_token_id and target_layer_ids; every layer sliding_attention). vocab_size, num_target_layers and
# rope theta are the target's (a drafter uses its target's embedding, layers and RoPE).
ZLAB_QWEN38_27B_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
    "dflash_config": {"block_size": 8, "mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61],
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    "hidden_size": 5120, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "use_sliding_window": True,
    "max_window_layers": 5, "vocab_size": 248320, "num_target_layers": 64, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "rope_theta": 10000000,
    "is_causal": False,  # every slot sees the whole block (docs/serving.md: the published config and its readers)
}
# z-lab's DFlash2 config fields not restated for the 27B drafter, or that the export leaves out, and why
NOT_PUBLISHED = {
    "intermediate_size": "not restated; ours is the target's 17408 (SpecForge's Qwen3.6-27B drafter's)",
    "final_logit_softcapping/output_multiplier": "the fixture's target has them; a Qwen target has neither (identity)",
    "rms_norm_eps": "the target's (1e-6) here; the fixture's other target has 1e-5",
    "auto_map": "the fixture has none (z-lab's package registers the class); the export names the shipped dflash.py",
}

# recipe → (target config.json, reference, attention fields that replace the reference's, real tokenizer fixture)
RECIPES = {
    "qwen3.6-27b": (QWEN36_27B, SPECFORGE_QWEN36_27B, {}, "qwen3.6"),
    "qwen3.5-27b": (QWEN36_27B, SPECFORGE_QWEN36_27B, QWEN35_ATTENTION, "qwen3.5"),
    "qwen3-8b": (QWEN3_8B, SPECFORGE_QWEN3_8B, {}, "qwen3"),
    "qwen3.8-27b-dflash2": (QWEN38_27B, ZLAB_QWEN38_27B_DFLASH2, {}, "qwen3.8"),
}


# z-lab's DFlash2 conv and selector settings (the published Qwen3.8-27B drafter's), which the Qwen3.5/3.6-27B recipes
# train DFlash2 with on SpecForge's DFlash shape
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def references(recipe: str, target: Path) -> list[tuple[dict, dict]]:
    """(train overrides, reference drafter config) pairs a recipe is checked against: its reference; for a recipe
    that trains DFlash2 on a DFlash reference's shape, that shape as DFlash2 (z-lab's DFlash2 class, the four DFlash2
    fields in dflash_config) and, with `--variant=dflash`, the DFlash reference itself, field for field."""
    _, ref, attention, _ = RECIPES[recipe]
    ref = {**ref, **attention}
    if resolved_drafter(recipe, target).variant == "dflash" or ref["architectures"] != ["DFlashDraftModel"]:
        return [({}, ref)]
    as_dflash2 = {**ref, "architectures": ["DFlash2DraftModel"], "auto_map": {"AutoModel": "dflash.DFlash2DraftModel"},
                  "dflash_config": {**ref["dflash_config"], "block_size": ref["block_size"], **DFLASH2_FIELDS}}
    return [({}, as_dflash2), ({"variant": "dflash"}, ref)]


def target_dir(root: Path, config: dict, tokenizer_json: Path | None = None) -> Path:
    """A target checkpoint directory holding only config.json (+ the tokenizer): the config level."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").touch()  # (`drafter_config` checks that weights are there; it reads none)
    if tokenizer_json is not None:
        (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return root


def resolved_drafter(recipe: str, target: Path, **overrides):
    """The recipe's DrafterConfig as `make train` resolves it (`overrides`: as ARGS="--key=value" would), with the
    cache's facts taken from the recipe."""
    tables = read_recipe(str(REPO / "manifests" / f"{recipe}.toml"))
    cfg = build_config(TrainConfig, "train", {**tables["train"], "cache": "unused", **overrides})
    text = json.loads((target / "config.json").read_text())
    text = text.get("text_config") or text
    facts = {"target": str(target), "layer_ids": tables["extract"]["layer_ids"], "mask_token_id": cfg.drafter.mask_token_id,
             "hidden_size": text["hidden_size"], "num_target_layers": text["num_hidden_layers"]}
    return drafter_config(cfg, facts)


def exported_config(recipe: str, target: Path, **overrides) -> dict:
    """config.json of the recipe's drafter, as `export.export` writes it (same three calls)."""
    dc = resolved_drafter(recipe, target, **overrides)
    tgt = target_fields(str(target))
    tgt["mask_token"] = mask_token_for(tgt["tokenizer"], dc.mask_token_id)
    return zlab_config(dc, tgt, "bfloat16")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_export_has_the_reference_drafters_fields(recipe, tmp_path):
    target = target_dir(tmp_path / "target", RECIPES[recipe][0])
    for overrides, ref in references(recipe, target):
        out = exported_config(recipe, target, **overrides)
        for key, want in ref.items():
            if key in NOT_COMPARED:
                continue
            if key == "dflash_config":  # the export adds block_size and the mask token's string
                assert {k: out[key][k] for k in want} == want, recipe
            else:
                assert out[key] == want, (recipe, overrides, key, out[key], want)
        assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": ref["rope_theta"]}
        assert out["dflash_config"]["block_size"] == out["block_size"] == ref.get("block_size",
                                                                               ref["dflash_config"].get("block_size"))
        if ref["architectures"] == ["DFlash2DraftModel"]:  # every field z-lab's dflash_config holds, and no other
            assert {k: v for k, v in out["dflash_config"].items() if k != "mask_token"} == ref["dflash_config"]
            assert out["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
        else:
            assert not set(DFLASH2_FIELDS) & set(out["dflash_config"]), (recipe, overrides)
        # bidirectional blocks are declared (is_causal false) exactly where the reference declares them: not for DFlash
        assert out.get("is_causal") is ref.get("is_causal"), recipe


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_drafter_fits_a_model_built_from_the_reference_config(recipe, tmp_path):
    """Tensor names and shapes of the recipe's drafter = those of z-lab's DFlashDraftModel (the modeling file the
    export ships; DFlash2DraftModel for a DFlash2 reference) built from the reference config.json: the checkpoint
    loads where the reference's does."""
    from transformers import Qwen3Config

    from dflash_offline import zlab_dflash

    target = target_dir(tmp_path / "target", RECIPES[recipe][0])
    for overrides, ref in references(recipe, target):
        dc = resolved_drafter(recipe, target, **overrides)
        fields = {k: v for k, v in ref.items() if k not in NOT_COMPARED}
        config = Qwen3Config(**{"intermediate_size": dc.intermediate_size, **fields})  # (a DFlash2 ref has no width)
        with torch.device("meta"):
            ours = {k: tuple(v.shape) for k, v in DFlashDrafter(dc).state_dict().items()}
            theirs = {k: tuple(v.shape) for k, v in
                      getattr(zlab_dflash, ref["architectures"][0])(config).state_dict().items()}
        assert ours == theirs, (recipe, overrides)
        hidden, taps = ref["hidden_size"], len(ref["dflash_config"]["target_layer_ids"])
        assert ours["fc.weight"] == (hidden, taps * hidden) and len({k.split(".")[1] for k in ours if
                                                                      k.startswith("layers.")}) == 5
        assert any("candidate_selector" in k for k in ours) == (ref["architectures"] == ["DFlash2DraftModel"])


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
# DFlash2 (no official training): NeMo AutoModel's practice as restated in issue #37 (gamma 4 for block 8, 64 anchors,
# lr 6e-4); the rest is the qwen3.6-27b recipe's schedule, ours
SPECFORGE_TRAINING["qwen3.8-27b-dflash2"] = {**SPECFORGE_TRAINING["qwen3.6-27b"], "num_anchors": 64,
                                             "loss_decay_gamma": 4, "block_size": 8}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_recipe_trains_as_the_reference_training_config(recipe):
    ref = SPECFORGE_TRAINING[recipe]
    tables = read_recipe(str(REPO / "manifests" / f"{recipe}.toml"))
    tok = build_config(TokenizeConfig, "tokenize", tables["tokenize"])
    train = build_config(TrainConfig, "train", {**tables["train"], "cache": "unused"})
    assert tok.seq_len == ref["max_length"] and tok.long_doc == "truncate"  # max_length truncates a sample
    assert (train.schedule.epochs, train.optim.lr, train.optim.warmup_ratio, train.optim.warmup_steps, train.optim.grad_clip) == (
        ref["num_epochs"], ref["learning_rate"], ref["warmup_ratio"], -1, ref["max_grad_norm"])
    assert (train.loss.num_anchors, train.loss.gamma, train.drafter.block_size) == (ref["num_anchors"], ref["loss_decay_gamma"],
                                                                  ref.get("block_size", 16))
    # the reference's global batch in rows, on any number of processes
    assert train.schedule.global_batch_tokens == ref["batch_size"] * ref["gpus"] * tok.seq_len


def test_the_qwen38_recipe_tokenizes_with_its_template_settings_and_has_a_storage_plan(tmp_path, real_fixtures,
                                                                                      capsys):
    """Qwen3.8-27B: the recipe's template_kwargs are settings Qwen3.8's template reads (the real template fixture
    renders the reasoning_effort instruction with them) and are part of the tokenize config; the recipe trains DFlash2
    with the published conv/selector settings; the storage plan prints its bytes per token (5 taps x 5120)."""
    from dflash_offline import storage
    from dflash_offline.cache import encodings
    from dflash_offline.chat import parse_settings

    tables = read_recipe(str(REPO / "manifests" / "qwen3.8-27b-dflash2.toml"))
    tok = build_config(TokenizeConfig, "tokenize", tables["tokenize"])
    settings = parse_settings(tok.template_kwargs)
    assert settings == {"reasoning_effort": "xhigh"} and tok.thinking == "keep" and tok.turns == "each"
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(real_fixtures / "qwen3.8"))
    text = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, **settings)
    assert "Reasoning effort is set to xhigh" in text
    train = storage.recipe_train(str(REPO / "manifests" / "qwen3.8-27b-dflash2.toml"))
    assert (train.drafter.variant, train.drafter.conv_kernel_size, train.drafter.conv_group_size,
            train.drafter.selector_rank, train.drafter.selector_top_k, train.drafter.full_attention_layers,
            train.drafter.block_attention) == ("dflash2", 2, 16, 256, 16, 0, "bidirectional")
    layer_ids = tables["extract"]["layer_ids"]
    assert encodings.bytes_per_token("bf16", len(layer_ids), 5120) == 51_200
    assert encodings.bytes_per_token("fp8", len(layer_ids), 5120) == 25_620
    drafter = storage.drafter_shape(train, 5120, 17408, 248320, layer_ids)
    rate = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=drafter, seq_len=4096)
    rows = 1000
    quant = tables["extract"]["quant"]  # the recipe's (fp4: at parity on the testbed)
    p = storage.storage_plan(rows=rows, seq_len=4096, doc_tokens=rows * 4000, k=5, hidden=5120, quant=quant,
                             need=rows * 4096 * 14_420, shards="63/63", free=10**15, fits=True, min_free_gb=2.0,
                             allow_overfill=False, gpus=8, epochs=storage.plan_epochs(train, rows, 4096, 8),
                             rate=rate, gpu=True, answer_tokens=0, verify_rows=2 * 63)
    assert p["encodings"]["bf16"]["bytes_per_token"] == 51_200 and p["encodings"]["fp8"]["bytes_per_token"] == 25_620
    text = "\n".join(storage.render(p, Path("/data/cache/hidden")))
    print(text)
    assert "51,200" in text and "6 epochs" in text and re.search(r"\n  fp4 \(chosen\) +14,420 .*  parity\n", text)
