"""The DFlash drafter (z-lab `DFlashDraftModel`, Qwen3 decoder layers with KV injection) for training.

    ctx      = hidden_norm(fc(concat of tapped target states))            [B, S, H]
    block    = target_embed([token at anchor, MASK x (L-1)]) per anchor    [B, Q, H]
    layer i  : queries = block tokens only; keys/values = [k/v(ctx) | k/v(block)], both from layer i's
               k_proj/v_proj (k_norm on both), RoPE at document-local context positions and pos(anchor)+k
    output   = norm(block hidden)                                          [B, Q, H]

`variant="dflash2"` (DFlash2) wraps every attention and MLP in a block-local dynamic convolution and adds a
candidate selector (`dflash2`), both the identity at init: an untrained DFlash2 computes what DFlash does.

Parameter names equal the z-lab export keys (`fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`). The target's
embedding and lm_head are frozen inputs, never parameters: `load_target_embeddings` reads just those two.

Shape legend: B rows, S row length, K = k*H tapped width (k*tap_width on a projected cache), A anchors per row,
L block length, Q = A*L, H hidden, N query heads, G kv heads, D head dim, V vocab.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from dflash_offline.anchors import block_input_ids, block_position_ids
from dflash_offline.config import ConfigError, check_choice
from dflash_offline.dflash2 import BlockConv, CandidateSelector, rng_untouched
from dflash_offline.masks import block_allow, dense_mask, flex_block_mask

LAYER_TYPES = ("full_attention", "sliding_attention")
# attention inside the block in sliding layers (full layers always see the whole block): "causal" = the slots before
# and the slot itself (the default, and what configs without `is_causal` are served with), "bidirectional" = every
# slot (what `is_causal: false` asks for; z-lab's published DFlash2 drafters declare it; docs/serving.md)
BLOCK_ATTENTIONS = ("causal", "bidirectional")
# "flex": flex over the context keys + a dense block part (`split_attention`); "dense": SDPA over context + block keys
# with a dense bool mask (the reference, any device)
ATTNS = ("flex", "dense")
VARIANTS = ("dflash", "dflash2")


@dataclass
class DrafterSettings:
    """The drafter a run trains (`train` settings; `trainsetup.drafter_config` makes its `DrafterConfig`)."""

    variant: str = "dflash"  # drafter: "dflash" or "dflash2" (+ block-local conv, candidate selector and its CE)
    conv_kernel_size: int = 2  # dflash2: taps of the block-local convolution (the slot and the slots before it)
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic tap of the convolution (must divide hidden)
    selector_rank: int = 256  # dflash2: width of the candidate selector's token codebooks
    selector_top_k: int = 16  # dflash2: candidates per slot the selector walks among
    num_layers: int = 5  # drafter decoder layers
    num_heads: int = 32  # drafter query heads
    num_kv_heads: int = 8  # drafter key/value heads
    head_dim: int = 128  # drafter head width
    intermediate_size: int = 0  # drafter MLP width; 0 = the target's
    block_size: int = 16  # tokens per draft block (slot 0 = the anchor token)
    layer_ids: list[int] = field(default_factory=list)  # tapped layers to train on; empty = all the cache holds
    mask_token_id: int = -1  # the drafter's mask token; -1 = the one validated at extraction
    sliding_window: int = 0  # >0: every layer but the last `full_attention_layers` uses sliding-window attention of this width; 0 = off
    full_attention_layers: int = 1  # with sliding_window: the last N layers attend fully (1 = SpecForge's 3.6 drafter; 0 = all sliding, z-lab's DFlash2)
    block_attention: str = "causal"  # inside the block in sliding layers: "causal" (z-lab's DFlash drafters) or "bidirectional" (z-lab's DFlash2: is_causal false); full layers always see the whole block

    def resolve(self) -> "DrafterSettings":
        check_choice("train.variant", self.variant, VARIANTS)
        check_choice("train.block_attention", self.block_attention, BLOCK_ATTENTIONS)
        if self.block_attention == "bidirectional" and 0 < self.sliding_window < self.block_size:
            raise ConfigError(f"train.block_attention=bidirectional needs sliding_window >= block_size (got "
                              f"{self.sliding_window} < {self.block_size})")
        if self.num_layers <= 0:
            raise ConfigError(f"train.num_layers must be > 0, got {self.num_layers}")
        if not 0 <= self.full_attention_layers <= self.num_layers:
            raise ConfigError(f"train.full_attention_layers={self.full_attention_layers} must be in [0, "
                              f"num_layers={self.num_layers}]")
        if min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) < 1:
            raise ConfigError(f"train.conv_kernel_size, conv_group_size, selector_rank and selector_top_k must be >= 1 "
                              f"(got {self.conv_kernel_size}, {self.conv_group_size}, {self.selector_rank}, "
                              f"{self.selector_top_k})")
        if self.block_size < 2:
            raise ConfigError(f"train.block_size must be >= 2, got {self.block_size}")
        return self


@dataclass
class DrafterConfig:
    hidden_size: int  # H, the target's hidden size
    intermediate_size: int  # MLP width of each drafter layer
    vocab_size: int  # the target's vocabulary (rows of embed / lm_head)
    target_layer_ids: list[int]  # tapped target layers (0-based layer outputs); k = len(...)
    num_target_layers: int  # N, layers of the target
    mask_token_id: int  # a real, non-pad/eos row of the target embedding (Qwen3 151669, Qwen3.5 248070)
    num_layers: int = 5  # drafter decoder layers
    num_heads: int = 32  # query heads
    num_kv_heads: int = 8  # key/value heads (GQA)
    head_dim: int = 128  # per-head width
    rms_norm_eps: float = 1e-6  # every RMSNorm
    rope_theta: float = 1e6  # the target's RoPE theta (1e6 Qwen3, 1e7 Qwen3.5/3.6)
    block_size: int = 16  # L, tokens per draft block (slot 0 = given token)
    sliding_window: int | None = None  # W of "sliding_attention" layers
    layer_types: list[str] | None = None  # per layer "full_attention"/"sliding_attention"; None = all full
    block_attention: str = "causal"  # inside the block in sliding layers: "causal" (earlier slots) or "bidirectional"
    initializer_range: float = 0.02  # std of the normal init of every Linear
    tap_width: int = 0  # values per tapped layer the fc reads: 0 = hidden_size; k for a projected cache (projection.py)
    variant: str = "dflash"  # "dflash" or "dflash2" (+ block-local dynamic conv around every sublayer, candidate selector)
    conv_kernel_size: int = 2  # dflash2: conv taps (the slot and the slots before it in its block)
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic tap
    selector_rank: int = 256  # dflash2: width of the selector's token codebooks
    selector_top_k: int = 16  # dflash2: candidates per slot the selector chooses among

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_layers
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must be {self.num_layers} entries of {LAYER_TYPES}, got {self.layer_types}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.block_attention not in BLOCK_ATTENTIONS:
            raise ValueError(f"block_attention must be one of {BLOCK_ATTENTIONS}, got {self.block_attention!r}")
        if (self.block_attention == "bidirectional" and "sliding_attention" in self.layer_types
                and self.sliding_window < self.block_size):
            raise ValueError(f"block_attention='bidirectional' needs sliding_window={self.sliding_window} >= "
                             f"block_size={self.block_size} (a window that cuts the block is served differently)")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant == "dflash2" and (self.conv_kernel_size < 1 or self.hidden_size % self.conv_group_size):
            raise ValueError(f"conv_kernel_size={self.conv_kernel_size} must be >= 1 and conv_group_size="
                             f"{self.conv_group_size} must divide hidden_size={self.hidden_size}")


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(pos_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Qwen3 (non-interleaved, rotate-half) RoPE tables [B, T, D], computed in fp32 and cast to `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_BT.device, dtype=torch.float32) / head_dim))
    freqs_BTd = pos_BT.float()[..., None] * inv_freq
    emb_BTD = torch.cat([freqs_BTd, freqs_BTd], dim=-1)
    return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)


def apply_rope(x_BTnD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    half = x_BTnD.shape[-1] // 2
    rot = torch.cat([-x_BTnD[..., half:], x_BTnD[..., :half]], dim=-1)
    return x_BTnD * cos_BTD[:, :, None] + rot * sin_BTD[:, :, None]


def block_part(q_BNQD, k_BGQD, v_BGQD, allow_LL, scale):
    """Each block's queries against its own L keys, in fp32: (o [B, N, Q, D], lse [B, N, Q])."""
    B, N, Q, D = q_BNQD.shape
    G, L = k_BGQD.shape[1], allow_LL.shape[0]
    R, A = N // G, Q // L  # query heads per kv head (head n uses kv head n // R), blocks per row
    with torch.autocast(q_BNQD.device.type, enabled=False):  # fp32 even under autocast
        # per (row, kv head, block): its R heads x L slots of queries against the block's L keys
        q6 = q_BNQD.view(B, G, R, A, L, D).float()
        k5, v5 = k_BGQD.view(B, G, A, L, D).float(), v_BGQD.view(B, G, A, L, D).float()
        s6 = torch.einsum("bgrald,bgamd->bgralm", q6, k5) * scale
        s6 = s6.masked_fill(~allow_LL, float("-inf"))
        lse = torch.logsumexp(s6, dim=-1)  # [B, G, R, A, L]: finite, slot k always sees itself
        o = torch.einsum("bgralm,bgamd->bgrald", torch.exp(s6 - lse[..., None]), v5)
    return o.reshape(B, N, Q, D), lse.reshape(B, N, Q)


def expand_heads(k_BGTD, v_BGTD, n_heads: int):
    """K/V [B, G, T, D] repeated to [B, N, T, D] (kv head g serves query heads g*R .. g*R+R-1, as GQA does)."""
    G = k_BGTD.shape[1]
    if n_heads % G:
        raise ValueError(f"{n_heads} query heads are not a multiple of {G} kv heads")
    R = n_heads // G
    return (k_BGTD, v_BGTD) if R == 1 else (k_BGTD.repeat_interleave(R, 1), v_BGTD.repeat_interleave(R, 1))


def split_attention(q_BNQD, k_ctx_BGSD, v_ctx_BGSD, k_blk_BGQD, v_blk_BGQD, ctx_mask, allow_LL, scale,
                    expand_kv: bool = False, kernel_options: dict | None = None):
    """The training attention as two parts merged by their log-sum-exps: flex_attention of the block queries over
    the S context keys (`ctx_mask`, a context-only BlockMask from `masks.flex_block_mask`), and each block's own
    keys as a small dense attention (`block_part`, `allow_LL` from `masks.block_allow`). Equal to one flex call
    over [context | block] keys with the full mask, without flex visiting the block-diagonal tiles (1/8 dense at
    tile 128, L 16), whose backward costs as much as full context tiles. A query with no context (padded anchor,
    anchor at a document start) gets lse -inf from flex and weight 0 in the merge. Returns [B, N, Q, D] in q's
    dtype.

    `expand_kv` gives flex the context K/V repeated to the N query heads instead of GQA: flex's backward computes
    dK/dV with one program per (kv head, key tile), each looping over the query tiles that see it, so with 8 kv
    heads and 2048 keys it has ~128 unequal programs (a key early in a document is seen by every later anchor) for
    132 SMs; per query head there are 4x as many, each 1/4 of the work (autograd sums the copies' gradients).
    """
    if expand_kv:
        k_ctx_BGSD, v_ctx_BGSD = expand_heads(k_ctx_BGSD, v_ctx_BGSD, q_BNQD.shape[1])
    o1, aux = flex_attention(q_BNQD, k_ctx_BGSD, v_ctx_BGSD, block_mask=ctx_mask, scale=scale,
                             enable_gqa=k_ctx_BGSD.shape[1] != q_BNQD.shape[1], kernel_options=kernel_options,
                             return_aux=AuxRequest(lse=True))
    o2, lse2 = block_part(q_BNQD, k_blk_BGQD, v_blk_BGQD, allow_LL, scale)
    with torch.autocast(q_BNQD.device.type, enabled=False):
        lse1 = aux.lse.float()
        lse = torch.logaddexp(lse1, lse2)
        o = o1.float() * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]
    return o.to(q_BNQD.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding_window: int | None = None):
        super().__init__()
        H, N, G, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = N, G, D
        self.block_size, self.sliding_window = cfg.block_size, sliding_window
        self.block_causal = cfg.block_attention == "causal"
        self.q_proj = nn.Linear(H, N * D, bias=False)
        self.k_proj = nn.Linear(H, G * D, bias=False)
        self.v_proj = nn.Linear(H, G * D, bias=False)
        self.o_proj = nn.Linear(N * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _kv(self, x_BTH, rope):
        B, T, _ = x_BTH.shape
        k = apply_rope(self.k_norm(self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)), *rope)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)
        return k, v

    def forward(self, x_BQH, ctx_BSH, rope_ctx, rope_blk, mask, attn: str):
        B, Q, _ = x_BQH.shape
        q = apply_rope(self.q_norm(self.q_proj(x_BQH).view(B, Q, self.n_heads, self.head_dim)), *rope_blk)
        k_ctx, v_ctx = self._kv(ctx_BSH, rope_ctx)
        k_blk, v_blk = self._kv(x_BQH, rope_blk)
        q_BNQD = q.transpose(1, 2)
        scale = self.head_dim**-0.5
        if attn == "flex":
            allow_LL = block_allow(self.block_size, self.sliding_window, x_BQH.device, self.block_causal)
            o = split_attention(q_BNQD, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), k_blk.transpose(1, 2),
                                v_blk.transpose(1, 2), mask, allow_LL, scale, expand_kv=True)
        else:  # one SDPA over [context | block] keys with a dense mask
            k_BGKD = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
            v_BGKD = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q_BNQD, k_BGKD, v_BGKD, attn_mask=mask, scale=scale, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def drop_slot0(x_BQH: torch.Tensor, L: int) -> torch.Tensor:
    """Slots 1..L-1 of each block of L: [B, A*(L-1), H]."""
    B, Q, H = x_BQH.shape
    return x_BQH.view(B, Q // L, L, H)[:, :, 1:].reshape(B, -1, H)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(cfg, cfg.sliding_window if layer_type == "sliding_attention" else None)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if cfg.variant == "dflash2":  # DFlash2: each sublayer f becomes post(f(pre(x))), block-local (`dflash2`)
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            self.attention_conv, self.mlp_conv = BlockConv(*conv), BlockConv(*conv)

    def forward(self, x_BQH, ctx_BSH, rope_ctx, rope_blk, mask, attn: str, drop_slot0_of: int = 0):
        """`drop_slot0_of=L` (the last layer in training): keep slots 1..L-1 of each block, whose outputs are the
        only ones scored; returns [B, A*(L-1), H]. DFlash drops them after attention, so the MLP runs on (L-1)/L of
        the tokens; DFlash2 after the MLP (its convolution reads slot 0)."""
        # ctx is injected as-is (already hidden_norm-ed); only the block stream gets input_layernorm
        def attend(h_BQH):
            return self.self_attn(h_BQH, ctx_BSH, rope_ctx, rope_blk, mask, attn)

        x_BQH = x_BQH + _around(self.attention_conv, attend, self.input_layernorm(x_BQH))
        if drop_slot0_of and self.mlp_conv is None:
            x_BQH = drop_slot0(x_BQH, drop_slot0_of)
        x_BQH = x_BQH + _around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x_BQH))
        return drop_slot0(x_BQH, drop_slot0_of) if drop_slot0_of and self.mlp_conv is not None else x_BQH


def _around(conv: BlockConv | None, sublayer, h_BQH: torch.Tensor) -> torch.Tensor:
    return sublayer(h_BQH) if conv is None else conv.around(sublayer, h_BQH)


class DFlashDrafter(nn.Module):
    """Trainable part of a DFlash drafter; `state_dict()` keys are exactly the z-lab export keys."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * (cfg.tap_width or cfg.hidden_size), cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = None
        if cfg.variant == "dflash2":  # used by the loss and for drafting, after the forward
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Qwen3 init: every Linear ~ N(0, initializer_range), every norm weight = 1; DFlash2's modules are the
        identity (`dflash2`). The DFlash tensors draw exactly what a DFlash drafter draws (DFlash2's modules draw
        after them, from a fork of the generator), so both built after the same `torch.manual_seed` share them. On
        the meta device (a drafter built for its shapes) there is nothing to draw: skipped (drawing there would import
        torch._dynamo, seconds in a process that has not)."""
        if self.fc.weight.is_meta:
            return
        extra = (BlockConv, CandidateSelector)
        own = {id(p) for m in self.modules() if isinstance(m, extra) for p in m.parameters()}
        for m in self.modules():
            if isinstance(m, nn.Linear) and id(m.weight) not in own:
                m.weight.normal_(0.0, self.cfg.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        with rng_untouched(self.norm.weight.device):
            for m in self.modules():
                if isinstance(m, BlockConv):
                    m.reset_parameters()
                elif isinstance(m, CandidateSelector):
                    m.reset_parameters(self.cfg.initializer_range)

    def build_masks(self, doc_ids_BS, anchor_pos_BA, keep_BA, attn: str = "flex") -> dict:
        """One mask per layer type in use: dense bool [B,1,Q,S+Q] (attn="dense") or a context-only flex BlockMask
        [B,1,Q,S] (attn="flex"; the block part is dense, see `split_attention`)."""
        if attn not in ATTNS:
            raise ValueError(f"attn must be one of {ATTNS}, got {attn!r}")
        L, W = self.cfg.block_size, self.cfg.sliding_window
        causal = self.cfg.block_attention == "causal"
        masks = {}
        for t in set(self.cfg.layer_types):
            w = W if t == "sliding_attention" else None
            if attn == "dense":
                masks[t] = dense_mask(anchor_pos_BA, keep_BA, doc_ids_BS, L, w, causal)
            else:
                masks[t] = flex_block_mask(anchor_pos_BA, keep_BA, doc_ids_BS, L, w, context_only=True,
                                           block_causal=causal)
        return masks

    def encode_context(self, hidden_BSK: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(tapped target states)) [B, S, H]. The states go to the fc weight's dtype (bf16 with bf16
        weights, no copy; fp32 weights run under autocast or in fp32)."""
        return self.hidden_norm(self.fc(hidden_BSK.to(self.fc.weight.dtype)))

    def output_norm(self, x_BQH: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The final norm, cast to `out_dtype` (the lm_head's) when given."""
        h = self.norm(x_BQH)
        return h if out_dtype is None else h.to(out_dtype)

    def forward(
        self,
        hidden_BSK: torch.Tensor,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor,
        anchor_pos_BA: torch.Tensor,
        keep_BA: torch.Tensor,
        embed_weight_VH: torch.Tensor,
        masks: dict,
        attn: str = "flex",
        scored_only: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Final-normed block hidden states [B, A*L, H] (query a*L + k = anchor a, slot k).

        `scored_only=True` returns slots 1..L-1 only, [B, A*(L-1), H] (query a*(L-1) + k-1): slot 0 (the given
        token) is never scored, so the last layer's MLP skips it (training; `loss.block_ce_loss` takes either).
        `masks` comes from `build_masks` with the same anchors and the same `attn`. The flex path must run
        under torch.compile (uncompiled flex_attention materializes the score matrix).
        """
        # the residual stream's dtype: the norms' (matmul weights may be bf16 copies, see optim.MasterAdamW)
        L, dtype = self.cfg.block_size, self.norm.weight.dtype
        ctx_BSH = self.encode_context(hidden_BSK)
        ids_BQ = block_input_ids(input_ids_BS, anchor_pos_BA, keep_BA, L, self.cfg.mask_token_id)
        x_BQH = F.embedding(ids_BQ, embed_weight_VH).to(dtype)
        D, theta = self.cfg.head_dim, self.cfg.rope_theta
        rope_ctx = rope_cos_sin(position_ids_BS, D, theta, dtype)
        rope_blk = rope_cos_sin(block_position_ids(position_ids_BS, anchor_pos_BA, L), D, theta, dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x_BQH = layer(x_BQH, ctx_BSH, rope_ctx, rope_blk, masks[layer.layer_type], attn,
                          L if scored_only and i == last else 0)
        return self.output_norm(x_BQH, out_dtype)


# --- target embeddings -------------------------------------------------------------------------------------

EMBED_KEYS = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight",)


def _tied(cfg: dict) -> bool:
    text = cfg.get("text_config") or {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def load_target_embeddings(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_weight [V, H], lm_head_weight [V, H]) read from the target's safetensors, nothing else loaded.

    Handles a single `model.safetensors` or a sharded `model.safetensors.index.json`, the Qwen3.5/3.6 VL
    wrapper (`model.language_model.embed_tokens.weight`) and Qwen3 (`model.embed_tokens.weight`). With
    `tie_word_embeddings` and no `lm_head.weight`, the lm_head is the embedding.
    """
    from dflash_offline.targetid import weight_map as checkpoint_weight_map

    target_dir = Path(target_dir)
    weight_map = checkpoint_weight_map(target_dir)

    def read(key: str) -> torch.Tensor:
        with safe_open(str(weight_map[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed_key = next((k for k in EMBED_KEYS if k in weight_map), None)
    if embed_key is None:
        raise ValueError(f"{target_dir}: none of {EMBED_KEYS} in the checkpoint; is this a Qwen3/Qwen3.5 target?")
    embed = read(embed_key)
    head_key = next((k for k in LM_HEAD_KEYS if k in weight_map), None)
    if head_key is not None:
        return embed, read(head_key)
    cfg_path = target_dir / "config.json"
    if cfg_path.exists() and _tied(json.loads(cfg_path.read_text())):
        return embed, embed
    raise ValueError(f"{target_dir}: no lm_head.weight and config.json does not set tie_word_embeddings")
