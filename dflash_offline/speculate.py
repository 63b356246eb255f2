"""Real speculative decoding: a DFlash drafter proposes blocks, the target verifies them; greedy and lossless.

    prefill   target(prompt) → tapped states of the prompt (drafter context) and the first greedy token g0 = anchor
    each step drafts  d_1..d_{L-1} = drafter(context, anchor)             (one drafter forward, block of L)
              verify  target([anchor, d_1..d_{L-1}]) with the KV cache    (ONE target forward, L tokens)
                      p_k = argmax of the target's logits after block token k (k = 0..L-1)
              accept  n = longest prefix with d_k == p_{k-1} (k = 1..n);  emit d_1..d_n and the bonus p_n
              τ = n + 1 tokens for this verify step; the anchor and d_1..d_n join the target cache and the drafter
              context (their tapped states come from the verify forward); p_n is the next anchor
    stop      after an eos token or max_new_tokens new tokens (the first token, from the prefill, counts)

Every emitted token is the target's own greedy choice given the emitted tokens before it, so the output equals
`greedy_generate` (the target alone, one token per forward) token for token; the only possible difference is
floating-point rounding between a block forward and token-by-token forwards flipping a near-tie.

Cache rollback after a partial acceptance (n < L-1: the verify forward wrote L-1-n rejected tokens):
- "crop" (every cache layer is a plain `DynamicLayer`, e.g. dense Qwen3): `cache.crop(-(L-1-n))` drops the
  rejected keys/values; exact, free.
- "refeed" (anything with recurrent state, e.g. Qwen3.5's Gated DeltaNet layers: their conv window and recurrent
  state have no per-token history and cannot be cropped): before the verify forward every linear-attention layer's
  conv and recurrent state is cloned and every attention layer's length recorded; after a partial acceptance the
  states are copied back, the attention layers cropped to their recorded length, and the accepted tokens
  [anchor, d_1..d_n] are fed again (one more target forward of n+1 tokens). A fully accepted block needs nothing.

Stats (`GenStats`; pooled over prompts by `summarize`):
- τ of a verify step = accepted drafts + 1 (1..L), counted before any truncation at eos/max_new_tokens;
  `tau_mean` = mean τ over verify steps (tokens per target verify step); `tau_hist[k-1]` = steps with τ = k.
- `emitted` per step = tokens actually appended (τ, or fewer at the very end); 1 + Σ emitted = new tokens.
- `target_forwards` = prefill + verify steps + refeeds; tok/s = new tokens / wall seconds (prefill included).

Shape legend: n context tokens, K = k·H tapped width, L block length, H hidden, V vocab, G kv heads, D head dim.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_offline.drafter import (
    DFlashDrafter,
    DrafterConfig,
    apply_rope,
    load_target_embeddings,
    rope_cos_sin,
)

# --- the drafter at serve time -----------------------------------------------------------------------------


class DraftCache:
    """Per-layer keys/values of the drafter's context (they depend only on the context token and its position)."""

    def __init__(self, num_layers: int):
        self.k = [None] * num_layers  # [1, n, G, D] per layer, RoPE applied
        self.v = [None] * num_layers
        self.length = 0


class Drafter:
    """A DFlash drafter with the target's frozen embedding and lm_head, drafting one block at a time (greedy)."""

    def __init__(self, model: DFlashDrafter, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor):
        self.model = model.eval()
        p = next(model.parameters())
        self.embed = embed_VH.to(p.device, p.dtype)
        self.lm_head = lm_head_VH.to(p.device, p.dtype)

    @property
    def cfg(self) -> DrafterConfig:
        return self.model.cfg

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def layer_ids(self) -> list[int]:
        return list(self.cfg.target_layer_ids)

    @classmethod
    def from_checkpoint(cls, ckpt_dir, target_dir, device="cpu", dtype=torch.float32) -> Drafter:
        """Load `ckpt_dir/model.safetensors` with the DrafterConfig of `ckpt_dir/meta.json` (config.drafter)."""
        from safetensors.torch import load_file

        ckpt_dir = Path(ckpt_dir)
        meta = json.loads((ckpt_dir / "meta.json").read_text())
        cfg = DrafterConfig(**meta["config"]["drafter"])
        model = DFlashDrafter(cfg)
        model.load_state_dict(load_file(str(ckpt_dir / "model.safetensors")), strict=True)
        return cls.from_model(model, target_dir, device, dtype)

    @classmethod
    def untrained(cls, cfg: DrafterConfig, target_dir, seed: int, device="cpu", dtype=torch.float32) -> Drafter:
        """A fresh drafter initialised exactly as the trainer's step 0 (`torch.manual_seed(seed)`, then build)."""
        torch.manual_seed(seed)
        return cls.from_model(DFlashDrafter(cfg), target_dir, device, dtype)

    @classmethod
    def from_model(cls, model: DFlashDrafter, target_dir, device="cpu", dtype=torch.float32) -> Drafter:
        embed, head = load_target_embeddings(target_dir)
        return cls(model.to(device, dtype), embed, head)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.model.layers))

    @torch.no_grad()
    def block_hidden(self, context_hidden_1nK: torch.Tensor, ids_1n1: torch.Tensor,
                     cache: DraftCache | None = None) -> torch.Tensor:
        """Final-normed block states [L, H] for the anchor ids[-1] at position n, context = positions 0..n-1.

        Without `cache`: `DFlashDrafter.forward` on the single row (the reference). With `cache`: the context's
        per-layer keys/values are kept in `cache` and only the new context positions are projected; the caller
        must pass the same growing context every time (as `speculative_generate` does).
        """
        n = context_hidden_1nK.shape[1]
        if ids_1n1.shape != (1, n + 1):
            raise ValueError(f"ids {tuple(ids_1n1.shape)} must be [1, n+1] for a context of n = {n} positions")
        m, dev = self.model, self.embed.device
        ids = ids_1n1.to(dev)
        anchor_BA, keep_BA = torch.tensor([[n]], device=dev), torch.ones(1, 1, dtype=torch.bool, device=dev)
        doc_BS = torch.zeros(1, n + 1, dtype=torch.long, device=dev)
        masks = m.build_masks(doc_BS, anchor_BA, keep_BA, "dense")  # [1, 1, L, (n+1) + L]; column n never visible
        if cache is None:
            ctx = context_hidden_1nK.to(dev)
            hidden = torch.cat([ctx, ctx.new_zeros(1, 1, ctx.shape[2])], 1)  # the anchor's own state: never seen
            pos = torch.arange(n + 1, device=dev)[None]
            return m(hidden, ids, pos, anchor_BA, keep_BA, self.embed, masks, "dense")[0]
        return self._cached_block(context_hidden_1nK.to(dev), ids, masks, cache)

    def _cached_block(self, ctx_hidden_1nK, ids_1n1, masks, cache: DraftCache) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        n, L, D = ctx_hidden_1nK.shape[1], cfg.block_size, cfg.head_dim
        dtype, dev = self.embed.dtype, self.embed.device
        if n < cache.length:
            raise ValueError(f"context shrank from {cache.length} to {n} positions: use a new DraftCache")
        if n > cache.length:  # project the new context positions once, for every layer
            ctx = m.hidden_norm(m.fc(ctx_hidden_1nK[:, cache.length:].to(dtype)))
            rope = rope_cos_sin(torch.arange(cache.length, n, device=dev)[None], D, cfg.rope_theta, dtype)
            for i, layer in enumerate(m.layers):
                k, v = layer.self_attn._kv(ctx, rope)
                cache.k[i] = k if cache.k[i] is None else torch.cat([cache.k[i], k], 1)
                cache.v[i] = v if cache.v[i] is None else torch.cat([cache.v[i], v], 1)
            cache.length = n
        keep_cols = torch.arange(n + 1 + L, device=dev) != n  # drop the anchor's own context column
        x = F.embedding(torch.cat([ids_1n1[:, -1:], torch.full((1, L - 1), cfg.mask_token_id, device=dev)], 1),
                        self.embed).to(dtype)
        rope_blk = rope_cos_sin(torch.arange(n, n + L, device=dev)[None], D, cfg.rope_theta, dtype)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(1, L, a.n_heads, D)), *rope_blk)
            kb, vb = a._kv(h, rope_blk)
            k = torch.cat([cache.k[i], kb], 1) if n else kb
            v = torch.cat([cache.v[i], vb], 1) if n else vb
            mask = masks[layer.layer_type][..., keep_cols]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, scale=D**-0.5, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, L, a.n_heads * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)[0]

    @torch.no_grad()
    def draft(self, context_hidden_1nK: torch.Tensor, ids_1n1: torch.Tensor, block_size: int | None = None,
              cache: DraftCache | None = None) -> torch.Tensor:
        """Greedy drafts [block_size-1] (int64) for slots 1..block_size-1 after the anchor ids[-1].

        The context is the tapped target states of positions 0..n-1 (the anchor's own state is not visible:
        strictly-before rule); `block_size` may be smaller than the trained block (the first slots are kept).
        """
        L = block_size or self.block_size
        if not 2 <= L <= self.block_size:
            raise ValueError(f"block_size must be in 2..{self.block_size} (the drafter's block), got {L}")
        h_LH = self.block_hidden(context_hidden_1nK, ids_1n1, cache)
        return (h_LH[1:L] @ self.lm_head.t()).argmax(-1)


# --- the target ------------------------------------------------------------------------------------------------


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _forward(target, ids_1T: torch.Tensor, start: int, cache, layer_ids, logits_to_keep: int):
    """(logits [T', V], tapped states [1, T, K] in `layer_ids` order or None) of one cached target forward."""
    pos = torch.arange(start, start + ids_1T.shape[1], device=ids_1T.device)[None]
    out = target(input_ids=ids_1T, position_ids=pos, past_key_values=cache, use_cache=True,
                 output_hidden_states=bool(layer_ids), logits_to_keep=logits_to_keep)
    hid = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1) if layer_ids else None
    return out.logits[0], hid


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _as_ids(prompt_ids, dev) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids


def rollback_kind(cache) -> str:
    """"crop" if every layer of `cache` is a plain DynamicLayer (croppable exactly), else "refeed"."""
    from transformers.cache_utils import DynamicLayer

    return "crop" if all(type(layer) is DynamicLayer for layer in cache.layers) else "refeed"


def snapshot(cache) -> list[dict]:
    """What `restore` needs to put `cache` back: clones of recurrent/conv states, lengths of attention layers."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    snap = []
    for layer in cache.layers:
        s = {}
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            s["conv"] = {i: t.clone() for i, t in layer.conv_states.items() if t is not None}
            s["rec"] = {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None}
            s["has_prev"] = dict(layer.has_previous_state)
        if isinstance(layer, DynamicLayer):
            if type(layer) is not DynamicLayer and not isinstance(layer, LinearAttentionCacheLayerMixin):
                raise NotImplementedError(f"cache layer {type(layer).__name__} (sliding window?) cannot be rolled back")
            s["len"] = layer.get_seq_length() if layer.is_initialized else 0
        snap.append(s)
    return snap


def restore(cache, snap: list[dict]) -> None:
    for layer, s in zip(cache.layers, snap, strict=True):
        for i, t in s.get("conv", {}).items():
            layer.conv_states[i].copy_(t)  # in place: keeps the static addresses transformers marks
        for i, t in s.get("rec", {}).items():
            layer.recurrent_states[i].copy_(t)
        if "has_prev" in s:
            layer.has_previous_state.update(s["has_prev"])
        if "len" in s and layer.is_initialized:
            extra = layer.get_seq_length() - s["len"]
            if extra > 0:
                layer.crop(-extra)


# --- stats -----------------------------------------------------------------------------------------------------


@dataclass
class GenStats:
    block_size: int  # L (1 for the target alone)
    prompt_tokens: int = 0
    new_tokens: int = 0  # generated tokens returned (the prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # per verify step: drafts accepted n, τ = n + 1
    emitted: list[int] = field(default_factory=list)  # per verify step: tokens appended (≤ τ at the end)
    target_forwards: int = 0  # prefill + verify steps (+ refeeds)
    refeeds: int = 0  # extra target forwards that re-fed accepted tokens after a rollback
    rollback: str = ""  # "crop", "refeed" (speculative) or "" (target alone)
    prefill_s: float = 0.0
    seconds: float = 0.0  # wall time of the whole call, prefill included

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tau_mean(self) -> float:
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else float("nan")

    @property
    def tau_hist(self) -> list[int]:
        """tau_hist[k-1] = verify steps with τ = k, k = 1..L."""
        h = [0] * self.block_size
        for n in self.accepted:
            h[n] += 1
        return h

    @property
    def tok_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "steps": self.steps, "tau_mean": self.tau_mean, "tau_hist": self.tau_hist,
                "tok_per_s": self.tok_per_s}


def summarize(stats: list[GenStats]) -> dict:
    """Pooled over generations: τ over all verify steps, summed histogram, tok/s = Σ tokens / Σ seconds."""
    L = max((s.block_size for s in stats), default=1)
    steps = sum(s.steps for s in stats)
    hist = [0] * L
    for s in stats:
        for k, c in enumerate(s.tau_hist):
            hist[k] += c
    tokens, secs = sum(s.new_tokens for s in stats), sum(s.seconds for s in stats)
    return {
        "generations": len(stats), "new_tokens": tokens, "seconds": secs, "steps": steps,
        "tau_mean": sum((k + 1) * c for k, c in enumerate(hist)) / steps if steps else float("nan"),
        "tau_hist": hist, "tok_per_s": tokens / secs if secs > 0 else float("nan"),
        "target_forwards": sum(s.target_forwards for s in stats), "refeeds": sum(s.refeeds for s in stats),
    }


# --- generation ------------------------------------------------------------------------------------------------


def _eos_set(eos_ids) -> set[int]:
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def greedy_generate(target, prompt_ids, max_new_tokens: int, eos_ids=None) -> tuple[list[int], GenStats]:
    """The target alone: prefill, then one token per cached forward; stops after eos or max_new_tokens."""
    dev, eos = _device(target), _eos_set(eos_ids)
    ids = _as_ids(prompt_ids, dev)
    _check_budget(max_new_tokens)
    st = GenStats(block_size=1, prompt_tokens=ids.shape[1])
    _sync(dev)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    logits, _ = _forward(target, ids, 0, cache, None, 1)
    out = [int(logits[-1].argmax())]
    st.target_forwards = 1
    _sync(dev)
    st.prefill_s = time.perf_counter() - t0
    pos = ids.shape[1]
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits, _ = _forward(target, torch.tensor([[out[-1]]], device=dev), pos, cache, None, 1)
        out.append(int(logits[-1].argmax()))
        pos += 1
        st.target_forwards += 1
        st.accepted.append(0)
        st.emitted.append(1)
    _sync(dev)
    st.seconds = time.perf_counter() - t0
    st.new_tokens = len(out)
    return out, st


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens: int, eos_ids=None,
                         rollback: str = "auto") -> tuple[list[int], GenStats]:
    """Greedy speculative decoding of `target` with `drafter` (see the module doc); returns (new tokens, stats).

    `drafter` needs `block_size`, `layer_ids` (the tapped target layers, in its context's column order) and
    `draft(context_hidden_1nK, ids_1n1, block_size, cache)`; `new_cache()` if it keeps one. `rollback`:
    "auto" (crop when the cache allows it exactly, else refeed), "crop" or "refeed".
    """
    if rollback not in ("auto", "crop", "refeed"):
        raise ValueError(f"rollback must be 'auto', 'crop' or 'refeed', got {rollback!r}")
    dev, eos, L, layer_ids = _device(target), _eos_set(eos_ids), drafter.block_size, list(drafter.layer_ids)
    ids = _as_ids(prompt_ids, dev)
    _check_budget(max_new_tokens)
    P = ids.shape[1]
    st = GenStats(block_size=L, prompt_tokens=P)
    _sync(dev)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    logits, ctx = _forward(target, ids, 0, cache, layer_ids, 1)
    out = [int(logits[-1].argmax())]
    st.target_forwards = 1
    kind = rollback_kind(cache) if rollback == "auto" else rollback
    if kind == "crop" and rollback_kind(cache) != "crop":
        raise ValueError("this target's cache has recurrent/sliding layers that cannot be cropped: use rollback=refeed")
    st.rollback = kind
    dcache = drafter.new_cache() if hasattr(drafter, "new_cache") else None
    seq = torch.cat([ids, torch.tensor([out], device=dev)], 1)  # prompt + emitted; the last one is the anchor
    _sync(dev)
    st.prefill_s = time.perf_counter() - t0
    pos = P  # position of the anchor = tokens in the target cache
    while len(out) < max_new_tokens and out[-1] not in eos:
        drafts = drafter.draft(ctx, seq, L, cache=dcache).to(dev).long()
        block = torch.cat([seq[:, -1], drafts])[None]
        snap = snapshot(cache) if kind == "refeed" else None
        logits, hid = _forward(target, block, pos, cache, layer_ids, 0)
        both = torch.cat([drafts, logits.argmax(-1)]).tolist()  # the step's one device → host sync
        d, pred = both[: L - 1], both[L - 1:]  # pred[k] = the target's token after block token k
        n = next((k for k in range(L - 1) if d[k] != pred[k]), L - 1)
        if n < L - 1:  # roll the cache back to [.., anchor, d_1..d_n]
            if kind == "crop":
                cache.crop(-(L - 1 - n))
            else:
                restore(cache, snap)
                _forward(target, block[:, : n + 1], pos, cache, None, 1)
                st.refeeds += 1
                st.target_forwards += 1
        st.target_forwards += 1
        ctx = torch.cat([ctx, hid[:, : n + 1]], 1)
        new = d[:n] + [pred[n]]
        st.accepted.append(n)
        emitted = 0
        for t in new:
            out.append(t)
            emitted += 1
            if t in eos or len(out) >= max_new_tokens:
                break
        st.emitted.append(emitted)
        seq = torch.cat([seq, torch.tensor([new[:emitted]], device=dev)], 1)
        pos += n + 1
    _sync(dev)
    st.seconds = time.perf_counter() - t0
    st.new_tokens = len(out)
    return out, st
