"""The frozen target: load only the text stack up to the deepest tapped layer, and compute the tapped hidden states
of packed rows with every document seen alone.

Two paths give the same numbers (within the dtype's rounding):
- `per_doc`: each document runs alone through transformers' own decoder layers (right-padded to a power-of-two
  length and batched with others; the layers are causal, so the padding never reaches it). Exact by construction;
  the CPU path and the reference.
- `packed`: all rows are flattened into one sequence of T = B*S tokens cut into segments (every document, and each
  row's padding tail, is a segment). Full attention is causal within each segment (flash attention's varlen
  kernel; compiled flex_attention with a block mask where flash does not apply); Gated DeltaNet gets fla's varlen
  causal conv and chunked delta rule, both taking `cu_seqlens`, so conv and recurrent state restart at every
  segment. The projections, norms, gates and rotary are the layer's own modules and transformers' own functions,
  compiled on CUDA (`LayerPieces`); only the three sequence kernels are swapped (`PackedKernels`). CUDA only.

Tapped ids are 0-based layer outputs = transformers' `hidden_states[id + 1]`. As there, the output of the last
layer of the checkpoint (id N-1) is taken after the final norm; every other tap is the raw residual stream.

Longer than the other modules because both paths, and the kernels that must agree between them, live here.

Shape legend: B rows, S tokens per row, T flattened tokens, L document length, n documents, H hidden size,
K tapped layers, N heads, D head dim, C conv channels, W conv width.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

# config.json model_type -> (arch kind, where the text stack's tensors live in the checkpoint, most likely first)
SUPPORTED = {
    "qwen3_5": ("qwen3_5", ("model.language_model.", "model.")),  # Qwen3.5 / 3.6 vision-language wrapper
    "qwen3_5_text": ("qwen3_5", ("model.", "model.language_model.")),  # text-only Qwen3.5 (Qwen3_5ForCausalLM)
    "qwen3": ("qwen3", ("model.",)),  # dense Qwen3 (Qwen3ForCausalLM)
}
MODES = ("auto", "packed", "per_doc")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped layers: [N//2] for one draft layer, else n ids spread evenly over 1..N-3."""
    n, N = num_draft_layers, num_target_layers
    if n < 1 or N < 4:
        raise ValueError(f"need num_draft_layers >= 1 and num_target_layers >= 4, got n={n}, N={N}")
    if n == 1:
        return [N // 2]
    return [round(1 + i * (N - 4) / (n - 1)) for i in range(n)]


# --------------------------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class TargetInfo:
    path: str  # checkpoint directory
    arch: str  # "qwen3_5" (Gated DeltaNet + gated full attention, hybrid) or "qwen3" (dense)
    model_type: str  # config.json's model_type
    architectures: tuple[str, ...]  # config.json's architectures
    num_layers: int  # text decoder layers N
    hidden_size: int  # H
    vocab_size: int  # embedding rows
    layer_types: tuple[str, ...]  # per layer: "linear_attention" / "full_attention" (/ "sliding_attention")
    rope_theta: float  # rotary base
    dtype: str | None  # dtype the checkpoint declares, e.g. "bfloat16"
    eos_token_id: int | list[int] | None  # from the text config, else the top level
    pad_token_id: int | None  # likewise
    intermediate_size: int = 0  # MLP width (the drafter's default)
    rms_norm_eps: float = 1e-6  # norm epsilon (the drafter uses the target's)


def _read_config(path: str | Path):
    """(raw config.json dict, transformers text config) of a local checkpoint; reads no weights."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} does not exist: the target must be a local Hugging Face checkpoint "
                                f"directory holding config.json and *.safetensors")
    raw = json.loads(cfg_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{cfg_file}: unsupported target model_type={model_type!r} "
                         f"(architectures={raw.get('architectures')}); supported model_types: {sorted(SUPPORTED)} "
                         f"(Qwen3.5/3.6 checkpoints, text-only Qwen3.5, dense Qwen3)")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return raw, config.get_text_config()


def _info(path: str | Path, raw: dict, text) -> TargetInfo:
    raw_text = raw.get("text_config") or {}

    def pick(name):
        value = getattr(text, name, None)
        return value if value is not None else raw_text.get(name, raw.get(name))

    dtype = getattr(text, "dtype", None) or raw_text.get("dtype") or raw.get("dtype") or raw.get("torch_dtype")
    return TargetInfo(
        path=str(path), arch=SUPPORTED[raw["model_type"]][0], model_type=raw["model_type"],
        architectures=tuple(raw.get("architectures") or ()), num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size, vocab_size=text.vocab_size, layer_types=tuple(text.layer_types),
        rope_theta=float(text.rope_parameters["rope_theta"]),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        eos_token_id=pick("eos_token_id"), pad_token_id=pick("pad_token_id"),
        intermediate_size=int(text.intermediate_size), rms_norm_eps=float(text.rms_norm_eps),
    )


def read_target_info(path: str | Path) -> TargetInfo:
    """What the rest of the pipeline needs to know about a target, from its config.json alone (no weights)."""
    raw, text = _read_config(path)
    return _info(path, raw, text)


# --------------------------------------------------------------------------------------------------------------
# model: transformers' own decoder layers, truncated after the deepest tapped layer


def _hf(arch: str):
    """transformers' classes and rotary function for `arch`."""
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding, m.apply_rotary_pos_emb
    from transformers.models.qwen3 import modeling_qwen3 as m

    return m.Qwen3DecoderLayer, m.Qwen3RMSNorm, m.Qwen3RotaryEmbedding, m.apply_rotary_pos_emb


class TextStack(nn.Module):
    """The text model's embedding and first `depth` decoder layers (+ the final norm when the last layer of the
    checkpoint is tapped). Parameter names equal the checkpoint's text-model names, minus the prefix."""

    def __init__(self, config, arch: str, depth: int, with_norm: bool):
        super().__init__()
        layer_cls, norm_cls, _, _ = _hf(arch)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([layer_cls(config, i) for i in range(depth)])
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps) if with_norm else None


def _weight_files(path: Path) -> dict[str, Path]:
    from dflash_offline.targetid import weight_map

    return weight_map(path)


def _load_tensors(path: Path, model_type: str, names, device, dtype) -> dict[str, torch.Tensor]:
    """Read exactly the tensors `names` (text-model names) from the checkpoint, cast to `dtype` on `device`."""
    files = _weight_files(path)
    prefixes = SUPPORTED[model_type][1]
    prefix = next((p for p in prefixes if f"{p}embed_tokens.weight" in files), None)
    if prefix is None:
        raise ValueError(f"{path}: no '<prefix>embed_tokens.weight' tensor for any prefix in {prefixes}; "
                         f"first tensor names: {sorted(files)[:5]}. Is this a {model_type} checkpoint?")
    wanted = {prefix + n: n for n in names}
    missing = sorted(k for k in wanted if k not in files)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the target needs, e.g. {missing[:5]}; "
                         f"the files are incomplete or not a {model_type} checkpoint")
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in keys:
                tensors[wanted[key]] = f.get_tensor(key).to(device=device, dtype=dtype)
    return tensors


# transformers' Gated DeltaNet functions that it binds to a kernel package's (fla, causal_conv1d) where one imports
KERNEL_BOUND = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")


def route_gated_deltanet_by_device(module) -> None:
    """transformers binds Qwen3.5's Gated DeltaNet functions once, when it imports `module` (modeling_qwen3_5): to
    fla's Triton kernels wherever fla imports — also on a machine whose Triton finds no GPU, and for a model on the
    CPU beside one on a GPU; a CPU forward then fails in Triton ("0 active drivers"). Here each bound function is
    replaced by one that chooses per call by the device of its first tensor: the CPU → transformers' pure-torch
    function (its `__wrapped__`, which `torch_gated_deltanet_kernels` and the per-segment references also take), a
    GPU → the kernel transformers bound (the GPU path as it was). A function transformers left on its torch path is
    left as it is. Idempotent; importing `dflash_offline` has it run when transformers imports the module."""
    for name in KERNEL_BOUND:
        bound = getattr(module, name, None)
        torch_fn = getattr(bound, "__wrapped__", None)
        if torch_fn is None or getattr(bound, "routed_by_device", False) or not _binds_a_kernel(bound, torch_fn):
            continue

        def routed(*args, _kernel=bound, _torch=torch_fn, _params=_keyword_filter(torch_fn), **kwargs):
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is None or first.device.type != "cpu":
                return _kernel(*args, **kwargs)
            # (transformers' wrapper passes the torch function only the keywords it takes: so does this)
            return _torch(*args, **(kwargs if _params is None else {k: v for k, v in kwargs.items() if k in _params}))

        functools.update_wrapper(routed, torch_fn)  # __wrapped__: the torch function
        routed.routed_by_device = True
        setattr(module, name, routed)


def _keyword_filter(fn) -> frozenset | None:
    """The parameter names `fn` takes, or None where it takes any keyword (**kwargs)."""
    import inspect

    params = inspect.signature(fn).parameters
    return None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else frozenset(params)


def _binds_a_kernel(fn, torch_fn) -> bool:
    """Whether transformers' wrapper `fn` calls another implementation than `torch_fn` (its
    `use_kernel_func_from_hub_with_fallback` keeps the choice in its closure as `implementation`); True where that
    cannot be read (routing is then harmless: CPU tensors take the torch function, as they would)."""
    code = getattr(fn, "__code__", None)
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True)) if code else {}
    return "implementation" not in cells or cells["implementation"].cell_contents is not torch_fn


@contextmanager
def torch_gated_deltanet_kernels():
    """transformers' pure-torch Gated DeltaNet functions for the duration, also for CUDA tensors (CPU tensors take
    them anyway: `route_gated_deltanet_by_device`)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    saved = {name: getattr(m, name) for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    try:
        for name, fn in saved.items():
            setattr(m, name, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(m, name, fn)


@functools.cache
def _fla():
    """fla's (chunk_gated_delta_rule, causal_conv1d), or None where fla or Triton cannot be imported."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # ImportError, or Triton failing to initialise on a machine without a GPU
        return None
    return chunk_gated_delta_rule, causal_conv1d


def _resolve_mode(mode: str, device: torch.device, arch: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    packable = device.type == "cuda" and (arch == "qwen3" or _fla() is not None)
    if mode == "packed" and not packable:
        raise ValueError(f"mode='packed' needs a CUDA device and, for {arch}, fla (flash-linear-attention with "
                         f"Triton) importable; got device={device}, fla importable={_fla() is not None}. "
                         f"Use mode='per_doc' (or 'auto').")
    if mode == "auto":
        mode = "packed" if packable else "per_doc"
    if device.type == "cuda" and arch == "qwen3_5" and _fla() is None:
        log.warning("fla is not importable: every document runs alone and transformers' Gated DeltaNet falls back "
                    "to its pure-torch reference, which is more than 10x slower. Install flash-linear-attention.")
    return mode


def load_target(path: str | Path, layer_ids: list[int], device: str | torch.device,
                dtype: torch.dtype = torch.bfloat16, mode: str = "auto") -> Target:
    """Build the text stack up to max(layer_ids) and load only its tensors (no lm_head, no vision tower, no
    deeper layers). `mode`: "packed" (CUDA, one varlen forward), "per_doc" (documents one by one), or "auto"
    (packed where possible)."""
    path, device = Path(path), torch.device(device)
    raw, text = _read_config(path)
    info = _info(path, raw, text)
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids or len(set(layer_ids)) != len(layer_ids) or not all(0 <= i < info.num_layers for i in layer_ids):
        raise ValueError(f"layer_ids must be distinct ids in [0, {info.num_layers}), got {layer_ids}")
    depth = max(layer_ids) + 1
    odd = sorted({t for t in info.layer_types[:depth]} - {"full_attention", "linear_attention"})
    if odd:
        raise ValueError(f"{path}: layer types {odd} are not supported (only full and linear attention)")
    mode = _resolve_mode(mode, device, info.arch)

    config = copy.deepcopy(text)
    config._attn_implementation = "sdpa"  # per_doc path: causal SDPA when no mask is given
    with torch.device("meta"):
        stack = TextStack(config, info.arch, depth, with_norm=info.num_layers - 1 in layer_ids)
    tensors = _load_tensors(path, info.model_type, stack.state_dict().keys(), device, dtype)
    stack.load_state_dict(tensors, strict=True, assign=True)
    del tensors  # the stack holds them now; fusing its projections must be able to free the separate copies
    stack.requires_grad_(False).eval()
    rotary = _hf(info.arch)[2](config).to(device)  # inv_freq computed in fp32 as transformers does
    return Target(info, layer_ids, stack, rotary, device, dtype, mode)


# --------------------------------------------------------------------------------------------------------------
# rows -> segments


@dataclass(frozen=True)
class Span:
    row: int  # row index in the batch
    start: int  # first token in the row
    end: int  # one past the last token
    pad: bool  # the row's padding tail (doc id -1)


def row_spans(doc_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> list[Span]:
    """Cut rows into documents and padding tails; check that positions restart at 0 at every document."""
    if doc_ids_BS.ndim != 2 or doc_ids_BS.shape != position_ids_BS.shape:
        raise ValueError(f"doc_ids and position_ids must both be [B, S], got {tuple(doc_ids_BS.shape)} and "
                         f"{tuple(position_ids_BS.shape)}")
    doc, pos = doc_ids_BS.cpu(), position_ids_BS.cpu()
    B, S = doc.shape
    spans = []
    for b in range(B):
        change = torch.ones(S, dtype=torch.bool)
        change[1:] = doc[b, 1:] != doc[b, :-1]
        starts = change.nonzero().flatten().tolist()
        for s, e in zip(starts, starts[1:] + [S], strict=True):
            pad = bool(doc[b, s] < 0)
            if pad and e != S:
                raise ValueError(f"row {b}: padding (doc id -1) at tokens {s}..{e - 1} is followed by a document; "
                                 f"padding must be the row's tail")
            if not pad and not bool((pos[b, s:e] == torch.arange(e - s)).all()):
                raise ValueError(f"row {b}: document {int(doc[b, s])} at tokens {s}..{e - 1} has positions "
                                 f"{pos[b, s:min(e, s + 8)].tolist()}...; each document must count 0, 1, 2, ...")
            spans.append(Span(b, s, e, pad))
    return spans


@dataclass
class Segments:
    """The flattened batch: T tokens cut into contiguous segments (documents and padding tails)."""

    bounds: list[tuple[int, int]]  # (start, end) of each segment in the flattened sequence
    cu_seqlens: torch.Tensor  # [n+1] int64 on the device
    cu_seqlens_cpu: torch.Tensor  # same, on the CPU
    cu_seqlens_i32: torch.Tensor  # [n+1] int32 on the device (flash attention's varlen API)
    max_len: int  # longest segment
    seg_T: torch.Tensor  # [T] int32 segment index of each token, on the device
    pos_1T: torch.Tensor  # [1, T] int64 position of each token inside its segment
    cache: dict = field(default_factory=dict)  # per-batch kernel state (e.g. the flex block mask)

    @classmethod
    def build(cls, spans: list[Span], S: int, device) -> Segments:
        bounds = [(sp.row * S + sp.start, sp.row * S + sp.end) for sp in spans]
        lengths = torch.tensor([e - s for s, e in bounds])
        cu = torch.zeros(len(bounds) + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        seg_T = torch.repeat_interleave(torch.arange(len(bounds), dtype=torch.int32), lengths)
        pos_T = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lengths)
        return cls(bounds, _to(cu, device), cu, _to(cu.int(), device), int(lengths.max()), _to(seg_T, device),
                   _to(pos_T[None], device))


def _to(x: torch.Tensor, device) -> torch.Tensor:
    """Host → device without a stream synchronization (pinned + non-blocking), so the host can prepare the next
    batch while the device still runs the previous one."""
    device = torch.device(device)
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


# --------------------------------------------------------------------------------------------------------------
# sequence kernels of the packed path


@dataclass(frozen=True)
class PackedKernels:
    """The three operations that mix tokens; every one keeps segments apart."""

    attention: Callable  # (q_1TND, k_1TMD, v_1TMD, seg, scale) -> o_1TND, causal within each segment (GQA: M | N)
    conv: Callable | None  # (x_1TC, weight_CW, bias, activation, seg) -> y_1TC, causal depthwise conv per segment
    # (q_1TMK, k_1TMK, v_1TNV, g_1TN, beta_1TN, seg) -> o_1TNV, state reset per segment; value head n reads
    # query/key head n // (N/M) (transformers' repeat_interleave)
    delta_rule: Callable | None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_kernel(q, k, v, seg: Segments, scale: float):
    """Block-diagonal causal attention with flex_attention: mask and attention compiled on CUDA (uncompiled they
    materialise T x T scores), eager elsewhere (tests on tiny inputs)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # flex takes [1, N, T, D]
    if "block_mask" not in seg.cache:
        seg_T, T = seg.seg_T, q.shape[2]

        def same_segment_causal(b, h, q_idx, kv_idx):
            return (seg_T[q_idx] == seg_T[kv_idx]) & (q_idx >= kv_idx)

        seg.cache["block_mask"] = create_block_mask(same_segment_causal, None, None, T, T, device=q.device,
                                                    _compile=q.is_cuda)
    flex = _compiled_flex() if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=seg.cache["block_mask"], scale=scale, enable_gqa=True).transpose(1, 2)


def flash_varlen_attention(q, k, v, seg: Segments, scale: float):
    """Block-diagonal causal attention with the flash-attention kernel PyTorch ships, in its variable-length form
    (the segments' cumulative lengths; GQA native). No mask to build, nothing to compile, no work outside the
    segments. CUDA, fp16/bf16, head_dim <= 256."""
    out = torch.ops.aten._flash_attention_forward(q[0], k[0], v[0], seg.cu_seqlens_i32, seg.cu_seqlens_i32,
                                                  seg.max_len, seg.max_len, 0.0, True, False, scale=scale)
    return out[0][None]


def flash_varlen_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256 or head_dim % 8:
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device)[0] >= 8


def sdpa_per_segment(q, k, v, seg: Segments, scale: float):
    """Reference attention: causal SDPA on each segment alone."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    o = torch.empty_like(q)
    for s, e in seg.bounds:
        o[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                      scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def conv_per_segment(x, weight, bias, activation, seg: Segments):
    """Reference conv: transformers' torch causal conv on each segment alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    conv = getattr(causal_conv1d_fn, "__wrapped__", causal_conv1d_fn)  # the torch function, not a hub kernel
    return torch.cat([conv(x[:, s:e].transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
                      for s, e in seg.bounds], dim=1)


def delta_rule_per_segment(q, k, v, g, beta, seg: Segments):
    """Reference delta rule: transformers' torch chunked gated delta rule on each segment alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    rule = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    return torch.cat([rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                           use_qk_l2norm_in_kernel=True)[0] for s, e in seg.bounds], dim=1)


def fla_conv(x, weight, bias, activation, seg: Segments):
    y, _ = _fla()[1](x=x, weight=weight, bias=bias, activation=activation, cu_seqlens=seg.cu_seqlens,
                     cu_seqlens_cpu=seg.cu_seqlens_cpu)
    return y


def fla_delta_rule(q, k, v, g, beta, seg: Segments):
    """fla's chunked gated delta rule, varlen; more value heads than key heads natively (no repeated q/k)."""
    o, _ = _fla()[0](q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=seg.cu_seqlens,
                     cu_seqlens_cpu=seg.cu_seqlens_cpu)
    return o


# Every kernel per segment in plain torch: slow, but runs the packed code path anywhere (CPU tests).
REFERENCE_KERNELS = PackedKernels(sdpa_per_segment, conv_per_segment, delta_rule_per_segment)
# The GPU path: flash attention's varlen kernel where it applies, else compiled flex attention.
GPU_KERNELS = PackedKernels(flash_varlen_attention, fla_conv, fla_delta_rule)
GPU_FLEX_KERNELS = PackedKernels(flex_attention_kernel, fla_conv, fla_delta_rule)


# Each packed layer is: `*_in` (input norm, projections, rotary, gates) → the sequence kernels → `*_out` (output
# gate/norm, output projection, residual, post-norm, MLP, residual). The in/out pieces are transformers' own
# modules and functions; on CUDA they run under torch.compile (one graph per piece, shared by all layers of a type:
# the layer is an argument, not a constant), which fuses the norms, gates and activations between the GEMMs.


def fuse_projections(stack: nn.Module) -> None:
    """Concatenate each layer's parallel input projections into one weight, so the packed path runs one GEMM where
    transformers runs several: Gated DeltaNet's qkv/z/b/a, attention's q/k/v, the MLP's gate/up. The original
    modules keep their weights as row views of the fused one (no copy, no extra memory; transformers' own forward,
    used by the per-document path, is unchanged). Frozen weights only."""
    for layer in stack.layers:
        gdn = getattr(layer, "linear_attn", None)
        groups = [(layer.mlp, ("gate_proj", "up_proj"))]
        if gdn is not None:
            groups.append((gdn, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")))
        else:
            groups.append((layer.self_attn, ("q_proj", "k_proj", "v_proj")))
        for owner, names in groups:
            if getattr(owner, "fused_in", None) is not None:
                continue
            mods = [getattr(owner, n) for n in names]
            biased = [m.bias is not None for m in mods]
            if any(biased) and not all(biased):
                continue  # mixed bias: leave as is (no supported checkpoint has it)
            w = torch.cat([m.weight for m in mods])
            b = torch.cat([m.bias for m in mods]) if all(biased) else None
            at, sizes = 0, []
            for m in mods:
                n = m.weight.shape[0]
                m.weight = nn.Parameter(w[at:at + n], requires_grad=False)
                if b is not None:
                    m.bias = nn.Parameter(b[at:at + n], requires_grad=False)
                at, sizes = at + n, [*sizes, n]
            # buffers (not persistent: state_dict() stays the checkpoint's names) so that they follow .to(); the
            # modules' weights are views of them only until something replaces those weights (the stack is frozen)
            owner.register_buffer("fused_in", w, persistent=False)
            owner.register_buffer("fused_in_bias", b, persistent=False)
            owner.fused_in_sizes = tuple(sizes)
    if any(p.is_cuda for p in stack.parameters()):
        torch.cuda.empty_cache()  # the separate weights were copied: give their blocks back to the device


def _projections(owner: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The outputs of `owner`'s projections `names` on x: one GEMM split in views when `fuse_projections` ran."""
    w = getattr(owner, "fused_in", None)
    if w is None:
        return [getattr(owner, n)(x) for n in names]
    return list(F.linear(x, w, owner.fused_in_bias).split(owner.fused_in_sizes, dim=-1))


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = _projections(mlp, x, ("gate_proj", "up_proj"))
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _attention_in(layer, h_1TH, cos, sin, rope, gated: bool):
    """Qwen3Attention / Qwen3_5Attention up to the attention kernel: (q_1TND, k_1TMD, v_1TMD, gate_1TX or None)."""
    attn, T = layer.self_attn, h_1TH.shape[1]
    D = attn.head_dim
    x_1TH = layer.input_layernorm(h_1TH)
    q, k, v = _projections(attn, x_1TH, ("q_proj", "k_proj", "v_proj"))
    gate = None
    if gated:  # Qwen3.5: q_proj yields [query | gate] per head
        q, gate = torch.chunk(q.view(1, T, -1, 2 * D), 2, dim=-1)
        gate = gate.reshape(1, T, -1)
    q_1TND = attn.q_norm(q.reshape(1, T, -1, D))
    k_1TMD = attn.k_norm(k.view(1, T, -1, D))
    v_1TMD = v.view(1, T, -1, D)
    q_1TND, k_1TMD = rope(q_1TND, k_1TMD, cos, sin, unsqueeze_dim=2)
    return q_1TND, k_1TMD, v_1TMD, gate


def _attention_out(layer, h_1TH, o_1TND, gate):
    T = h_1TH.shape[1]
    o = o_1TND.reshape(1, T, -1)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    h_1TH = h_1TH + layer.self_attn.o_proj(o)
    return h_1TH + _mlp(layer.mlp, layer.post_attention_layernorm(h_1TH))


def _deltanet_in(layer, h_1TH):
    """Qwen3_5GatedDeltaNet up to the conv: (qkv_1TC before the conv, g_1TN, beta_1TN, z_1TNV)."""
    gdn, T = layer.linear_attn, h_1TH.shape[1]
    x_1TH = layer.input_layernorm(h_1TH)
    qkv, z, b, a = _projections(gdn, x_1TH, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    beta = b.sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
    return qkv, g, beta, z.view(1, T, -1, gdn.head_v_dim)


def _deltanet_out(layer, h_1TH, o_1TNV, z_1TNV):
    gdn, T = layer.linear_attn, h_1TH.shape[1]
    o = gdn.norm(o_1TNV.reshape(-1, gdn.head_v_dim), z_1TNV.reshape(-1, gdn.head_v_dim)).reshape(1, T, -1)
    h_1TH = h_1TH + gdn.out_proj(o)
    return h_1TH + _mlp(layer.mlp, layer.post_attention_layernorm(h_1TH))


@dataclass(frozen=True)
class LayerPieces:
    attention_in: Callable
    attention_out: Callable
    deltanet_in: Callable
    deltanet_out: Callable


EAGER_PIECES = LayerPieces(_attention_in, _attention_out, _deltanet_in, _deltanet_out)


@functools.cache
def compiled_pieces() -> LayerPieces:
    return LayerPieces(*(torch.compile(f, dynamic=False) for f in (_attention_in, _attention_out, _deltanet_in,
                                                                  _deltanet_out)))


def _packed_layer(layer, h_1TH, seg: Segments, kernels: PackedKernels, pieces: LayerPieces, cos_sin, rope,
                  gated: bool):
    """One decoder layer over the flattened batch, every segment alone."""
    if getattr(layer, "linear_attn", None) is None:
        q, k, v, gate = pieces.attention_in(layer, h_1TH, *cos_sin, rope, gated)
        o = kernels.attention(q, k, v, seg, layer.self_attn.scaling)
        return pieces.attention_out(layer, h_1TH, o, gate)
    gdn, T = layer.linear_attn, h_1TH.shape[1]
    qkv_1TC, g, beta, z = pieces.deltanet_in(layer, h_1TH)
    qkv_1TC = kernels.conv(qkv_1TC, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation, seg)
    q, k, v = torch.split(qkv_1TC, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    o = kernels.delta_rule(q.view(1, T, -1, gdn.head_k_dim), k.view(1, T, -1, gdn.head_k_dim),
                           v.view(1, T, -1, gdn.head_v_dim), g, beta, seg)
    return pieces.deltanet_out(layer, h_1TH, o, z)


# --------------------------------------------------------------------------------------------------------------
# the target


class Target:
    """A loaded, frozen, truncated target. `tapped_hidden_states` is the only thing extraction calls."""

    def __init__(self, info: TargetInfo, layer_ids: list[int], stack: TextStack, rotary: nn.Module,
                 device: torch.device, dtype: torch.dtype, mode: str):
        self.info, self.layer_ids, self.stack, self.rotary = info, list(layer_ids), stack, rotary
        self.device, self.dtype, self.mode = device, dtype, mode
        self._rope = _hf(info.arch)[3]
        fuse_projections(stack)  # one GEMM per group of parallel projections on the packed path
        # packed-path choices (tests and benchmarks may swap them): flash varlen attention where it applies, else
        # compiled flex; the pieces around the kernels compiled on CUDA
        head_dim = max([la.self_attn.head_dim for la in stack.layers if hasattr(la, "self_attn")], default=0)
        self.kernels = GPU_KERNELS if flash_varlen_usable(device, dtype, head_dim) else GPU_FLEX_KERNELS
        self.pieces = compiled_pieces() if device.type == "cuda" else EAGER_PIECES

    @property
    def out_dim(self) -> int:
        return len(self.layer_ids) * self.info.hidden_size

    def tapped_layers(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor,
                      doc_ids_BS: torch.Tensor) -> list[torch.Tensor]:
        """K tensors [B, S, H] (contiguous, in `layer_ids` order): what `tapped_hidden_states` concatenates."""
        if self.mode == "packed":
            return self.packed_layers(input_ids_BS, position_ids_BS, doc_ids_BS, self.kernels, self.pieces)
        return [t.contiguous() for t in self.tapped_hidden_states(input_ids_BS, position_ids_BS, doc_ids_BS).chunk(
            len(self.layer_ids), dim=-1)]

    def tapped_hidden_states(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor,
                             doc_ids_BS: torch.Tensor) -> torch.Tensor:
        """[B, S, K*H] in the target dtype: the tapped layers' outputs (in `layer_ids` order) of every token,
        each document computed alone; padding positions are zero."""
        if self.mode == "packed":
            return self.packed_hidden_states(input_ids_BS, position_ids_BS, doc_ids_BS, self.kernels, self.pieces)
        spans = row_spans(doc_ids_BS, position_ids_BS)
        ids_BS = input_ids_BS.to(self.device)
        B, S = ids_BS.shape
        # Documents are right-padded to a power-of-two length and batched: every layer is causal, so what follows
        # a document never reaches it, and few distinct shapes keep kernel autotuning / SDPA dispatch cheap.
        by_length: dict[int, list[Span]] = {}
        for sp in spans:
            if not sp.pad:
                by_length.setdefault(max(16, 1 << (sp.end - sp.start - 1).bit_length()), []).append(sp)
        with torch.inference_mode():
            out = torch.zeros(B, S, self.out_dim, device=self.device, dtype=self.dtype)
            for P, group in by_length.items():
                ids_nP = torch.zeros(len(group), P, dtype=ids_BS.dtype, device=self.device)
                for j, sp in enumerate(group):
                    ids_nP[j, :sp.end - sp.start] = ids_BS[sp.row, sp.start:sp.end]
                taps_nPX = self._documents(ids_nP)
                for j, sp in enumerate(group):
                    out[sp.row, sp.start:sp.end] = taps_nPX[j, :sp.end - sp.start]
        return out

    def _documents(self, ids_nL: torch.Tensor) -> torch.Tensor:
        """[n, L, K*H] for n documents of length L, each alone: transformers' decoder layers as they are."""
        n, L = ids_nL.shape
        h = self.stack.embed_tokens(ids_nL)
        cos_sin = self._cos_sin(h, torch.arange(L, device=self.device).expand(n, L))
        taps = {}
        for i, layer in enumerate(self.stack.layers):
            h = layer(h, attention_mask=None, position_embeddings=cos_sin)  # no mask: causal SDPA / no padding
            if i in self.layer_ids:
                taps[i] = h
        return self._concat(taps)

    def packed_hidden_states(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor,
                             doc_ids_BS: torch.Tensor, kernels: PackedKernels,
                             pieces: LayerPieces = EAGER_PIECES) -> torch.Tensor:
        """The packed path with the given kernels (`self.kernels` on CUDA; `REFERENCE_KERNELS` checks it on the
        CPU). Rows given on the CPU cost no device synchronization (the segments are cut on the host)."""
        return torch.cat(self.packed_layers(input_ids_BS, position_ids_BS, doc_ids_BS, kernels, pieces), dim=-1)

    def packed_layers(self, input_ids_BS, position_ids_BS, doc_ids_BS, kernels: PackedKernels,
                      pieces: LayerPieces = EAGER_PIECES) -> list[torch.Tensor]:
        spans = row_spans(doc_ids_BS, position_ids_BS)
        B, S = input_ids_BS.shape
        seg = Segments.build(spans, S, self.device)
        pad_BS = _to(doc_ids_BS < 0, self.device)
        gated = self.info.arch == "qwen3_5"
        with torch.inference_mode():
            ids_1T = _to(input_ids_BS, self.device).masked_fill(pad_BS, 0).reshape(1, B * S)
            h = self.stack.embed_tokens(ids_1T)
            cos_sin = self._cos_sin(h, seg.pos_1T)
            taps = {}
            for i, layer in enumerate(self.stack.layers):
                h = _packed_layer(layer, h, seg, kernels, pieces, cos_sin, self._rope, gated)
                if i in self.layer_ids:
                    taps[i] = h
            # each tap is a fresh tensor (the residual stream is never updated in place): zero its padding in place
            return [self._final(taps[i], i).view(B, S, -1).masked_fill_(pad_BS[..., None], 0)
                    for i in self.layer_ids]

    def _cos_sin(self, h, pos):
        if self.info.arch == "qwen3_5":  # M-RoPE: for text, the three position streams are equal
            pos = pos[None].expand(3, -1, -1)
        return self.rotary(h, pos)

    def _final(self, h: torch.Tensor, i: int) -> torch.Tensor:
        return self.stack.norm(h) if i == self.info.num_layers - 1 else h

    def _concat(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([self._final(taps[i], i) for i in self.layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------------------------
# probe: check the kernels and time a batch on random weights of the real widths, before any weight loads


def random_target(info: TargetInfo, depth: int, layer_ids: list[int], device, dtype: torch.dtype,
                  mode: str = "auto") -> Target:
    """The target's first `depth` layers with its real shapes and random weights (probes and benchmarks)."""
    device = torch.device(device)
    mode = _resolve_mode(mode, device, info.arch)
    _, text = _read_config(info.path)
    config = copy.deepcopy(text)
    config.num_hidden_layers, config.layer_types = depth, list(text.layer_types[:depth])
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` directly: no full-precision copy left in the allocator
    try:
        with torch.device(device):
            stack = TextStack(config, info.arch, depth, with_norm=info.num_layers - 1 in layer_ids)
    finally:
        torch.set_default_dtype(default)
    stack.to(dtype).requires_grad_(False).eval()
    rotary = _hf(info.arch)[2](config).to(device)
    return Target(info, layer_ids, stack, rotary, device, dtype, mode)


def probe(info: TargetInfo, layer_ids: list[int], device, dtype: torch.dtype, seq_len: int, batch_rows: int,
          mode: str = "auto", seed: int = 0) -> dict:
    """Build the first few layers of the target's real shapes with random weights (one of each layer type), check
    the chosen mode against per-document on a small packed row, and time one full-shape batch. Loads no weights.

    Returns {"mode", "max_rel_err", "seconds_per_row" (scaled to the real depth), "probe_layers"}.
    """
    import time

    device = torch.device(device)
    depth = max(layer_ids) + 1
    n = min(depth, 4 if info.arch == "qwen3_5" else 2)  # Qwen3.5: 3 Gated DeltaNet + 1 full attention
    torch.manual_seed(seed)
    model = random_target(info, n, [n - 1], device, dtype, mode)
    mode = model.mode
    gen = torch.Generator().manual_seed(seed)
    small = synthetic_rows(1, 128, [40, 1, 57], info.vocab_size, gen)  # three documents and a padding tail
    got = model.tapped_hidden_states(*small).float()
    ref = got if mode == "per_doc" else Target(info, [n - 1], model.stack, model.rotary, device, dtype,
                                               "per_doc").tapped_hidden_states(*small).float()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err < (0.05 if dtype != torch.float32 else 1e-4):
        raise RuntimeError(f"kernel check failed: {mode} differs from per-document by {err:.3g} on random "
                           f"weights; use mode=per_doc and report this")
    full = synthetic_rows(batch_rows, seq_len, [seq_len // 3, seq_len // 4, seq_len // 5], info.vocab_size, gen)
    model.tapped_hidden_states(*full)  # warm-up: autotuning and compilation stay out of the estimate
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    model.tapped_hidden_states(*full)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    secs = (time.perf_counter() - t0) / batch_rows * depth / n
    del model
    return {"mode": mode, "max_rel_err": err, "seconds_per_row": secs, "probe_layers": n}


def synthetic_rows(B: int, S: int, lengths: list[int], vocab: int, gen: torch.Generator):
    """(input_ids, position_ids, doc_ids) [B, S]: documents of the given lengths packed from the left, padded tail."""
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    pos, doc = torch.zeros(B, S, dtype=torch.long), torch.full((B, S), -1, dtype=torch.long)
    for b in range(B):
        at = 0
        for d, length in enumerate(lengths):
            length = min(length, S - at)
            if length <= 0:
                break
            pos[b, at:at + length], doc[b, at:at + length] = torch.arange(length), d
            at += length
    return ids, pos, doc
