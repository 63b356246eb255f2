"""dflash_offline.target on the CPU: config reading, truncated loading of only the needed tensors, and packed rows
giving every document exactly the hidden states it has alone (checked against the full transformers model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dflash_offline import target as target_mod
from dflash_offline.target import (
    REFERENCE_KERNELS,
    PackedKernels,
    compiled_pieces,
    conv_per_segment,
    default_layer_ids,
    delta_rule_per_segment,
    flex_attention_kernel,
    load_target,
    read_target_info,
    torch_gated_deltanet_kernels,
)

# fp32, the same math in another order (packed paths, per-segment kernels, compiled pieces): the tapped states of the
# tiny targets are ≤ 0.1 (RMS 0.02), and ≤ 8 layers × ~8 sums of ≤ 128 terms round them by λ·u·√(128·64) = 2.7e-5 of
# that (tests/equivalence.py, `forward_rtol`), ~3e-6; the chunked delta rule's longer chains and a margin: 2e-5
# (measured on an AMD EPYC, torch 2.13: ≤ 8.3e-7 truncated vs the full model, ≤ 6e-8 packed vs alone)
FP32_ATOL = 2e-5
BF16_RTOL = 3e-2  # relative Frobenius error of a bf16 run against the fp32 reference

# eager flex_attention on CPU warns that it is not compiled; that is intended for these tiny inputs
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


# --------------------------------------------------------------------------------------------------------------
# tiny checkpoints


def _save_gva_text_checkpoint(out: Path) -> Path:
    """Text-only Qwen3.5 (Qwen3_5ForCausalLM) whose Gated DeltaNet has 2 value heads per key head, fp32."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(str(out))
    return out


def _save_fallback_checkpoint(out: Path, arch: str) -> Path:
    """Used only while fixtures.tiny is missing: a tiny VL-wrapper Qwen3.5 or a tiny Qwen3, fp32."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=6, **common))
    else:
        text = dict(common, num_hidden_layers=8, linear_num_key_heads=4, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      out_hidden_size=64, num_position_embeddings=16)
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory):
    """ckpt(name) -> checkpoint dir: "qwen3_5" (VL wrapper) and "qwen3" are the embedded tiny targets (the shared
    conftest fixtures where present), "qwen3_5_gva" a text-only Qwen3.5 built here."""
    shared = {"qwen3_5": "qwen35_dir", "qwen3": "qwen3_dir"}
    built = {}

    def get(name: str) -> Path:
        if name in built:
            return built[name]
        out = tmp_path_factory.mktemp(name)
        if name == "qwen3_5_gva":
            built[name] = _save_gva_text_checkpoint(out)
            return built[name]
        try:
            built[name] = Path(request.getfixturevalue(shared[name]))
        except pytest.FixtureLookupError:
            try:
                from fixtures.tiny import build_target
            except ImportError:
                built[name] = _save_fallback_checkpoint(out, name)
            else:
                built[name] = Path(build_target(out, arch=name, seed=0, corpus_docs=300, log=lambda _: None))
        return built[name]

    return get


@pytest.fixture(scope="module")
def hf_model(ckpt):
    """hf_model(name) -> the full transformers model of that checkpoint, fp32 (the reference)."""
    models = {}

    def get(name: str):
        if name not in models:
            path = ckpt(name)
            cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
            models[name] = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        return models[name]

    return get


def _hf_alone(model, ids_L: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[L, K*H]: transformers' hidden_states[id + 1] of one document run alone, concatenated."""
    with torch.no_grad(), torch_gated_deltanet_kernels():  # where fla imports, transformers would call it on CPU
        hs = model(input_ids=ids_L[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)


def _rows(doc_lengths: list[list[int]], S: int, vocab: int, seed: int = 0):
    """input_ids, position_ids, doc_ids [B, S] of rows packing the given documents; the rest is padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(doc_lengths), S), generator=g)
    pos = torch.zeros(len(doc_lengths), S, dtype=torch.long)
    doc = torch.full((len(doc_lengths), S), -1, dtype=torch.long)
    for b, lengths in enumerate(doc_lengths):
        start = 0
        for d, n in enumerate(lengths):
            pos[b, start:start + n] = torch.arange(n)
            doc[b, start:start + n] = d
            start += n
        assert start <= S
    return ids, pos, doc


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --------------------------------------------------------------------------------------------------------------
# layer ids and config


def test_default_layer_ids():
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_layer_ids(64, 1) == [32]
    with pytest.raises(ValueError):
        default_layer_ids(64, 0)


@pytest.mark.parametrize("name,arch,layers", [("qwen3_5", "qwen3_5", 8), ("qwen3", "qwen3", 6),
                                              ("qwen3_5_gva", "qwen3_5", 4)])
def test_read_target_info_tiny(ckpt, name, arch, layers):
    info = read_target_info(ckpt(name))
    assert (info.arch, info.num_layers, info.hidden_size) == (arch, layers, 64)
    assert len(info.layer_types) == layers
    if arch == "qwen3_5":
        assert info.layer_types[3] == "full_attention" and info.layer_types[0] == "linear_attention"
        assert info.rope_theta == 1e7
    else:
        assert set(info.layer_types) == {"full_attention"}


def test_read_target_info_27b_config_without_weights(tmp_path):
    text = {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320,
        "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "eos_token_id": 248044, "dtype": "bfloat16", "tie_word_embeddings": False,
    }
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 5120},
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = read_target_info(tmp_path)
    assert (info.arch, info.num_layers, info.hidden_size, info.vocab_size) == ("qwen3_5", 64, 5120, 248320)
    assert info.rope_theta == 1e7 and info.dtype == "bfloat16" and info.eos_token_id == 248044
    assert info.layer_types.count("full_attention") == 16 and info.layer_types[3] == "full_attention"
    assert all(0 <= i < info.num_layers for i in default_layer_ids(info.num_layers, 5))


def test_unknown_or_missing_target_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_target_info(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"(?s)'llama'.*LlamaForCausalLM.*qwen3_5"):
        read_target_info(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# truncated model = full model


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3", "qwen3_5_gva"])
def test_truncated_equals_full_model(ckpt, hf_model, name):
    """Tapped states of one document equal transformers' hidden_states[id + 1], the last layer's normed as there."""
    n_layers = read_target_info(ckpt(name)).num_layers
    layer_ids = [n_layers - 2, 1, n_layers - 1]  # any order; the last layer's output is taken after the norm
    target = load_target(ckpt(name), layer_ids, "cpu", torch.float32, mode="per_doc")
    ids, pos, doc = _rows([[41]], 41, 200)
    got = target.tapped_hidden_states(ids, pos, doc)[0]
    assert got.shape == (41, 3 * 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, _hf_alone(hf_model(name), ids[0], layer_ids), atol=FP32_ATOL, rtol=0)


def test_bf16_within_bf16_tolerance(ckpt, hf_model):
    layer_ids = [1, 4, 6]
    target = load_target(ckpt("qwen3_5"), layer_ids, "cpu", torch.bfloat16, mode="per_doc")
    ids, pos, doc = _rows([[20, 37]], 64, 200)
    got = target.tapped_hidden_states(ids, pos, doc)
    assert got.dtype == torch.bfloat16
    for s, e in [(0, 20), (20, 57)]:
        want = _hf_alone(hf_model("qwen3_5"), ids[0, s:e], layer_ids)
        err = _rel(got[0, s:e], want)
        assert err < BF16_RTOL, err


# --------------------------------------------------------------------------------------------------------------
# packed rows = documents alone

FLEX_ON_CPU = PackedKernels(flex_attention_kernel, conv_per_segment, delta_rule_per_segment)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3", "qwen3_5_gva"])
def test_packed_rows_equal_documents_alone(ckpt, hf_model, name):
    """Three documents of different lengths + a padding tail, and a row of equal-length and one-token documents:
    every path gives each document its hidden states alone (fp32); padding is zero."""
    n_layers = read_target_info(ckpt(name)).num_layers
    layer_ids = [1, n_layers - 2]
    target = load_target(ckpt(name), layer_ids, "cpu", torch.float32, mode="per_doc")
    lengths = [[23, 9, 17], [20, 20, 1, 23]]
    ids, pos, doc = _rows(lengths, 64, 200, seed=1)
    paths = {
        "per_doc": target.tapped_hidden_states(ids, pos, doc),
        "packed/reference": target.packed_hidden_states(ids, pos, doc, REFERENCE_KERNELS),
        "packed/flex": target.packed_hidden_states(ids, pos, doc, FLEX_ON_CPU),
        # the pieces between the kernels as torch.compile runs them on CUDA (Inductor's CPU backend here)
        "packed/compiled": target.packed_hidden_states(ids, pos, doc, REFERENCE_KERNELS, compiled_pieces()),
    }
    model = hf_model(name)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            want = _hf_alone(model, ids[b, start:start + n], layer_ids)
            for path, got in paths.items():
                torch.testing.assert_close(got[b, start:start + n], want, atol=FP32_ATOL, rtol=0,
                                           msg=lambda m, p=path, r=b, s=start: f"{p}, row {r}, doc at {s}: {m}")
            start += n
        for got in paths.values():
            assert torch.equal(got[b, start:], torch.zeros_like(got[b, start:]))

    # the check has teeth: the first row run as one document differs from its documents run alone
    as_one = target.tapped_hidden_states(ids[:1, :49], torch.arange(49)[None], torch.zeros(1, 49, dtype=torch.long))
    assert not torch.allclose(as_one[0, 23:49], paths["per_doc"][0, 23:49], atol=1e-3)


def test_bad_rows_refused(ckpt):
    target = load_target(ckpt("qwen3"), [1], "cpu", torch.float32)
    ids, pos, doc = _rows([[10, 10]], 24, 200)
    with pytest.raises(ValueError, match="positions"):
        target.tapped_hidden_states(ids, torch.arange(24)[None], doc)  # not restarting at the second document
    doc[0, 5] = -1
    with pytest.raises(ValueError, match="padding"):
        target.tapped_hidden_states(ids, pos, doc)


def test_mode_packed_needs_cuda(ckpt):
    assert load_target(ckpt("qwen3"), [1], "cpu", torch.float32, mode="auto").mode == "per_doc"
    with pytest.raises(ValueError, match="CUDA"):
        load_target(ckpt("qwen3"), [1], "cpu", torch.float32, mode="packed")
    with pytest.raises(ValueError, match="layer_ids"):
        load_target(ckpt("qwen3"), [1, 6], "cpu", torch.float32)


# a stand-in for fla where it imports but its Triton kernels cannot run (Triton installed, no GPU): transformers binds
# its functions to the Gated DeltaNet layers all the same
FAKE_FLA = "def chunk_gated_delta_rule(*a, **k):\n    raise RuntimeError('a stand-in fla kernel was called')\n\n" \
    "fused_recurrent_gated_delta_rule = chunk_gated_delta_rule\n"
ROUTED_RUN = """import sys, torch
if sys.argv[1] == "with":
    import dflash_offline
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
ids = torch.arange(3, 40)[None]
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=4, do_sample=False)  # prefill: chunked rule; each new token: recurrent
    torch.save((model(ids).logits, out), sys.argv[3])
if sys.argv[1] == "with":  # every argument by keyword (the device read from the first tensor), one it does not name
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    decay, beta = -torch.rand(1, 8, 2, generator=g), torch.rand(1, 8, 2, generator=g)
    fn = m.torch_chunk_gated_delta_rule
    got = fn(query=q, key=k, value=v, g=decay, beta=beta, output_final_state=True, cu_seqlens=None)
    want = fn.__wrapped__(q, k, v, decay, beta, output_final_state=True)
    assert fn.routed_by_device and all(torch.equal(a, b) for a, b in zip(got, want)), "keyword call"
"""


def test_a_cpu_forward_takes_the_torch_functions_where_transformers_bound_fla_kernels(tmp_path, ckpt):
    """Where fla imports, transformers binds its Triton kernels to Qwen3.5's Gated DeltaNet whatever the device; in a
    process that imported dflash_offline a CPU forward and a CPU decode run transformers' torch functions instead
    (`route_gated_deltanet_by_device`), with the logits and tokens of the torch path. Without dflash_offline, the
    stand-in kernels are reached."""
    pkg = tmp_path / "site" / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    for d in (pkg.parents[1], pkg.parent):
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_FLA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        (str(tmp_path / "site"), str(Path(__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])))}
    runs = {}
    for mode in ("with", "without"):
        out = tmp_path / f"{mode}.pt"
        runs[mode] = subprocess.run([sys.executable, "-c", ROUTED_RUN, mode, str(ckpt("qwen3_5")), str(out)],
                                    env=env, capture_output=True, text=True, timeout=300)
    assert runs["without"].returncode != 0 and "a stand-in fla kernel was called" in runs["without"].stderr
    assert runs["with"].returncode == 0, runs["with"].stderr[-3000:]
    logits, tokens = torch.load(tmp_path / "with.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt("qwen3_5")), dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad(), torch_gated_deltanet_kernels():
        assert torch.equal(logits, model(ids).logits)
        assert torch.equal(tokens, model.generate(ids, max_new_tokens=4, do_sample=False))


# --------------------------------------------------------------------------------------------------------------
# loading only what is needed


class _SpyFile:
    def __init__(self, f, read: list[str]):
        self.f, self.read = f, read

    def keys(self):
        return self.f.keys()

    def get_tensor(self, key):
        self.read.append(key)
        return self.f.get_tensor(key)


@pytest.fixture
def spy(monkeypatch):
    """Records the files opened and the tensors read through target.safe_open."""
    opened, read = [], []
    real = target_mod.safe_open

    @contextmanager
    def spy_open(path, framework, device="cpu"):
        opened.append(Path(path).name)
        with real(path, framework=framework, device=device) as f:
            yield _SpyFile(f, read)

    monkeypatch.setattr(target_mod, "safe_open", spy_open)
    return opened, read


def _checkpoint_keys(path: Path) -> set[str]:
    return set(load_file(str(path / "model.safetensors")))


def test_reads_only_the_needed_tensors(ckpt, spy):
    opened, read = spy
    load_target(ckpt("qwen3_5"), [1], "cpu", torch.float32)
    prefix = "model.language_model."
    want = {k for k in _checkpoint_keys(ckpt("qwen3_5"))
            if k == prefix + "embed_tokens.weight" or k.startswith((prefix + "layers.0.", prefix + "layers.1."))}
    assert sorted(read) == sorted(want)  # no vision tower, no lm_head, no deeper layer, no final norm


def test_sharded_checkpoint_opens_only_needed_shards(ckpt, hf_model, tmp_path, spy):
    opened, read = spy
    hf_model("qwen3_5").save_pretrained(str(tmp_path), max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    target = load_target(tmp_path, [1], "cpu", torch.float32)
    needed_files = {index[k] for k in read}
    assert set(opened) == needed_files and len(needed_files) < len(set(index.values()))
    reference = load_target(ckpt("qwen3_5"), [1], "cpu", torch.float32)
    ids, pos, doc = _rows([[30]], 32, 200)
    torch.testing.assert_close(target.tapped_hidden_states(ids, pos, doc),
                               reference.tapped_hidden_states(ids, pos, doc), atol=0, rtol=0)


def test_missing_tensor_is_named(ckpt, tmp_path):
    src = ckpt("qwen3_5")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    gone = "model.language_model.layers.1.mlp.up_proj.weight"
    del tensors[gone]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_target(tmp_path, [0], "cpu", torch.float32)  # layer 1 is not needed for a tap at 0
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_target(tmp_path, [1], "cpu", torch.float32)
