"""dflash_offline.target on CUDA: the packed path (fla varlen conv + chunked delta rule with native value heads,
flash varlen attention or compiled flex_attention, compiled or eager pieces around the kernels) gives every document
the hidden states it has alone, within bf16 rounding; prints packed vs per-document timing.

Run with `make test-gpu` (pytest -m gpu -s). Needs fla (flash-linear-attention) importable for Qwen3.5.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers

from dflash_offline import target as target_mod
from dflash_offline.target import load_target, read_target_info

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Relative error (Frobenius, per document and tapped layer) of a bf16 path against the fp32 per-document reference.
# The packed path may differ from the bf16 per-document path only by kernel rounding: it must stay within
# LEAK_FACTOR x the per-document path's own error (+ BF16_FLOOR). A context leak gives errors of order 1.
BF16_FLOOR = 1e-2
LEAK_FACTOR = 2.0

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}
# hidden 1024, 8 layers, real head dims (attention 256, Gated DeltaNet 128) and the real 3:1 value:key head ratio
BIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=12,
           linear_key_head_dim=128, linear_value_head_dim=128, rope_parameters=ROPE)
# Qwen3.5-27B widths, 4 layers (3 Gated DeltaNet + 1 full attention)
WIDE = dict(vocab_size=4096, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4, num_attention_heads=24,
            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
            linear_key_head_dim=128, linear_value_head_dim=128, rope_parameters=ROPE)


def _need_fla():
    if target_mod._fla() is None:
        pytest.skip("fla (flash-linear-attention) is not importable")


def _save_text_checkpoint(out: Path, text: dict) -> Path:
    """A random text-only Qwen3.5 (Qwen3_5ForCausalLM) in bf16, initialised on the GPU."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(tie_word_embeddings=False, **text)
    with torch.device("cuda"):
        model = transformers.Qwen3_5ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """tiny(arch) -> the embedded tiny target (the shared conftest fixture where present)."""
    def get(arch: str) -> Path:
        try:
            return Path(request.getfixturevalue({"qwen3_5": "qwen35_dir", "qwen3": "qwen3_dir"}[arch]))
        except pytest.FixtureLookupError:
            from fixtures.tiny import build_target

            return Path(build_target(tmp_path_factory.mktemp(arch), arch=arch, seed=0, corpus_docs=300,
                                     log=lambda _: None))

    return get


def _rows(B: int, S: int, vocab: int, seed: int = 0):
    """[B, S] rows: row 0 holds documents of awkward lengths (1, 2, around the 64-token chunk), other rows random
    lengths; even rows end in a padding tail. Returns input_ids, position_ids, doc_ids, document spans."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.zeros(B, S, dtype=torch.long)
    doc = torch.full((B, S), -1, dtype=torch.long)
    spans = []
    for b in range(B):
        fill = S - (int(torch.randint(1, S // 8, (1,), generator=g)) if b % 2 == 0 else 0)
        lengths = [1, 2, 3, 63, 64, 65, 127, 129, 1] if b == 0 else []
        while sum(lengths) < fill:
            lengths.append(1 + int(torch.empty(1).exponential_(1 / (S / 6), generator=g)))
        start = 0
        for d, n in enumerate(lengths):
            n = min(n, fill - start)
            if n <= 0:
                break
            pos[b, start:start + n] = torch.arange(n)
            doc[b, start:start + n] = d
            spans.append((b, start, start + n))
            start += n
    return ids, pos, doc, spans


def _errors(got, ref, spans, k: int) -> torch.Tensor:
    """[n_docs, k] relative Frobenius error of each document's tapped layers."""
    H = ref.shape[-1] // k
    out = torch.empty(len(spans), k)
    for j, (b, s, e) in enumerate(spans):
        a, r = got[b, s:e].float().unflatten(-1, (k, H)), ref[b, s:e].float().unflatten(-1, (k, H))
        out[j] = (a - r).norm(dim=(0, 2)) / r.norm(dim=(0, 2)).clamp_min(1e-12)
    return out


def _timed(fn, repeats: int = 3) -> tuple[torch.Tensor, float]:
    fn()  # warm-up: fla autotunes (and flex compiles) per new shape
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / repeats


VARIANTS = {  # (attention kernel, pieces): the default first
    "flash+compiled": (lambda: target_mod.GPU_KERNELS, target_mod.compiled_pieces),
    "flex+eager": (lambda: target_mod.GPU_FLEX_KERNELS, lambda: target_mod.EAGER_PIECES),
}


def _check_packed(path: Path, layer_ids: list[int], B: int, S: int, label: str,
                  variants: tuple[str, ...] = ("flash+compiled",)):
    """Each packed variant against the fp32 per-document reference (computed once for all variants)."""
    info = read_target_info(path)
    packed = load_target(path, layer_ids, "cuda", torch.bfloat16, mode="packed")
    assert packed.kernels is target_mod.GPU_KERNELS and packed.pieces is target_mod.compiled_pieces()  # defaults
    per_doc = load_target(path, layer_ids, "cuda", torch.bfloat16, mode="per_doc")
    reference = load_target(path, layer_ids, "cuda", torch.float32, mode="per_doc")
    ids, pos, doc, spans = _rows(B, S, min(info.vocab_size, 4096))
    base, t_per_doc = _timed(lambda: per_doc.tapped_hidden_states(ids, pos, doc))
    ref = reference.tapped_hidden_states(ids, pos, doc)
    del reference
    err_per_doc = _errors(base, ref, spans, len(layer_ids))
    bound = torch.maximum(LEAK_FACTOR * err_per_doc, torch.full_like(err_per_doc, BF16_FLOOR))
    tokens = int((doc >= 0).sum())
    pad = doc.cuda() < 0
    for variant in variants:
        packed.kernels, packed.pieces = (f() for f in VARIANTS[variant])
        name = f"{label}, {variant}"
        t0 = time.perf_counter()
        got = packed.tapped_hidden_states(ids, pos, doc)  # first call: autotuning / compilation
        torch.cuda.synchronize()
        warmup = time.perf_counter() - t0
        got, t_packed = _timed(lambda: packed.tapped_hidden_states(ids, pos, doc))
        assert got.shape == (B, S, len(layer_ids) * info.hidden_size) and got.dtype == torch.bfloat16
        assert torch.isfinite(got).all()
        assert torch.equal(got[pad], torch.zeros_like(got[pad]))
        err_packed = _errors(got, ref, spans, len(layer_ids))
        print(f"\n[{name}] {len(spans)} documents, {tokens} tokens in {B}x{S}: "
              f"packed {t_packed * 1e3:.1f} ms ({tokens / t_packed:,.0f} tok/s; first call {warmup:.1f} s), "
              f"per_doc {t_per_doc * 1e3:.1f} ms ({tokens / t_per_doc:,.0f} tok/s); "
              f"rel. error vs fp32, worst document: packed {err_packed.max():.2e}, per_doc {err_per_doc.max():.2e}; "
              f"median packed {err_packed.median():.2e}")
        bad = (err_packed > bound).nonzero().tolist()
        assert not bad, f"{name}: packed exceeds bf16 tolerance at (document, tap) {bad[:5]} " \
                        f"e.g. {err_packed[bad[0][0]].tolist()} vs per_doc {err_per_doc[bad[0][0]].tolist()}"


def test_packed_equals_per_doc_tiny_qwen3_5(tiny):
    _need_fla()
    _check_packed(tiny("qwen3_5"), [1, 3, 5, 7], B=4, S=512, label="tiny qwen3_5")


def test_packed_equals_per_doc_tiny_qwen3(tiny):
    _check_packed(tiny("qwen3"), [1, 3, 5], B=4, S=512, label="tiny qwen3")


def test_packed_equals_per_doc_big(tmp_path):
    _need_fla()
    path = _save_text_checkpoint(tmp_path, BIG)
    _check_packed(path, [1, 3, 5, 7], B=4, S=4096, label="hidden 1024 x 8 layers", variants=tuple(VARIANTS))


def test_packed_equals_per_doc_27b_widths(tmp_path):
    _need_fla()
    path = _save_text_checkpoint(tmp_path, WIDE)
    _check_packed(path, [1, 3], B=2, S=4096, label="27B widths x 4 layers")
