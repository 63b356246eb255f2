"""Tiny Qwen targets: real from_pretrained loading, checkpoint layout, chat template, determinism, the stage."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForConditionalGeneration

from fixtures import tiny
from stages import build_tiny

DOCS = 300  # small corpus: fast tokenizer training, still ~2000 ids


def _build(path, arch, **kw):
    return tiny.build_target(path, arch, seed=0, corpus_docs=DOCS, log=lambda s: None, **kw)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {arch: _build(tmp_path_factory.mktemp(arch), arch) for arch in tiny.ARCHS}


def _hashes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _keys(d):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.parametrize("arch,n_layers", [("qwen3_5", 8), ("qwen3", 6)])
def test_load_and_forward(targets, arch, n_layers):
    tok = AutoTokenizer.from_pretrained(targets[arch])
    model = AutoModelForCausalLM.from_pretrained(targets[arch])
    assert model.config.num_hidden_layers == n_layers and model.dtype == torch.bfloat16
    vocab = model.get_input_embeddings().num_embeddings
    assert vocab % 64 == 0 and len(tok) <= vocab == model.lm_head.out_features
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2? 東京 🐱"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    T = ids.shape[1]
    assert out.logits.shape == (1, T, vocab)
    assert len(out.hidden_states) == n_layers + 1
    assert all(h.shape == (1, T, 64) for h in out.hidden_states)
    assert torch.isfinite(out.logits).all()


def test_qwen3_5_checkpoint_layout(targets):
    d = targets["qwen3_5"]
    keys = _keys(d)
    assert set(keys.values()) == {"BF16"}
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in keys if k != "lm_head.weight"} == {
        "model.language_model", "model.visual"}
    assert "lm_head.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    cfg = json.loads((d / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert text["rope_parameters"]["rope_theta"] == 1e7 and text["partial_rotary_factor"] == 0.25
    assert not cfg["tie_word_embeddings"] and not text["tie_word_embeddings"]
    lm = "model.language_model.layers"
    assert f"{lm}.0.linear_attn.in_proj_qkv.weight" in keys and f"{lm}.3.self_attn.q_proj.weight" in keys
    assert f"{lm}.3.linear_attn.in_proj_qkv.weight" not in keys
    model = Qwen3_5ForConditionalGeneration.from_pretrained(d)
    q_proj = model.model.language_model.layers[3].self_attn.q_proj
    assert q_proj.out_features == 2 * 4 * 16  # query + output gate
    assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), output_hidden_states=True)
    assert len(out.hidden_states) == 9


def test_qwen3_layout(targets):
    keys = _keys(targets["qwen3"])
    cfg = json.loads((targets["qwen3"] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 6
    assert cfg["rope_parameters"]["rope_theta"] == 1e6 and not cfg["tie_word_embeddings"]
    assert "lm_head.weight" in keys and "model.layers.5.self_attn.q_norm.weight" in keys
    assert all(k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for k in keys)


def test_build_is_byte_identical(targets, tmp_path):
    again = _build(tmp_path / "again", "qwen3_5")
    first, second = _hashes(targets["qwen3_5"]), _hashes(again)
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "config.json", "generation_config.json", tiny.SIDECAR} <= set(first)
    assert first == second
    other = tiny.build_target(tmp_path / "seed1", "qwen3_5", seed=1, corpus_docs=DOCS, log=lambda s: None)
    assert _hashes(other)["model.safetensors"] != first["model.safetensors"]


def test_special_tokens_and_mask(targets):
    for arch, d in targets.items():
        tok = AutoTokenizer.from_pretrained(d)
        model_cfg = AutoModelForCausalLM.from_pretrained(d).config
        for t in tiny.SPECIAL_TOKENS + tiny.TAG_TOKENS + [tiny.MASK_TOKEN]:
            ids = tok.encode(f"a{t}b", add_special_tokens=False)
            assert tok.convert_tokens_to_ids(t) in ids and len(tok.encode(t, add_special_tokens=False)) == 1, t
        mask = tiny.load_mask_token_id(d)
        assert mask == tok.mask_token_id == tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
        assert mask not in (tok.pad_token_id, tok.eos_token_id, model_cfg.pad_token_id, model_cfg.eos_token_id)
        assert mask < model_cfg.vocab_size
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
        gen = json.loads((d / "generation_config.json").read_text())
        assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == model_cfg.eos_token_id
        side = tiny.read_sidecar(d)
        assert side["arch"] == arch and side["built_by"] == "fixtures.tiny" and side["vocab_size"] == 2048
        # think / tool tags are added tokens that decoding keeps (as in Qwen), the ChatML markers are special
        text = tok.decode(tok.encode("<think>x</think><|im_end|>", add_special_tokens=False), skip_special_tokens=True)
        assert text == "<think>x</think>"


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of Japan?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "lookup_capital", "arguments": {"country": "Japan"}}}]},
    {"role": "tool", "name": "lookup_capital", "content": '{"capital": "Tokyo"}'},
    {"role": "assistant", "content": "Tokyo (東京).", "reasoning_content": "The tool said Tokyo."},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4 ✅"},
]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nCapital of Japan?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "lookup_capital", "arguments": {"country": "Japan"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"capital": "Tokyo"}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n<think>\nThe tool said Tokyo.\n</think>\n\nTokyo (東京).<|im_end|>\n"
    "<|im_start|>user\n2 + 2?<|im_end|>\n"
    "<|im_start|>assistant\n4 ✅<|im_end|>\n"
)


def test_chat_template(targets):
    tok = AutoTokenizer.from_pretrained(targets["qwen3_5"])
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert tok.decode(ids) == RENDERED
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 7
    assert ids.count(tok.convert_tokens_to_ids("<think>")) == 2
    prompt = CONVERSATION[:2]
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True).endswith(
        "Capital of Japan?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False
                                   ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = [{"type": "function", "function": {"name": "lookup_capital", "parameters": {"type": "object"}}}]
    with_tools = tok.apply_chat_template(prompt, tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"lookup_capital"' in with_tools
    with pytest.raises(Exception, match="system message must be the first"):
        tok.apply_chat_template(CONVERSATION[1:2] + CONVERSATION[:1], tokenize=False)


def test_training_learns_and_is_deterministic(tmp_path):
    threads = torch.get_num_threads()
    a = _build(tmp_path / "a", "qwen3_5", train_steps=4)
    b = _build(tmp_path / "b", "qwen3_5", train_steps=4)
    assert _hashes(a) == _hashes(b)
    train = tiny.read_sidecar(a)["train"]
    assert train["steps"] == 4 and train["eval_loss_after"] < train["eval_loss_before"] - 0.1
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()  # restored


def test_missing_sidecar_is_actionable(tmp_path):
    with pytest.raises(ValueError, match="stages.build_tiny"):
        tiny.load_mask_token_id(tmp_path)


def test_stage_is_idempotent_and_atomic(tmp_path, capsys):
    out = tmp_path / "tiny"
    args = [f"--out={out}", "--arch=qwen3", f"--corpus_docs={DOCS}", "--eval_docs=20"]
    assert build_tiny.main(args) == 0
    side = tiny.read_sidecar(out)
    assert side["params"]["eval_docs"] == 20 and (out / "corpus" / "eval.jsonl").is_file()
    assert len((out / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()) == DOCS
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temp dirs left behind
    before = _hashes(out)
    capsys.readouterr()
    assert build_tiny.main(args) == 0
    assert "nothing to do" in capsys.readouterr().out and _hashes(out) == before
    with pytest.raises(SystemExit, match="--force"):
        build_tiny.main(args[:-1] + ["--eval_docs=21"])
    with pytest.raises(SystemExit) as e:
        build_tiny.main(["--help"])
    assert e.value.code == 0
    with pytest.raises(ValueError, match=r"^build_tiny: --eval-docs is now --eval_docs \(underscores"):
        build_tiny.main([*args[:-1], "--eval-docs=21"])
