"""DFlash drafter for `transformers` (remote code): exported by dflash_offline as `dflash.py` next to the weights.

    model = AutoModel.from_pretrained(export_dir, trust_remote_code=True)     # config.json auto_map names this file

Self-contained on purpose (imports torch and transformers only): it travels with the checkpoint. The architecture
and parameter names are those of z-lab's `DFlashDraftModel` (model_type "qwen3"):

    ctx    = hidden_norm(fc(concat of the target's tapped layer outputs))             [B, S, H]
    layer  : queries = block tokens only; keys/values = [cache | k/v(ctx) | k/v(block)], both projected by the
             layer's own k_proj/v_proj with k_norm and RoPE (KV injection); pre-norm attention + SwiGLU MLP
    output = norm(block hidden states)                                                  [B, Q, H]

The target's embedding and lm_head are not part of the drafter: block tokens arrive as embeddings
(`noise_embedding`) or as ids plus the target's embedding table, and logits are the target's lm_head applied to
the output. `forward` follows z-lab's keyword interface (`target_hidden`, `noise_embedding`, `position_ids` over
context + block, `past_key_values`, `use_cache`), so code calling z-lab's `forward` calls this one alike (not
z-lab's generation loops, which call other methods and argument orders: `spec_generate` below is this file's own).

`DFlash2DraftModel` (z-lab's DFlash2, same file; config.json names it) adds to every layer a block-local dynamic
convolution around attention and around the MLP (`attention_conv`, `mlp_conv`) and a candidate selector that drafts
a block by walking each slot's top-k candidates from the anchor (`candidate_selector`); see its docstring. The file
is longer than this project's modules because it travels alone: both drafters, no imports of the project.

Speculative decoding: `draft_block` is one drafting step (context cache in, draft logits of one block out);
`spec_generate` is a simple batch-1 loop around it. Serving loops that verify with their own target machinery
(cache rollback, timing) call `draft_block` too, so every loop drafts with the same code.

Attention, when no `attention_mask` is given (inference: the context is everything before the block's first
token): `full_attention` layers see every context key and the whole block (bidirectional); `sliding_attention`
layers see keys at most `sliding_window - 1` positions back and, inside the block, only earlier slots (causal) —
or, when the config says `is_causal: false` (a drafter trained with block_attention "bidirectional", as z-lab's
DFlash2 drafters declare), the whole block (|distance| < sliding_window, z-lab's rule). These are the masks the
drafter was trained with; `refuse_other_computations` refuses a config asking for any other. An explicit mask
(bool, True = attend; or additive float), [B, 1, Q, K] or [B, Q, K] with K = cached + context + block keys, or a
dict {layer_type: mask}, replaces them.

Shape legend: B batch, S new context tokens, C cached keys, Q block tokens, K keys, H hidden, N query heads,
G kv heads, D head dim, V vocab.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

FULL, SLIDING = "full_attention", "sliding_attention"


def rope_theta_of(config) -> float:
    """RoPE base from `rope_parameters` (transformers >= 5) or the legacy top-level `rope_theta`."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"DFlash drafter: rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash drafter config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


class DFlashRMSNorm(nn.Module):
    """RMSNorm as in Qwen3: statistics in fp32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(pos_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, T, D] of rotate-half RoPE at integer positions; computed in fp32, cast to `dtype`."""
    exponent = torch.arange(0, head_dim, 2, device=pos_BT.device, dtype=torch.float32) / head_dim
    angles_BTd = pos_BT.float()[..., None] * (1.0 / theta**exponent)
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos().to(dtype), angles_BTD.sin().to(dtype)


def rotate(x_BTnD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    half = x_BTnD.shape[-1] // 2
    x_rot = torch.cat([-x_BTnD[..., half:], x_BTnD[..., :half]], dim=-1)
    return x_BTnD * cos_BTD[:, :, None] + x_rot * sin_BTD[:, :, None]


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.layer_idx, self.head_dim = layer_idx, D
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(D, config.rms_norm_eps)

    def keys_values(self, x_BTH: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE'd, k_norm'ed keys and values [B, G, T, D] of `x` (context or block tokens)."""
        B, T, _ = x_BTH.shape
        k = rotate(self.k_norm(self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)), *rope)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x_BQH, ctx_BSH, rope_ctx, rope_blk, mask, cache):
        B, Q, _ = x_BQH.shape
        q = rotate(self.q_norm(self.q_proj(x_BQH).view(B, Q, self.n_heads, self.head_dim)), *rope_blk)
        k_blk, v_blk = self.keys_values(x_BQH, rope_blk)
        if ctx_BSH is not None:
            k_ctx, v_ctx = self.keys_values(ctx_BSH, rope_ctx)
            k_new, v_new = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        else:
            k_new, v_new = k_blk, v_blk
        k, v = cache.update(k_new, v_new, self.layer_idx) if cache is not None else (k_new, v_new)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.head_dim**-0.5,
                                           enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash drafter: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx] if config.layer_types else FULL
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None  # DFlash2 sets both (`BlockConvolution`)

    def forward(self, x_BQH, ctx_BSH, rope_ctx, rope_blk, mask, cache):
        # the context is injected as is (already hidden_norm'ed); only the block stream is normed here
        def attend(h_BQH):
            return self.self_attn(h_BQH, ctx_BSH, rope_ctx, rope_blk, mask, cache)

        x_BQH = x_BQH + _wrapped(self.attention_conv, attend, self.input_layernorm(x_BQH))
        return x_BQH + _wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(x_BQH))


def _wrapped(conv, sublayer, h_BQH):
    return sublayer(h_BQH) if conv is None else conv(sublayer, h_BQH)


class DraftKVCache:
    """Minimal per-layer key/value cache ([B, G, T, D] each) with the `update` / `get_seq_length` / `crop`
    calls the forward and `spec_generate` use; a transformers `DynamicCache` works as well."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, k, v, layer_idx: int, *args, **kwargs):
        if layer_idx in self.keys:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2] if layer_idx in self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        for i in self.keys:
            self.keys[i], self.values[i] = self.keys[i][:, :, :length], self.values[i][:, :, :length]


def choose(logits: torch.Tensor, temperature: float) -> torch.LongTensor:
    """The argmax at temperature 0 (<= 1e-5), else a sample of softmax(logits / temperature); over the last dim."""
    if temperature <= 1e-5:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


class DFlashDraftModel(PreTrainedModel):
    """DFlash block drafter (z-lab format). `forward` returns the final-normed block hidden states [B, Q, H]."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    main_input_name = "noise_embedding"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config):
        refuse_other_computations(config)
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if "target_layer_ids" not in dflash:
            raise ValueError("DFlash drafter config lacks dflash_config.target_layer_ids")
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.rope_theta = rope_theta_of(config)
        types = list(config.layer_types or [FULL] * config.num_hidden_layers)
        if len(types) != config.num_hidden_layers or not set(types) <= {FULL, SLIDING}:
            raise ValueError(f"layer_types must be {config.num_hidden_layers} entries of {FULL!r}/{SLIDING!r}, "
                             f"got {types}")
        self.sliding_window = config.sliding_window if SLIDING in types else None
        self.block_causal = block_causal_of(config)  # inside the block in sliding layers
        if SLIDING in types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but config.sliding_window is not set "
                             "(and use_sliding_window must be true)")
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    # --- masks ---------------------------------------------------------------------------------------------

    def default_masks(self, pos_BK: torch.Tensor, num_queries: int) -> dict:
        """Inference masks per layer type from key positions [B, K] (the last Q keys are the queries)."""
        masks: dict = {FULL: None}  # every key visible
        if self.sliding_window:
            q_BQ = pos_BK[:, -num_queries:]
            dist_BQK = q_BQ[:, :, None] - pos_BK[:, None, :]
            ahead = (dist_BQK >= 0) if self.block_causal else (-dist_BQK < self.sliding_window)
            masks[SLIDING] = (ahead & (dist_BQK < self.sliding_window))[:, None]
        return masks

    # --- forward -------------------------------------------------------------------------------------------

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask=None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        input_ids: torch.LongTensor | None = None,
        embed_tokens=None,
        **kwargs,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, Q, H] of the block tokens.

        position_ids     [B, S + Q]: RoPE positions of the new context tokens, then of the block tokens.
        noise_embedding  [B, Q, H]: block token embeddings from the target's table (`[token, MASK, ...]`); or
                         give `input_ids` [B, Q] and `embed_tokens` (the target's nn.Embedding or its [V, H] weight).
        target_hidden    [B, S, k*H]: the target's tapped layer outputs (in `target_layer_ids` order) of the new
                         context tokens, or None when every context token is already in `past_key_values`.
        past_key_values  a cache holding earlier context keys (contiguous positions just before
                         `position_ids[:, 0]`); with it every call appends this call's context *and* block keys,
                         so crop it back to the context (`crop(num_context_tokens)`) before the next call.
        attention_mask   None (inference masks, see the module docstring), a mask for every layer, or
                         {layer_type: mask}; bool True = attend, or additive float; [B, 1, Q, K] or [B, Q, K].
        Other keyword arguments (e.g. z-lab's `is_causal`) are accepted and ignored.
        """
        dtype = self.fc.weight.dtype
        if noise_embedding is None:
            if input_ids is None or embed_tokens is None:
                raise ValueError("give noise_embedding, or input_ids together with embed_tokens (the target's "
                                 "embedding module or weight)")
            weight = embed_tokens.weight if isinstance(embed_tokens, nn.Module) else embed_tokens
            noise_embedding = F.embedding(input_ids, weight)
        x_BQH = noise_embedding.to(dtype)
        B, Q, _ = x_BQH.shape
        S = 0 if target_hidden is None else target_hidden.shape[1]
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, -1)
        if position_ids.shape[-1] != S + Q:
            raise ValueError(f"position_ids covers {position_ids.shape[-1]} tokens; expected context + block = "
                             f"{S} + {Q}")
        ctx_BSH = self.hidden_norm(self.fc(target_hidden.to(dtype))) if S else None
        D, theta = self.config.head_dim, self.rope_theta
        rope_ctx = rope_tables(position_ids[:, :S], D, theta, dtype) if S else None
        rope_blk = rope_tables(position_ids[:, S:], D, theta, dtype)
        cache = past_key_values if (use_cache or past_key_values is not None) else None
        if cache is None and use_cache:
            cache = DraftKVCache()
        if attention_mask is None:
            C = cache.get_seq_length() if cache is not None else 0
            first = position_ids[:, :1]
            cached_pos = first - C + torch.arange(C, device=first.device)
            masks = self.default_masks(torch.cat([cached_pos, position_ids], dim=1), Q)
        elif isinstance(attention_mask, dict):
            masks = {t: self._as_mask(m) for t, m in attention_mask.items()}
        else:
            masks = {t: self._as_mask(attention_mask) for t in (FULL, SLIDING)}
        for layer in self.layers:
            x_BQH = layer(x_BQH, ctx_BSH, rope_ctx, rope_blk, masks[layer.layer_type], cache)
        return self.norm(x_BQH)

    def _as_mask(self, mask):
        if mask is None or mask.dtype == torch.bool:
            return mask[:, None] if mask is not None and mask.dim() == 3 else mask
        mask = mask.to(self.fc.weight.dtype)
        return mask[:, None] if mask.dim() == 3 else mask

    # --- speculative decoding (a simple reference loop, batch 1) --------------------------------------------

    def context_features(self, hidden_states) -> torch.Tensor:
        """Concatenate the tapped layer outputs from a target's `hidden_states` tuple (index 0 = embeddings)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def draft_cache(self) -> DraftKVCache:
        """An empty context cache for `draft_block` (one per sequence)."""
        return DraftKVCache()

    @torch.no_grad()
    def draft_block(self, target_hidden: torch.Tensor, anchor_ids: torch.LongTensor, past_key_values,
                    embed_tokens, lm_head, block_size: int | None = None, return_hidden: bool = False):
        """One drafting step: logits [B, L-1, V] of block slots 1..L-1 (slot k = the token k after the anchor);
        with `return_hidden`, (logits, their final-normed hidden states [B, L-1, H]).

        target_hidden    [B, S, k*H]: the target's tapped states of the S tokens before the anchor that
                         `past_key_values` does not hold yet (first call: the prompt; then the previous anchor and
                         the drafts the target accepted after it).
        anchor_ids       [B, 1]: the newest token, at position C + S (C = context positions in the cache).
        past_key_values  the sequence's context cache (`draft_cache()`); on return it holds the C + S context
                         positions and nothing of the block.
        embed_tokens, lm_head  the target's input embedding and lm_head (modules, or their [V, H] weights).
        """
        L = block_size or self.block_size
        if self.mask_token_id is None:
            raise ValueError("config.dflash_config.mask_token_id is not set")
        C, S = past_key_values.get_seq_length(), target_hidden.shape[1]
        block = torch.full((anchor_ids.shape[0], L), self.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block[:, :1] = anchor_ids
        noise = embed_tokens(block) if isinstance(embed_tokens, nn.Module) else F.embedding(block, embed_tokens)
        h = self(position_ids=torch.arange(C, C + S + L, device=block.device)[None], noise_embedding=noise,
                 target_hidden=target_hidden, past_key_values=past_key_values, use_cache=True)
        past_key_values.crop(C + S)
        h = h[:, 1:]
        logits = lm_head(h) if isinstance(lm_head, nn.Module) else h @ lm_head.t()
        return (logits, h) if return_hidden else logits

    @torch.no_grad()
    def draft_tokens(self, target_hidden, anchor_ids, past_key_values, embed_tokens, lm_head, block_size=None,
                     temperature: float = 0.0) -> torch.LongTensor:
        """The drafted tokens [B, L-1] of one drafting step (`draft_block`'s logits, argmax or sampled)."""
        return choose(self.draft_block(target_hidden, anchor_ids, past_key_values, embed_tokens, lm_head, block_size),
                      temperature)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      block_size: int | None = None, return_stats: bool = False):
        """Speculative decoding of one sequence with `target` (a transformers causal LM): draft a block, verify it
        with one target forward, keep the longest agreeing prefix plus the target's own next token.

        Each kept token is the target's own choice (greedy at temperature 0, else a sample from the target's
        distribution), so the output is the target's. With a target whose layers are all attention the target
        KV cache is reused and cropped after each block; hybrid targets (Gated DeltaNet) are recomputed over the
        whole sequence at every block instead (correct, slower). Returns the ids [1, prompt + new] or, with
        `return_stats`, a namespace with `output_ids` and `acceptance_lengths` (tokens gained per block).
        """
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one sequence at a time (batch 1)")
        if self.mask_token_id is None:
            raise ValueError("config.dflash_config.mask_token_id is not set")
        L = block_size or self.block_size
        self.eval()
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        text_cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        use_target_cache = all(t in (FULL, SLIDING) for t in (getattr(text_cfg, "layer_types", None) or [FULL]))
        stops = set(stop_token_ids or [])

        def run_target(ids, cache, keep):
            # positions follow from the cache length (or start at 0 without a cache)
            out = target(input_ids=ids, past_key_values=cache, use_cache=cache is not None,
                         output_hidden_states=True, logits_to_keep=keep)
            return out.logits, self.context_features(out.hidden_states)

        seq = input_ids
        tcache = None
        if use_target_cache:
            from transformers import DynamicCache

            tcache = DynamicCache()
        logits, ctx = run_target(seq, tcache, 1)
        seq = torch.cat([seq, choose(logits[:, -1:], temperature)], dim=1)
        dcache, accepted = self.draft_cache(), []
        prompt_len = input_ids.shape[1]
        while seq.shape[1] - prompt_len < max_new_tokens and not (stops and int(seq[0, -1]) in stops):
            n = seq.shape[1] - 1  # tokens before the anchor (the newest token)
            drafted = self.draft_tokens(ctx, seq[:, -1:], dcache, embed, head, L, temperature)
            block = torch.cat([seq[:, -1:], drafted], dim=1)
            if tcache is not None:
                logits, hidden = run_target(block, tcache, L)
            else:
                logits, hidden = run_target(torch.cat([seq[:, :-1], block], dim=1), None, L)
                hidden = hidden[:, -L:]
            verdict = choose(logits, temperature)  # verdict[:, i] = the target's token after block[:, :i + 1]
            agree = (block[:, 1:] == verdict[:, :-1]).int().cumprod(dim=1).sum().item()
            seq = torch.cat([seq, block[:, 1:agree + 1], verdict[:, agree:agree + 1]], dim=1)
            ctx = hidden[:, :agree + 1]
            if tcache is not None:
                drop = tcache.get_seq_length() - (n + agree + 1)
                if drop > 0:
                    tcache.crop(-drop)  # a negative crop removes that many positions (transformers 4.x and 5.x)
            accepted.append(agree + 1)  # counted before any truncation at a stop token, as the engines count it
            if stops and not stops.isdisjoint(seq[0, -(agree + 1):].tolist()):
                break  # a stop token anywhere in the accepted tokens ends the generation (cut below)
        out = seq[:, :prompt_len + max_new_tokens]
        if stops:
            new = out[0, prompt_len:].tolist()
            hit = next((i for i, t in enumerate(new) if t in stops), None)
            if hit is not None:
                out = out[:, :prompt_len + hit + 1]
        return SimpleNamespace(output_ids=out, acceptance_lengths=accepted) if return_stats else out


# --- DFlash2 ---------------------------------------------------------------------------------------------------


class BlockConvolution(nn.Module):
    """DFlash2's convolution around one sublayer f of the block stream x (the normed residual): post(f(pre(x))),

        pre(x)_t  = sum_j (base_kernel[0, j] + tap[t, 0, j, g]) * x_{t-j}      (x before the block's slot 0: zero)
        post(y)_t = sum_j (base_kernel[1, j] + tap[t, 1, j, g]) * y_{t-j}
        tap       = kernel_projection(x) [.., 2, J, groups], one value for each group of `group_size` channels.

    The Q block tokens of a row are one block (drafting: [anchor, MASK, ...])."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.identity_init()

    @torch.no_grad()
    def identity_init(self) -> None:
        """The identity, post(f(pre(x))) = f(x): base taps [1, 0, ...], no dynamic part (kernel_projection 0). A
        tensor `from_pretrained` has loaded (flagged `_is_hf_initialized`) is kept."""
        if not getattr(self.base_kernel, "_is_hf_initialized", False):
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
        if not getattr(self.kernel_projection.weight, "_is_hf_initialized", False):
            self.kernel_projection.weight.zero_()

    def convolve(self, x_BQH, tap_BQJG, base_JH):
        B, Q, H = x_BQH.shape
        J, G = base_JH.shape[0], self.groups
        x5 = x_BQH.view(B, Q, G, H // G)
        tap5 = tap_BQJG.view(B, Q, J, G, 1)
        base = base_JH.to(x_BQH.dtype).view(J, G, H // G)
        out = x5 * base[0] + tap5[:, :, 0] * x5
        for j in range(1, J):
            prev = F.pad(x5[:, :-j], (0, 0, 0, 0, j, 0))  # slot t reads slot t-j; zeros before slot 0
            out = out + prev * base[j] + tap5[:, :, j] * prev
        return out.reshape(B, Q, H)

    def forward(self, sublayer, x_BQH):
        B, Q, _ = x_BQH.shape
        tap = self.kernel_projection(x_BQH).view(B, Q, 2, self.kernel_size, self.groups)
        y = sublayer(self.convolve(x_BQH, tap[:, :, 0], self.base_kernel[0]))
        return self.convolve(y, tap[:, :, 1], self.base_kernel[1])


class CandidateSelector(nn.Module):
    """DFlash2's drafting walk. A drafted slot's candidates are the top_k tokens of its logits z; after
    predecessor p, candidate c scores z_c + <predecessor_codebook[p] * hidden_projection(h), successor_codebook[c]>
    (h: the slot's final hidden state). The walk starts with p = the anchor token; each slot's pick is the next p."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, h_nH, unary_nK, cand_nK, prev_n):
        gate_nR = F.embedding(prev_n, self.predecessor_codebook) * self.hidden_projection(h_nH).to(
            self.predecessor_codebook.dtype)
        pair_nK = torch.einsum("nr,nkr->nk", gate_nR, F.embedding(cand_nK, self.successor_codebook))
        return unary_nK + pair_nK.to(unary_nK.dtype)

    def walk(self, h_BKH, logits_BKV, anchor_B, temperature: float = 0.0) -> torch.LongTensor:
        """The drafted tokens [B, K] of K slots: each slot's best candidate after the previous pick (or a sample of
        the softmax of its scores / temperature)."""
        unary_BKC, cand_BKC = logits_BKV.topk(self.top_k, dim=-1)
        prev_B, picks = anchor_B, []
        for k in range(h_BKH.shape[1]):
            s_BC = self.scores(h_BKH[:, k], unary_BKC[:, k], cand_BKC[:, k], prev_B)
            prev_B = cand_BKC[:, k].gather(-1, choose(s_BC, temperature)[:, None])[:, 0]
            picks.append(prev_B)
        return torch.stack(picks, dim=1)


def dflash2_setting(config, name: str) -> int:
    value = (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, None))
    if value is None:
        raise ValueError(f"DFlash2 drafter config lacks dflash_config.{name}")
    return int(value)


OTHER_CAUSAL_FIELDS = ("causal", "dflash_config.causal", "dflash_config.is_causal")  # (read by some engines only)


def causal_settings(config) -> dict:
    """{where: value} of the causality fields other than the top-level `is_causal` that the config sets."""
    dflash = dict(getattr(config, "dflash_config", None) or {})
    found = {}
    for where in OTHER_CAUSAL_FIELDS:
        value = dflash.get(where.split(".", 1)[1]) if where.startswith("dflash_config.") else getattr(config, where,
                                                                                                      None)
        if value is not None:
            found[where] = bool(value)
    return found


def block_causal_of(config) -> bool:
    """Whether sliding_attention layers are causal inside the block: the top-level `is_causal` where set (false:
    every layer sees the whole block, z-lab's DFlash2 drafters; z-lab, SGLang and vLLM all read it first), else True
    (their rule for sliding layers without it). `refuse_other_computations` has refused other fields saying else."""
    value = getattr(config, "is_causal", None)
    return True if value is None else bool(value)


def refuse_other_computations(config) -> None:
    """Refuse, in one line, a config field (top-level or in dflash_config) asking for a computation other than this
    file's, which would otherwise be ignored: `is_causal` true with full_attention layers (they see the whole block);
    another causality field (`causal`, `dflash_config.causal`, `dflash_config.is_causal`: z-lab and SGLang read only
    the top-level `is_causal`, vLLM reads `dflash_config.causal` after it) whose value would change what some engine
    computes; an `output_multiplier` other than 1; any `final_logit_softcapping` (z-lab's DFlash2 configs may carry
    them)."""
    dflash = dict(getattr(config, "dflash_config", None) or {})
    types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
    top = getattr(config, "is_causal", None)
    for where, value in causal_settings(config).items():
        effective = bool(top) if top is not None else all(t == SLIDING for t in types)  # (what every engine reads)
        if value != effective or (top is None and not value):
            raise ValueError(f"DFlash drafter config: {where}={value} while the top-level is_causal is "
                             f"{'absent' if top is None else top} (z-lab and SGLang read only is_causal, vLLM reads "
                             f"dflash_config.causal after it: the engines would compute different attention); set "
                             f"the top-level is_causal alone")
    per_layer = ("bidirectional inside the block in full_attention layers; in sliding_attention layers causal, or "
                 "bidirectional with is_causal false")

    def same_causal(v):  # false: every layer sees the whole block; true: what sliding layers compute anyway
        return not bool(v) or all(t == SLIDING for t in types)

    computed = {  # field: (does the value ask for this file's computation, what this file computes)
        "is_causal": (same_causal, per_layer),
        "output_multiplier": (lambda v: float(v) == 1.0, "no output multiplier"),
        "final_logit_softcapping": (lambda v: False, "no logit softcapping"),
    }
    for name, (same, does) in computed.items():
        for where, value in (("", getattr(config, name, None)), ("dflash_config.", dflash.get(name))):
            if name == "is_causal" and where:  # (checked above)
                continue
            if value is not None and not same(value):
                raise ValueError(f"DFlash drafter config: {where}{name}={value!r} asks for a computation this modeling "
                                 f"file does not do (it computes the drafter dflash_offline trains: {does}); load this "
                                 f"checkpoint with the modeling code it came with")


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 (z-lab format): the DFlash drafter with a `BlockConvolution` around every attention and MLP
    (`layers.{i}.attention_conv`, `layers.{i}.mlp_conv`) and a `CandidateSelector` (`candidate_selector`) that
    drafts; `forward` is DFlash's (final-normed block hidden states). Settings from `dflash_config`:
    conv_kernel_size, conv_group_size, selector_rank, selector_top_k. A config asking for another computation
    (`is_causal`, `output_multiplier`, `final_logit_softcapping`) is refused (`refuse_other_computations`), as for
    DFlash."""

    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        kernel, group = dflash2_setting(config, "conv_kernel_size"), dflash2_setting(config, "conv_group_size")
        for layer in self.layers:
            layer.attention_conv = BlockConvolution(config.hidden_size, kernel, group)
            layer.mlp_conv = BlockConvolution(config.hidden_size, kernel, group)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size,
                                                    dflash2_setting(config, "selector_rank"),
                                                    dflash2_setting(config, "selector_top_k"))
        self.post_init()

    def _init_weights(self, module):
        """transformers' init (every Linear ~ N(0, initializer_range), norms 1), except that each convolution is the
        identity: a fresh DFlash2 with a DFlash's weights computes what that DFlash computes. (Called on a module
        after its children: the convolution's kernel_projection is zeroed after its Linear init.)"""
        super()._init_weights(module)
        if isinstance(module, BlockConvolution):
            module.identity_init()

    @torch.no_grad()
    def draft_tokens(self, target_hidden, anchor_ids, past_key_values, embed_tokens, lm_head, block_size=None,
                     temperature: float = 0.0) -> torch.LongTensor:
        """The drafted tokens [B, L-1] of one drafting step: the selector's walk from the anchor."""
        logits, h = self.draft_block(target_hidden, anchor_ids, past_key_values, embed_tokens, lm_head, block_size,
                                     return_hidden=True)
        return self.candidate_selector.walk(h, logits, anchor_ids[:, 0], temperature)
