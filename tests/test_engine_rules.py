"""The export's config.json read by the rules vLLM and SGLang apply when they load a DFlash drafter — block size,
per-layer attention (sliding window, causality inside the block), the target states that feed the drafter, the mask
token — must give back what the drafter was trained with. Checked for the tiny Qwen3.5 and Qwen3 targets (a run
resolved as `make train` resolves it, exported by `export.export`) and for the 27B/8B recipes at the real shapes with
the released tokenizers (config level, no weights, rendered as tests/test_recipes.py renders them). Every rule also
meets a config that breaks it and must catch it, so none of these checks can pass vacuously.

The rules are re-stated from the released code (read there, not copied):
- vLLM 0.33.0: vllm-project/vllm at commit 4ba787ec9 (the PyPI wheel's vllm/_version.py), cited as "vLLM <path>";
- SGLang 0.5.23: sgl-project/sglang tag v0.5.23 (the PyPI wheel, which records no commit id), cited as
  "SGLang <path>" relative to python/.
Both read config.json through transformers' AutoConfig (model_type "qwen3" → Qwen3Config: its __post_init__ drops
`sliding_window` unless `use_sliding_window`, and derives `layer_types` from `max_window_layers` when the file has
none); `engine_view` does the same, so the resolvers see the attributes the engines see.
"""

import dataclasses
import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from test_recipes import QWEN3_8B, QWEN36_27B, RECIPES, exported_config, resolved_drafter, target_dir

from dflash_offline.checkpoint import save_checkpoint
from dflash_offline.drafter import DFlashDrafter, DrafterConfig
from dflash_offline.export import ExportError, export, usage, zlab_config
from dflash_offline.target import default_layer_ids, read_target_info
from dflash_offline.trainsetup import TrainConfig, cache_defaults, drafter_config
from fixtures import tiny

SLIDING, FULL = "sliding_attention", "full_attention"
FIELDS = ("block_size", "mask_token_id", "layers", "taps")


class Refused(Exception):
    """The engine would not serve this config (it raises at start-up or on the first forward); the message says why."""


@dataclasses.dataclass(frozen=True)
class Target:
    layers: int  # num_hidden_layers of the served target (N)
    vocab: int  # rows of its embedding (its config's vocab_size)
    arch: str  # "qwen3" (dense, Qwen3ForCausalLM) or "qwen3_5" (hybrid, Qwen3_5ForConditionalGeneration)
    tokenizer: str  # directory of its tokenizer (what the engine loads beside the target)


def engine_view(raw: dict) -> dict:
    """The config as both engines get it: config.json through transformers' AutoConfig (vLLM
    transformers_utils/config.py get_config → AutoConfig, then config/speculative.py wraps it in EAGLEConfig,
    which copies its attributes; SGLang srt/utils/hf_transformers/config.py get_config → AutoConfig)."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        return AutoConfig.from_pretrained(d, trust_remote_code=True).to_dict()


@functools.cache
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    vocab = tok.get_vocab()  # (0.5 s for the 248K Qwen3.5/3.6 vocabulary: read once; the resolvers add no token)
    tok.get_vocab = lambda: vocab
    return tok


# --- vLLM 0.33.0 ---------------------------------------------------------------------------------------------------


def vllm_resolve(hf: dict, num_speculative_tokens: int, target_layers: int) -> dict:
    """What vLLM serves (`--speculative-config {"method": "dflash", "num_speculative_tokens": n}`): block size,
    mask token id, per-layer attention as (causal inside the block, most positions a query looks back or None),
    and the target's `hidden_states` indices (transformers' convention) fed to `fc`, in the order fed."""
    dflash = hf.get("dflash_config") or {}
    # block: 1 + num_speculative_tokens query slots per request; the config's block_size is not read for dflash
    # (vLLM v1/spec_decode/dflash.py num_query_per_req; config/speculative.py infers n only for dspark) and neither
    # is num_target_layers
    block = 1 + num_speculative_tokens
    # mask: dflash_config.mask_token_id, else top-level mask_token_id (vLLM v1/worker/gpu/spec_decode/utils.py
    # get_parallel_drafting_token_id; v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params)
    if "mask_token_id" in dflash:
        mask = int(dflash["mask_token_id"])
    elif hf.get("mask_token_id") is not None:
        mask = int(hf["mask_token_id"])
    else:
        raise Refused("no dflash_config.mask_token_id nor mask_token_id")
    # layers (vLLM model_executor/models/qwen3_dflash.py _resolve_layer_attention, _dflash_layer_causal): sliding
    # per layer_types (or every layer when dflash_config.use_swa and layer_types has none); window
    # dflash_config.swa_window_size, else sliding_window, which flash-attention applies as (W-1, 0) (vLLM
    # v1/attention/backends/flash_attn.py); causal = is_causal, else dflash_config.causal, else "layer is sliding"
    # (is_causal since PR #52816); a non-causal sliding layer's window is symmetric, W - 1 forward too (PR #46104), so
    # it sees its whole block when W >= the block (which training requires of block_attention "bidirectional")
    types, use_swa = hf.get("layer_types"), dflash.get("use_swa", False)
    any_sliding = bool(types) and SLIDING in types
    layers = []
    for i in range(hf["num_hidden_layers"]):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
        window = dflash.get("swa_window_size", hf.get("sliding_window")) if sliding else None
        if sliding and window is None:
            raise Refused("sliding attention without dflash_config.swa_window_size or sliding_window")
        causal = hf.get("is_causal")
        causal = dflash.get("causal") if causal is None else causal
        causal = (bool(types) and types[i] == SLIDING) if causal is None else bool(causal)
        layers.append((causal, None if window is None else int(window) - 1))
    # taps: aux ids = eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1 (vLLM
    # v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config); the target records aux id a
    # as the residual stream entering layer a (a = 0: the embeddings; a = N: the last layer's output *before* the
    # final norm), walking its layers in order, each once (model_executor/models/interfaces.py EagleModelMixin,
    # qwen2.py / qwen3_next.py forward); fc takes len(aux ids) features (qwen3_dflash.py
    # _get_dflash_fc_input_size, combine_hidden_states raises on any other count)
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or [int(t) + 1 for t in dflash.get("target_layer_ids") or []]
    if not aux:
        raise Refused("no dflash_config.target_layer_ids (vLLM would fall back to its EAGLE-3 default layers)")
    captured = sorted({a for a in aux if 0 <= a <= target_layers})
    if len(captured) != len(aux):
        raise Refused(f"fc takes {len(aux)} target states, the target records {len(captured)} (aux ids {aux})")
    # transformers' hidden_states[N] is the *normed* last layer: vLLM's a = N is no entry of it (None)
    taps = [a if a < target_layers else None for a in captured]
    mixed = 0 < sum(t == SLIDING for t in types or []) < len(types or [])  # needs the V2 model runner, and so
    # does DFlash2: its proposal is a V2 speculator (v1/worker/gpu/spec_decode/dflash2/speculator.py)
    mixed = mixed or (hf.get("architectures") or [None])[0] == "DFlash2DraftModel"
    return {"block_size": block, "mask_token_id": mask, "layers": layers, "taps": taps, "v2_runner": mixed}


# --- SGLang 0.5.23 -------------------------------------------------------------------------------------------------


def sglang_resolve(hf: dict, tokenizer, target: Target, dflash_block_size: int | None = None,
                   num_draft_tokens: int | None = None) -> dict:
    """What SGLang serves (`--speculative-algorithm DFLASH [--speculative-dflash-block-size B]
    [--speculative-num-draft-tokens B]`), in the terms of `vllm_resolve`."""
    dflash = hf.get("dflash_config") or {}
    text = hf.get("text_config") or hf
    n = text["num_hidden_layers"]
    # block: --speculative-dflash-block-size (must equal --speculative-num-draft-tokens when both are given), else
    # --speculative-num-draft-tokens, else dflash_config.block_size, else top-level block_size, else 16 (SGLang
    # srt/arg_groups/speculative_hook.py _handle_dflash; srt/speculative/dflash_utils.py parse_dflash_draft_config;
    # srt/speculative/dflash_worker_v2.py only warns when the config's block_size differs)
    if dflash_block_size is not None and num_draft_tokens not in (None, dflash_block_size):
        raise Refused("--speculative-num-draft-tokens and --speculative-dflash-block-size differ")
    block = dflash_block_size or num_draft_tokens
    if block is None:
        block = dflash.get("block_size", hf.get("block_size"))
        block = 16 if block is None else int(block)
    # mask (srt/speculative/dflash_utils.py parse_dflash_draft_config: mask_token defaults to "<|MASK|>";
    # srt/speculative/dflash_worker_v2.py _resolve_mask_token_id): with an id, it must be a row of the target's
    # embedding and, when the tokenizer knows the string, the tokenizer's id of it; without one, the tokenizer's
    # mask token if it is that string, else the string's id, else the string is added (the next id, len(tokenizer))
    token = dflash.get("mask_token", hf.get("mask_token")) or "<|MASK|>"
    mask = dflash.get("mask_token_id", hf.get("mask_token_id"))
    vocab = tokenizer.get_vocab()
    if mask is not None:
        if token in vocab and vocab[token] != mask:
            raise Refused(f"dflash_config.mask_token_id {mask} conflicts with the tokenizer's id {vocab[token]} "
                          f"of mask_token {token!r}")
    elif getattr(tokenizer, "mask_token", None) == token:
        mask = tokenizer.mask_token_id
    else:
        mask = vocab.get(token, len(tokenizer))
    if not 0 <= mask < target.vocab:
        raise Refused(f"mask_token_id {mask} is outside the target's {target.vocab} embedding rows")
    # layers (srt/models/dflash.py _get_dflash_layer_attention_params, _get_dflash_attention_type;
    # srt/speculative/dflash_utils.py get_dflash_layer_types, get_dflash_attention_sliding_window_size): no
    # layer_types = every layer full; "full_attention" non-causal (ENCODER_ONLY), "sliding_attention" causal
    # (DECODER) with window_left = sliding_window - 1 (a missing sliding_window is an error); is_causal overrides
    types = text.get("layer_types", hf.get("layer_types"))
    layers = []
    for i in range(n):
        kind = FULL if types is None else types[i] if i < len(types) else None
        if kind not in (FULL, SLIDING):
            raise Refused(f"layer {i}: layer type {kind!r}")
        window = text.get("sliding_window", hf.get("sliding_window")) if kind == SLIDING else None
        if kind == SLIDING and window is None:
            raise Refused("sliding_attention layers require config.sliding_window")
        if types is None:  # every layer full and non-causal; is_causal is not read
            causal = False
        else:
            causal = kind == SLIDING if text.get("is_causal") is None else bool(text["is_causal"])
        layers.append((causal, None if window is None else int(window) - 1))
    # taps: dflash_config.target_layer_ids (else top-level, else build_target_layer_ids' default), each in
    # [0, runtime N) (srt/model_executor/model_runner_components/spec_aux_hidden_state.py
    # _resolve_dflash_aux_hidden_state, DFlashDraftConfig.resolve_target_layer_ids; a num_target_layers unlike the
    # runtime N is only a warning there) and below the draft's num_target_layers (srt/models/dflash.py
    # DFlashDraftModel.__init__); the target captures the residual stream entering layer t + 1 (the output of layer
    # t), walking its layers in order, each once (srt/models/qwen3.py set_dflash_layers_to_capture + Qwen3Model
    # forward: t + 1 = N is never reached; srt/models/qwen3_vl.py set_dflash_layers_to_capture + qwen3_5.py
    # Qwen3_5ForCausalLM: self.layers[t + 1] fails for t + 1 = N)
    ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
    if ids is None:
        N = target.layers
        ids = [N // 2] if n == 1 else [round(1 + i * (N - 4) / (n - 1)) for i in range(n)]
    ids = [int(t) for t in ids]
    trained_n = dflash.get("num_target_layers", hf.get("num_target_layers"))
    trained_n = max(ids) + 1 if trained_n is None else int(trained_n)
    for bound, what in ((target.layers, "the target's layers"), (trained_n, "the draft's num_target_layers")):
        if not all(0 <= t < bound for t in ids):
            raise Refused(f"target_layer_ids {ids} not all in [0, {bound}) ({what})")
    points = [t + 1 for t in ids]
    if target.arch == "qwen3_5" and max(points) >= target.layers:
        raise Refused(f"capture before layer {max(points)} of a {target.layers}-layer target (IndexError)")
    captured = sorted({p for p in points if p < target.layers})
    if len(captured) != len(ids):
        raise Refused(f"fc takes {len(ids)} target states, the target captures {len(captured)} (layers {points})")
    warnings = [] if trained_n == target.layers else [f"num_target_layers {trained_n} != {target.layers}"]
    return {"block_size": block, "mask_token_id": int(mask), "layers": layers, "taps": captured,
            "warnings": warnings}


# --- the weights: which parameter each checkpoint tensor reaches, and which parameters none reaches -------------------
#
# DFlash2 (z-lab's `DFlash2DraftModel`: a grouped dynamic conv around every attention and MLP, a candidate selector)
# in both engines, re-stated from the code that added it — vLLM PR #52816 and SGLang PR #35371, both "DFlash2: local
# convolution + candidate selector" (read: vllm-project/vllm vllm/model_executor/models/qwen3_dflash2.py at 030da624
# and qwen3_dflash.py at 036a00d1; SGLang's python/sglang/srt/models/dflash.py and srt/speculative/dflash_utils.py on
# the PR author's branch SubSir/sglang at 055d82c / 018af5e — the released 0.33.0 / 0.5.23 trees are too large to
# fetch here; the loading rules below did not differ between the versions read).


STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
LAYER_SLOTS = ("self_attn.qkv_proj.weight:q", "self_attn.qkv_proj.weight:k", "self_attn.qkv_proj.weight:v",
               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "mlp.gate_up_proj.weight:0", "mlp.gate_up_proj.weight:1", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight")
CONV_SLOTS = tuple(f"{c}.{k}" for c in ("attention_conv", "mlp_conv") for k in ("base_kernel", "kernel_projection.weight"))
# the codebooks are plain parameters (nn.Parameter, no `.weight`) in both engines, as in z-lab's checkpoints
SELECTOR_SLOTS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                  "candidate_selector.hidden_projection.weight")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def engine_slots(n_layers: int, conv: bool, selector: bool, prefix: str = "") -> set[str]:
    """The engine's drafter parameters, one entry per loaded part ("param:shard" for the fused q/k/v and gate/up)."""
    slots = {f"{prefix}{k}" for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    for i in range(n_layers):
        slots |= {f"{prefix}layers.{i}.{k}" for k in LAYER_SLOTS + CONV_SLOTS * conv}
    return slots | {f"{prefix}{k}" for k in SELECTOR_SLOTS * selector}


def slot_of(name: str, prefix: str = "") -> str:
    """A checkpoint name as both engines map it: q/k/v_proj into the fused qkv_proj, gate/up_proj into gate_up_proj
    (vLLM qwen3_dflash.py hf_to_vllm_mapper orig_to_new_stacked; SGLang srt/models/dflash.py load_weights
    stacked_params_mapping)."""
    for w, (param, shard) in STACKED.items():
        if f".{w}." in name:
            return f"{prefix}{name.replace(w, param)}:{shard}"
    return f"{prefix}{name}"


def vllm_load(hf: dict, names: list[str]) -> list[str]:
    """vLLM's load of `names` into the class config.json's architecture names (model_executor/models/registry.py:
    DFlashDraftModel → qwen3_dflash.DFlashQwen3ForCausalLM, DFlash2DraftModel → qwen3_dflash2.DFlash2Qwen3ForCausalLM,
    whose layers always carry both convolutions and whose model the selector, sized by dflash_config[...] with no
    default). DFlashQwen3ForCausalLM.load_weights prefixes "model." and AutoWeightsLoader raises on a name that
    reaches no parameter; it returns None, so the default loader's "weights not initialized from checkpoint" check is
    skipped: a parameter no tensor reaches stays as allocated (torch.empty), silently. Returns those."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ("DFlashDraftModel", "DFlash2DraftModel"):
        raise Refused(f"architecture {arch!r} is not a DFlash drafter")
    two = arch == "DFlash2DraftModel"
    dflash = hf.get("dflash_config") or {}
    if two and (absent := [k for k in DFLASH2_FIELDS if k not in dflash]):
        raise Refused(f"DFlash2Qwen3ForCausalLM reads dflash_config[{absent[0]!r}] (KeyError)")
    slots, loaded = engine_slots(hf["num_hidden_layers"], two, two, "model."), set()
    for name in names:
        slot = slot_of(name, "model.")
        if slot not in slots:
            raise Refused(f"There is no module or parameter named {slot.split(':')[0]!r}")
        loaded.add(slot)
    return sorted(slots - loaded)


def sglang_load(hf: dict, names: list[str]) -> list[str]:
    """SGLang's load of `names` into DFlashDraftModel (srt/models/dflash.py), which builds the convolutions when
    dflash_config has conv_kernel_size and conv_group_size and the selector when it has the selector's rank and top-k
    (srt/speculative/dflash_utils.py parse_dflash_draft_config: both of a pair or neither; it does not read the
    architecture). load_weights resolves a name with or without "model." and *skips* one that reaches no parameter
    ("Ignore unexpected weights"); nothing checks the parameters no tensor reached. Returns the skipped tensors and
    the parameters left unloaded: both are silent there."""
    dflash = hf.get("dflash_config") or {}  # (PR #35371's four flat fields; an earlier revision on the author's
    # branch nested the selector's as dflashv2_selector {rank, top_k})
    conv, selector = (bool(dflash.get(a)) + bool(dflash.get(b)) for a, b in (DFLASH2_FIELDS[:2], DFLASH2_FIELDS[2:]))
    if 1 in (conv, selector):
        raise Refused("the convolution needs conv_kernel_size and conv_group_size together (selector: rank and "
                      "top_k together)")
    slots, loaded, skipped = engine_slots(hf["num_hidden_layers"], conv == 2, selector == 2), set(), []
    for name in names:
        slot = slot_of(name.removeprefix("model."))
        (loaded.add(slot) if slot in slots else skipped.append(f"skipped {name}"))
    return skipped + sorted(slots - loaded)


def weights_served(raw: dict, names: list[str]) -> dict:
    """engine -> the tensors it does not consume or the parameters it leaves unloaded ([] = every tensor reaches its
    parameter and every parameter is loaded), or "refused: why"."""
    hf, out = engine_view(raw), {}
    for engine, load in (("vllm", vllm_load), ("sglang", sglang_load)):
        try:
            out[engine] = load(hf, names)
        except Refused as e:
            out[engine] = f"refused: {e}"
    return out


# --- the drafter as trained, and the comparison --------------------------------------------------------------------


def trained(drafter: dict) -> dict:
    """The drafter's training settings in the resolvers' terms: DESIGN and dflash_offline/masks.py (a sliding layer
    sees keys fewer than W positions back and, inside the block, earlier slots only — or every slot with
    block_attention "bidirectional"; a full layer the whole block); a tap t is transformers' hidden_states[t + 1],
    the last layer's normed (tests/test_target.py)."""
    W = drafter["sliding_window"]
    causal = drafter.get("block_attention", "causal") == "causal"
    layers = [(causal, W - 1) if t == SLIDING else (False, None) for t in drafter["layer_types"]]
    return {"block_size": drafter["block_size"], "mask_token_id": drafter["mask_token_id"], "layers": layers,
            "taps": [t + 1 for t in drafter["target_layer_ids"]]}


def vllm_line(drafter: dict) -> str:
    return usage(Path("OUT"), drafter)[0]


def num_speculative_tokens(drafter: dict) -> int:
    """What the export tells vLLM users to pass (`usage`)."""
    return json.loads(vllm_line(drafter).split("'")[1])["num_speculative_tokens"]


def serve(raw: dict, drafter: dict, target: Target, n_spec: int | None = None, **sglang_flags) -> dict:
    """engine -> the fields it reads differently from training ([] = it serves the drafter as trained), or
    "refused: why"."""
    hf, want = engine_view(raw), trained(drafter)
    n_spec = num_speculative_tokens(drafter) if n_spec is None else n_spec
    engines = {"vllm": lambda: vllm_resolve(hf, n_spec, target.layers),
               "sglang": lambda: sglang_resolve(hf, load_tokenizer(target.tokenizer), target, **sglang_flags)}
    out = {}
    for name, resolve in engines.items():
        try:
            got = resolve()
        except Refused as e:
            out[name] = f"refused: {e}"
            continue
        out[name] = [f for f in FIELDS if got[f] != want[f]]
    return out


AS_TRAINED = {"vllm": [], "sglang": []}


def outcome(served: dict) -> dict:
    """`serve`'s answer with each refusal's reason cut off."""
    return {k: v.split(":")[0] if isinstance(v, str) else v for k, v in served.items()}


# --- the tiny targets: a run resolved as make train resolves it, exported by export.export ----------------------


def exported_names(out: Path) -> list[str]:
    """The tensor names of an export's model.safetensors, in file order."""
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def export_random_run(root: Path, dc, target: Path) -> tuple[dict, dict]:
    """(config.json, drafter dict) of an export (in root/out) of a run holding one checkpoint of a random drafter."""
    torch.manual_seed(0)
    cfg = {"train": {"target": str(target), "cache": ""}, "drafter": dataclasses.asdict(dc)}
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg))
    save_checkpoint(run, 1, DFlashDrafter(dc), config=cfg, rng=False)
    out = export(run, root / "out")
    drafter = json.loads((out / "dflash_export.json").read_text())["drafter"]
    return json.loads((out / "config.json").read_text()), drafter


TINY_TRAIN = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
# DFlash2 as the Qwen3.8-27B recipe has it: every layer sliding, the whole block visible in each (is_causal false), the
# selector smaller to keep the test light
TINY_DFLASH2 = dict(variant="dflash2", full_attention_layers=0, block_attention="bidirectional", selector_rank=8,
                    selector_top_k=4)


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory, hidden_cache, qwen35_dir, qwen3_dir) -> dict:
    """arch -> (config.json, drafter, Target, cache layer ids, tensor names): Qwen3.5 with its cache's taps and a
    sliding window (like the 27B recipe), Qwen3 with the default taps and full attention (like the 8B recipe), and
    "dflash2": a DFlash2 drafter on the Qwen3.5 cache, every layer sliding (like the Qwen3.8-27B recipe); block 8, so
    that SGLang's fallback of 16 is told apart."""
    out = {}
    for arch, target, cache, window, kw in (("qwen3_5", qwen35_dir, hidden_cache, 8, {}),
                                            ("qwen3", qwen3_dir, None, 0, {}),
                                            ("dflash2", qwen35_dir, hidden_cache, 8, TINY_DFLASH2)):
        info = read_target_info(target)
        cfg = TrainConfig.of(cache=str(cache or "unused"), sliding_window=window, **TINY_TRAIN, **kw)
        if cache:
            facts = cache_defaults(cfg)
        else:
            facts = {"target": str(target), "layer_ids": default_layer_ids(info.num_layers, 3),
                     "mask_token_id": tiny.load_mask_token_id(target), "hidden_size": info.hidden_size,
                     "num_target_layers": info.num_layers}
        dc = drafter_config(cfg, facts)
        root = tmp_path_factory.mktemp(arch)
        config, drafter = export_random_run(root, dc, target)
        tgt = Target(info.num_layers, info.vocab_size, info.arch, str(target))
        out[arch] = (config, drafter, tgt, facts["layer_ids"], exported_names(root / "out"))
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_tiny_export_is_served_as_trained(tiny_exports, arch):
    config, drafter, target, cache_layers, _ = tiny_exports[arch]
    # the drafter is the project's recipe: every layer but the last sliding when a window is set; the cache's taps
    sliding = drafter["sliding_window"] is not None
    assert drafter["layer_types"] == [SLIDING] * sliding * 2 + [FULL] * (1 + 2 * (not sliding))
    assert drafter["target_layer_ids"] == cache_layers and drafter["block_size"] == 8
    assert serve(config, drafter, target) == AS_TRAINED
    # SGLang with the flag the export's usage line offers, and vLLM's runner
    assert serve(config, drafter, target, dflash_block_size=8)["sglang"] == []
    hf = engine_view(config)
    assert vllm_resolve(hf, num_speculative_tokens(drafter), target.layers)["v2_runner"] is sliding
    assert ("VLLM_USE_V2_MODEL_RUNNER=1" in vllm_line(drafter)) is sliding
    assert sglang_resolve(hf, load_tokenizer(target.tokenizer), target)["warnings"] == []


# Each rule meets a config (or a launch) that breaks it: (config edit, vLLM num_speculative_tokens or None = the
# usage line's, what each engine must report). "refused" = the engine refuses; a list = the fields it misreads.
def _drop(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _dflash(**kw):
    return lambda c: {**c, "dflash_config": {**c["dflash_config"], **kw}}


BROKEN = {
    # block size: SGLang reads dflash_config.block_size, then block_size, then 16; vLLM only its launch flag
    "no block_size": (lambda c: {**_drop(c, "block_size"), "dflash_config": _drop(c["dflash_config"], "block_size")},
                      None, {"vllm": [], "sglang": ["block_size"]}),
    "num_speculative_tokens = block_size": (lambda c: c, 8, {"vllm": ["block_size"], "sglang": []}),
    # layer types: transformers drops sliding_window without use_sliding_window; layer_types absent are derived
    # from max_window_layers (all full here); a window of another width
    "use_sliding_window false": (lambda c: {**c, "use_sliding_window": False}, None,
                                 {"vllm": "refused", "sglang": "refused"}),
    "no layer_types": (lambda c: _drop(c, "layer_types"), None, {"vllm": ["layers"], "sglang": ["layers"]}),
    "other window": (lambda c: {**c, "sliding_window": 16}, None, {"vllm": ["layers"], "sglang": ["layers"]}),
    "causal flag": (lambda c: {**c, "is_causal": True}, None, {"vllm": ["layers"], "sglang": ["layers"]}),
    "bidirectional flag on a block-causal drafter": (lambda c: {**c, "is_causal": False}, None,
                                                     {"vllm": ["layers"], "sglang": ["layers"]}),
    # target layers: ids written as hidden_states indices, a drafter trained on them in descending order, a tap of
    # the last layer, a num_target_layers that does not cover the ids
    "ids + 1": (lambda c: _dflash(target_layer_ids=[t + 1 for t in c["dflash_config"]["target_layer_ids"]])(c),
                None, {"vllm": ["taps"], "sglang": ["taps"]}),
    "trained on the ids in reverse order": (  # (the drafter too: its fc takes the states in that order)
        lambda c: _dflash(target_layer_ids=c["dflash_config"]["target_layer_ids"][::-1])(c), None,
        {"vllm": ["taps"], "sglang": ["taps"]}),
    "last layer tapped": (lambda c: _dflash(target_layer_ids=c["dflash_config"]["target_layer_ids"][:-1] + [7])(c),
                          None, {"vllm": ["taps"], "sglang": "refused"}),
    "num_target_layers too small": (lambda c: {**c, "num_target_layers": 5}, None, {"vllm": [], "sglang": "refused"}),
    # mask token: another id, or a string the tokenizer maps to another id
    "other mask id": (lambda c: _dflash(mask_token_id=c["dflash_config"]["mask_token_id"] - 1)(c), None, {"vllm": ["mask_token_id"], "sglang": "refused"}),
    "other mask string": (_dflash(mask_token="<|im_end|>"), None, {"vllm": [], "sglang": "refused"}),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_catches_a_broken_config(tiny_exports, case):
    config, drafter, target, *_ = tiny_exports["qwen3_5"]
    assert drafter["target_layer_ids"] == [1, 3, 5] and target.layers == 8  # what the edits above assume
    edit, n_spec, want = BROKEN[case]
    if case == "trained on the ids in reverse order":
        drafter = {**drafter, "target_layer_ids": drafter["target_layer_ids"][::-1]}
    got = serve(edit(json.loads(json.dumps(config))), drafter, target, n_spec)
    assert outcome(got) == want, got


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3", "dflash2"])
def test_every_exported_tensor_reaches_a_parameter_and_every_parameter_is_loaded(tiny_exports, arch):
    """Both engines' loaders consume every tensor of the export and load every parameter of the drafter they build;
    the DFlash2 export (all layers sliding, as the Qwen3.8-27B recipe) is also served as trained config-wise, on
    vLLM's V2 runner (the usage line says so)."""
    config, drafter, target, _, names = tiny_exports[arch]
    assert weights_served(config, names) == AS_TRAINED
    if arch == "dflash2":
        assert config["architectures"] == ["DFlash2DraftModel"] and drafter["layer_types"] == [SLIDING] * 3
        assert serve(config, drafter, target) == AS_TRAINED
        assert vllm_resolve(engine_view(config), num_speculative_tokens(drafter), target.layers)["v2_runner"]
        assert "VLLM_USE_V2_MODEL_RUNNER=1" in vllm_line(drafter)


def _rename(old: str, new: str):
    return lambda names: [n.replace(old, new) for n in names]


CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Each weight rule meets an export that breaks it: (tensor names edit, config.json edit, what each engine must
# report). vLLM refuses a tensor that reaches no parameter but leaves a parameter no tensor reaches as allocated;
# SGLang does neither — it skips the tensor: these cases show both silent outcomes are caught here.
BROKEN_WEIGHTS = {
    "codebooks named with .weight": (  # as z-lab's own from_pretrained remaps them (key_mapping), not as published
        lambda ns: [n + ".weight" if n in CODEBOOKS else n for n in ns], None,
        {"vllm": "refused", "sglang": [f"skipped {c}.weight" for c in CODEBOOKS] + list(CODEBOOKS)}),
    "an unknown tensor": (lambda ns: ns + ["layers.0.attention_conv.bias"], None,
                          {"vllm": "refused", "sglang": ["skipped layers.0.attention_conv.bias"]}),
    "a conv tensor missing": (lambda ns: [n for n in ns if n != "layers.1.mlp_conv.base_kernel"], None,
                              {"vllm": ["model.layers.1.mlp_conv.base_kernel"],
                               "sglang": ["layers.1.mlp_conv.base_kernel"]}),
    "a misnamed conv": (_rename("mlp_conv", "ffn_conv"), None, {"vllm": "refused", "sglang": "skips"}),
    "architecture DFlashDraftModel": (  # what export wrote before it knew DFlash2
        None, lambda c: {**c, "architectures": ["DFlashDraftModel"]}, {"vllm": "refused", "sglang": []}),
    "no DFlash2 settings": (None, lambda c: {**c, "dflash_config": _drop(c["dflash_config"], *DFLASH2_FIELDS)},
                            {"vllm": "refused", "sglang": "skips"}),
    "half the conv settings": (None, lambda c: {**c, "dflash_config": _drop(c["dflash_config"], "conv_group_size")},
                               {"vllm": "refused", "sglang": "refused"}),
}


@pytest.mark.parametrize("case", list(BROKEN_WEIGHTS))
def test_each_weight_rule_catches_a_broken_export(tiny_exports, case):
    config, _, _, _, names = tiny_exports["dflash2"]
    edit_names, edit_config, want = BROKEN_WEIGHTS[case]
    names2 = edit_names(list(names)) if edit_names else list(names)
    got = weights_served(edit_config(json.loads(json.dumps(config))) if edit_config else config, names2)
    for engine, w in want.items():
        if w == "refused":
            assert str(got[engine]).startswith("refused"), (engine, got)
        elif w == "skips":  # SGLang serves it, skipping the tensors of modules it did not build (or misnamed)
            assert isinstance(got[engine], list) and sum(x.startswith("skipped ") for x in got[engine]) >= 3, got
        else:
            assert got[engine] == w, (engine, got)


# --- the real recipes at the real shapes, with the released tokenizers ---------------------------------------------


REAL_TARGETS = {"qwen3.6": (QWEN36_27B["text_config"], "qwen3_5"), "qwen3.5": (QWEN36_27B["text_config"], "qwen3_5"),
                "qwen3.8": (QWEN36_27B["text_config"], "qwen3_5"), "qwen3": (QWEN3_8B, "qwen3")}


def real_export(recipe: str, tmp_path: Path, fixtures: Path, **overrides) -> tuple[dict, dict, Target]:
    target_cfg, _, _, tokenizer = RECIPES[recipe]
    tdir = target_dir(tmp_path / "target", target_cfg, fixtures / tokenizer / "tokenizer.json")
    text, arch = REAL_TARGETS[tokenizer]
    drafter = dataclasses.asdict(resolved_drafter(recipe, tdir, **overrides))
    target = Target(text["num_hidden_layers"], text["vocab_size"], arch, str(fixtures / tokenizer))
    return exported_config(recipe, tdir, **overrides), drafter, target


# every recipe as it trains, and the Qwen3.5/3.6-27B recipes' DFlash drafter (ARGS="--variant=dflash") as well
EXPORTS = list(RECIPES) + ["qwen3.5-27b variant=dflash", "qwen3.6-27b variant=dflash"]


@pytest.mark.parametrize("case", EXPORTS)
def test_recipe_export_is_served_as_trained(case, tmp_path, real_fixtures):
    recipe, _, setting = case.partition(" ")
    overrides = dict([setting.split("=")]) if setting else {}
    config, drafter, target = real_export(recipe, tmp_path, real_fixtures, **overrides)
    assert config["architectures"] == ["DFlashDraftModel" if overrides or recipe == "qwen3-8b" else
                                       "DFlash2DraftModel"], case
    assert serve(config, drafter, target) == AS_TRAINED
    with torch.device("meta"):  # the tensors export writes: the drafter's state dict, names as they are
        names = list(DFlashDrafter(DrafterConfig(**drafter)).state_dict())
    assert weights_served(config, names) == AS_TRAINED
    sliding, full = {"qwen3.6-27b": (4, 1), "qwen3.8-27b-dflash2": (5, 0)}.get(recipe, (0, 5))
    causal = recipe != "qwen3.8-27b-dflash2"  # the published DFlash2 drafter sees the whole block (is_causal false)
    assert trained(drafter)["layers"] == [(causal, 2047)] * sliding + [(False, None)] * full
    # the mask token without the id: SGLang finds the tokenizer's <|audio_start|> (248070); the bare default <|MASK|>
    # is not in the Qwen3.5/3.6 tokenizer, so it would be added at 248077, and in Qwen3's it lands at 151669
    no_id = {**config, "dflash_config": _drop(config["dflash_config"], "mask_token_id")}
    assert serve(no_id, drafter, target)["sglang"] == []
    assert serve(no_id, drafter, target)["vllm"].startswith("refused")
    bare = {**config, "dflash_config": _drop(config["dflash_config"], "mask_token_id", "mask_token")}
    assert serve(bare, drafter, target)["sglang"] == ([] if recipe == "qwen3-8b" else ["mask_token_id"])


def test_the_export_refuses_taps_no_engine_serves_as_trained(tmp_path, tiny_exports, qwen3_dir):
    """Both engines feed the target's states in ascending layer order, each once, and neither gives the drafter the
    last layer's normed output it was trained on (vLLM takes it before the final norm, SGLang cannot capture it):
    the export refuses such taps, at the real shapes and for a run, before writing anything."""
    from dflash_offline.export import target_fields

    config, drafter, target, *_ = tiny_exports["qwen3"]  # taps [1, 2, 3] of 6 layers
    for ids, engines in (([1, 3, 2], {"vllm": ["taps"], "sglang": ["taps"]}),
                         ([1, 2, 5], {"vllm": ["taps"], "sglang": "refused"})):
        bad = {**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": ids}}
        got = serve(bad, {**drafter, "target_layer_ids": ids}, target)
        assert outcome(got) == engines, got
    tdir = target_dir(tmp_path / "target", QWEN3_8B)
    dc, tgt = resolved_drafter("qwen3-8b", tdir), target_fields(str(tdir))
    zlab_config(dc, tgt, "bfloat16")
    for ids, why in (([1, 17, 9, 25, 33], "not ascending"), ([1, 9, 9, 25, 33], "not ascending"),
                     ([1, 9, 17, 25, 35], "last layer 35")):
        with pytest.raises(ExportError, match=why):
            zlab_config(dataclasses.replace(dc, target_layer_ids=ids), tgt, "bfloat16")
    info = read_target_info(qwen3_dir)
    dc = drafter_config(TrainConfig.of(cache="unused", **TINY_TRAIN), {
        "target": str(qwen3_dir), "layer_ids": [1, info.num_layers - 1], "mask_token_id": tiny.load_mask_token_id(
            qwen3_dir), "hidden_size": info.hidden_size, "num_target_layers": info.num_layers})
    with pytest.raises(ExportError, match="last layer"):
        export_random_run(tmp_path / "tiny", dc, qwen3_dir)
    assert not (tmp_path / "tiny" / "out").exists()
