"""Stand-in checkpoints in the real layout of Qwen3.6-27B, Qwen3.5-27B and Qwen3-8B, for rehearsing the production
path on a CPU (nothing downloaded).

    python tests/standin.py OUT [--family=qwen3.6|qwen3.5|qwen3] [--hub=HUB_CACHE]

What is real: the tokenizer and chat template (the registry fixtures of `make fixtures`, tests/real_tokenizers.py),
the vocabulary (248,320 rows for Qwen3.5/3.6, 151,936 for Qwen3), the special-token ids the config names, the
checkpoint layout (Qwen3.5/3.6: the vision-language wrapper `Qwen3_5ForConditionalGeneration`, its text stack under
`model.language_model.*`, untied embeddings; Qwen3: `Qwen3ForCausalLM`), the layer-type pattern (three Gated DeltaNet
layers, then one gated full-attention layer, repeated), the RoPE fields, and the weights split over several
safetensors shards with `model.safetensors.index.json`. What is scaled down: width (hidden 64, heads 4/2 × 16),
depth (`REAL` gives the released values, kept in `dflash_standin.json`) and the vision tower (one tiny block). The
weights are random (seeded): the outputs are noise, the shapes and files are a user's.

`build(out, family)` writes a plain directory; `hub_snapshot(src, hub, repo)` lays the same files out as an HF cache
snapshot (`models--Qwen--Qwen3.6-27B/snapshots/<rev>/`, `refs/main`), so that the hub id resolves offline
(`HF_HUB_CACHE=hub HF_HUB_OFFLINE=1`) the way it does on a user's machine. `text_only(src, out)` writes the language
model of a Qwen3.5/3.6 stand-in alone (`Qwen3_5ForCausalLM`, the same weights under `model.*`): what `transformers
serve` can serve, since it refuses the vision-language layout (it loads an image and video processor, which needs
torchvision).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "build" / "fixtures"
REPOS = {"qwen3.6": "Qwen/Qwen3.6-27B", "qwen3.5": "Qwen/Qwen3.5-27B", "qwen3": "Qwen/Qwen3-8B"}
REAL = {  # the released text configs' sizes (what the stand-in scales down)
    "qwen3.6": {"hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "intermediate_size": 17408},
    "qwen3.5": {"hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "intermediate_size": 17408},
    "qwen3": {"hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288},
}
WIDTH = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}
SHARD = "8MB"  # small enough that every stand-in is several shards + an index


def token_id(tok, text: str) -> int:
    i = tok.convert_tokens_to_ids(text)
    if i is None or i == tok.unk_token_id:
        raise ValueError(f"the {text!r} token is not in the fixture tokenizer")
    return i


def make_config(family: str, tok, depth: int):
    from transformers import Qwen3_5Config, Qwen3Config

    real = REAL[family]
    common = dict(WIDTH, vocab_size=real["vocab_size"], max_position_embeddings=262144, tie_word_embeddings=False,
                  eos_token_id=token_id(tok, "<|im_end|>" if family == "qwen3" else "<|endoftext|>"),
                  bos_token_id=None, dtype="bfloat16")
    if family == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=depth,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, pad_token_id=None)
    text = dict(common, num_hidden_layers=depth, pad_token_id=None,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(depth)],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=WIDTH["hidden_size"], num_position_embeddings=16)
    ids = {k: token_id(tok, t) for k, t in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                                            ("vision_start_token_id", "<|vision_start|>"),
                                            ("vision_end_token_id", "<|vision_end|>"))}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="bfloat16", **ids)


def build(out: str | Path, family: str = "qwen3.6", depth: int = 8, seed: int = 0) -> Path:
    """The stand-in of `family` in `out` (a plain directory), from the fixture tokenizer (`make fixtures` first)."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Qwen3_5ForConditionalGeneration,
        Qwen3ForCausalLM,
    )

    if family not in REPOS:
        raise ValueError(f"family {family!r}: expected one of {', '.join(REPOS)}")
    if depth % 4 and family != "qwen3":
        raise ValueError(f"depth {depth}: the Qwen3.5/3.6 pattern repeats every 4 layers")
    src = FIXTURES / family
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src}: no fixture tokenizer; run `make fixtures` first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    config = make_config(family, tok, depth)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = Qwen3ForCausalLM if family == "qwen3" else Qwen3_5ForConditionalGeneration
        model = cls(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[token_id(tok, "<|im_end|>"),
                                                             token_id(tok, "<|endoftext|>")], do_sample=False)
    model.save_pretrained(str(out), max_shard_size=SHARD)
    (out / "dflash_standin.json").write_text(json.dumps(
        {"family": family, "stands_in_for": REPOS[family], "released": REAL[family], "depth": depth, "seed": seed,
         "width": WIDTH, "weights": "random"}, indent=1, sort_keys=True))
    return out


def text_only(src: str | Path, out: str | Path) -> Path:
    """The language model of the Qwen3.5/3.6 stand-in in `src` as a text-only checkpoint in `out`: its `text_config`
    as a `Qwen3_5ForCausalLM`, the weights under `model.language_model.*` moved to `model.*` (the vision tower
    dropped), the same tokenizer and generation config. The same function of the same tokens as `src`'s text path."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig, Qwen3_5ForCausalLM

    src, out = Path(src), Path(out)
    text = AutoConfig.from_pretrained(src).text_config
    text.architectures = ["Qwen3_5ForCausalLM"]
    state = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        for name, w in load_file(shard).items():
            if name.startswith("model.language_model."):
                state["model." + name.removeprefix("model.language_model.")] = w
            elif name == "lm_head.weight":
                state[name] = w
    model = Qwen3_5ForCausalLM(text).to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.generation_config = GenerationConfig.from_pretrained(src)
    model.save_pretrained(str(out), max_shard_size=SHARD)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)
    return out


def hub_snapshot(src: str | Path, hub: str | Path, repo: str) -> Path:
    """`src`'s files as the HF cache lays out a downloaded snapshot of `repo` under `hub` (HF_HUB_CACHE); returns the
    snapshot directory. The revision is a digest of the files, as stable as they are."""
    src, hub = Path(src), Path(hub)
    files = sorted(p for p in src.iterdir() if p.is_file())
    rev = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes()[:4096] for p in files)).hexdigest()
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copyfile(p, snap / p.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    return snap


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python tests/standin.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write the stand-in into")
    ap.add_argument("--family", default="qwen3.6", help=f"one of {', '.join(REPOS)}")
    ap.add_argument("--depth", type=int, default=8, help="layers (a multiple of 4 for Qwen3.5/3.6)")
    ap.add_argument("--hub", default="", help="also lay it out as an HF cache snapshot under this HF_HUB_CACHE")
    a = ap.parse_args(argv)
    out = build(a.out, a.family, a.depth)
    print(out)
    if a.hub:
        print(hub_snapshot(out, a.hub, REPOS[a.family]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
