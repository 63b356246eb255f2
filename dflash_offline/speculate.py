"""Real speculative decoding with the exported drafter: the shipped `dflash.py` drafts, the target verifies.

    prefill   target(prompt) → tapped states of the prompt (the drafter's first context) and the first greedy token
              g0 = the anchor
    each step draft   d_1..d_{L-1} = `draft_tokens(new context, anchor)` of the shipped drafter (DFlash: each
                      slot's argmax; DFlash2: its selector's walk from the anchor, as the engines draft)
              verify  target([anchor, d_1..d_{L-1}]) with the KV cache    (ONE target forward, L tokens)
                      p_k = argmax of the target's logits after block token k (k = 0..L-1)
              accept  n = longest prefix with d_k == p_{k-1} (k = 1..n);  emit d_1..d_n and the bonus p_n
              τ = n + 1 tokens for this verify step; the tapped states of [anchor, d_1..d_n] (from the verify
              forward) are the drafter's next new context; p_n is the next anchor
    stop      after an eos token or max_new_tokens new tokens (the first token, from the prefill, counts)

Every emitted token is the target's own greedy choice given the emitted tokens before it, so the output equals
`greedy_generate` (the target alone, one token per forward) token for token; the only possible difference is
floating-point rounding between a block forward and token-by-token forwards flipping a near-tie (bf16).

Who owns what: the drafter is the artifact users load. `load_exported` opens an export directory through
`AutoModel.from_pretrained(..., trust_remote_code=True)` (its `dflash.py`, checked against the weights' SHA-256 in
the export's provenance) and `ExportedDrafter` calls its `draft_tokens`, the same drafting step as its own
`spec_generate`, with the target's embedding and lm_head (a replay drafting many anchors at once calls the shipped
model's forward, with a row and a mask per anchor: the one place it assembles a drafting step itself). Else this
module has no drafter code of its own: it is the engine's side — verification, acceptance, cache rollback, timing —
which engines implement themselves too.
(`spec_generate` in dflash.py recomputes a hybrid target over the whole sequence at every block; here the target's
cache is rolled back instead, which gives the same tokens and τ at an engine's cost per step.)

Cache rollback after a partial acceptance (n < L-1: the verify forward wrote L-1-n rejected tokens):
- "crop" (every cache layer is a plain `DynamicLayer`, e.g. dense Qwen3): `cache.crop(-(L-1-n))` drops the
  rejected keys/values; exact, free.
- "refeed" (anything with recurrent state, e.g. Qwen3.5's Gated DeltaNet layers: their conv window and recurrent
  state have no per-token history and cannot be cropped): before the verify forward every linear-attention layer's
  conv and recurrent state is cloned and every attention layer's length recorded; after a partial acceptance the
  states are copied back, the attention layers cropped to their recorded length, and the accepted tokens
  [anchor, d_1..d_n] are fed again (one more target forward of n+1 tokens). A fully accepted block needs nothing.
  Engines keep per-token recurrent states instead, so the refeed is timed apart (`rollback_ms`).

Stats (`GenStats`; pooled over prompts by `summarize`):
- τ of a verify step = accepted drafts + 1 (1..L), counted before any truncation at eos/max_new_tokens;
  `tau_mean` = mean τ over verify steps (tokens per target verify step); `tau_hist[k-1]` = steps with τ = k;
  `accept_ge[k-1]` = share of verify steps that accepted at least k drafts (k = 1..L-1; τ = 1 + Σ accept_ge).
- `emitted` per step = tokens actually appended (τ, or fewer at the very end); 1 + Σ emitted = new tokens;
  `tau_emitted` = Σ emitted / verify steps: the tokens the verify steps gave (τ without the credit of the drafts a
  last step accepted past eos or max_new_tokens: τ as z-lab reports it overstates short budgets, e.g. by ~10 % with
  blocks of 16, 40 new tokens and 85 % per-slot acceptance).
- `target_forwards` = prefill + verify steps + refeeds; tok/s = new tokens / wall seconds (prefill included).
- per step: `draft_ms` (draft_tokens: draft_block + argmax or the selector walk), `verify_ms` (the verify forward + argmax + the host sync; for the
  target alone: one token's forward), `rollback_ms` (snapshot, restore, refeed). CUDA events on a GPU (read once at
  the end of a generation, no extra syncs), `time.perf_counter` on a CPU.

Shape legend: S new context tokens, K = k·H tapped width, L block length, V vocab.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash_offline.cache.fsio import sha256_file

# --- the drafter: the shipped artifact ------------------------------------------------------------------------


def read_export(export_dir) -> dict:
    """The provenance of an export directory (`dflash_export.json`), its weights checked against their SHA-256."""
    from dflash_offline.export import FILES, PROVENANCE

    d = Path(export_dir)
    missing = [f for f in FILES if not (d / f).is_file()]
    if missing:
        raise ValueError(f"{d} is not a z-lab export (no {', '.join(missing)}): pass EXPORT= a directory written by "
                         f"make export, or leave it empty to export the run first")
    prov = json.loads((d / PROVENANCE).read_text())
    sha = sha256_file(d / "model.safetensors")
    if sha != prov.get("weights_sha256"):
        raise ValueError(f"{d}/model.safetensors (sha256 {sha[:12]}…) is not the file its {PROVENANCE} records "
                         f"({str(prov.get('weights_sha256'))[:12]}…): it changed after the export; export again")
    return prov


def shipped_modeling_sha256() -> str:
    """The SHA-256 of the dflash.py this version exports (its modeling code)."""
    from dflash_offline.export import modeling_source

    return hashlib.sha256(modeling_source().encode()).hexdigest()


def check_modeling_code(d: Path, prov: dict, trust_code: bool = False, log=print) -> str:
    """The SHA-256 of the export's dflash.py, which loading runs as code on this machine: refused unless it is the
    modeling code this version ships (or `trust_code`), saying whether it changed after the export."""
    from dflash_offline.export import MODELING_FILE

    sha, shipped = sha256_file(d / MODELING_FILE), shipped_modeling_sha256()
    if sha == shipped:
        return sha
    recorded = prov.get("modeling_sha256")
    why = "it changed after the export" if recorded and recorded != sha else "written by another version"
    if not trust_code:
        raise ValueError(f"{d}/{MODELING_FILE} (sha256 {sha[:12]}…) is not the modeling code this version ships "
                         f"({shipped[:12]}…; {why}) and loading it runs it: export the run again (make export), or "
                         f"pass --trust_code=1 (make eval ARGS=--trust_code=1) if you trust that file")
    log(f"--trust_code=1: running {d}/{MODELING_FILE} (sha256 {sha[:12]}…), not this version's modeling code ({why})")
    return sha


def load_exported(export_dir, device="cpu", dtype=torch.float32, trust_code: bool = False):
    """(model, artifact): the export's `DFlashDraftModel` loaded as users load it (`AutoModel.from_pretrained(...,
    trust_remote_code=True)`, i.e. its own dflash.py) in `dtype` on `device`, and what identifies it. Its dflash.py
    must be this version's shipped modeling code unless `trust_code` (it runs as code here)."""
    from transformers import AutoModel

    d = Path(export_dir).resolve()
    prov = read_export(d)
    modeling_sha = check_modeling_code(d, prov, trust_code)
    model = AutoModel.from_pretrained(str(d), trust_remote_code=True, dtype=dtype).to(device).eval()
    code = Path(inspect.getfile(type(model)))
    if code.read_bytes() != (d / "dflash.py").read_bytes():
        raise ValueError(f"AutoModel loaded {type(model).__name__} from {code}, not from {d}/dflash.py")
    if not hasattr(model, "draft_block"):
        raise ValueError(f"{d}/dflash.py has no draft_block (an export of an older version): export the run again")
    artifact = {"path": str(d), "weights_sha256": prov["weights_sha256"],
                "modeling_sha256": modeling_sha, "run": prov.get("run"), "step": prov.get("step"),
                "checkpoint": prov.get("checkpoint"), "export_dtype": prov.get("dtype"), "target": prov.get("target")}
    return model, artifact


def untrained_model(drafter_cfg, target_dir, seed: int, device="cpu", dtype=torch.float32, projections=None):
    """(model, artifact): the shipped modeling code (dflash_offline/zlab_dflash.py, exported as dflash.py) holding a
    fresh drafter's weights, initialised as the trainer's step 0 (`torch.manual_seed(seed)`, then build). A drafter
    of projected taps (`tap_width`) is folded with `projections` (P of each tap) into the full-width one, as export
    folds a trained one."""
    import dataclasses

    from transformers import Qwen3Config

    from dflash_offline import zlab_dflash
    from dflash_offline.drafter import DFlashDrafter
    from dflash_offline.export import target_fields, zlab_config

    torch.manual_seed(seed)
    weights = DFlashDrafter(drafter_cfg).state_dict()
    if drafter_cfg.tap_width:
        from dflash_offline.projection import fold_state

        if projections is None:
            raise ValueError(f"the drafter reads {drafter_cfg.tap_width} values a tap (projected taps): pass the "
                             f"cache's projections to fold it")
        weights, drafter_cfg = fold_state(weights, projections), dataclasses.replace(drafter_cfg, tap_width=0)
    config = Qwen3Config.from_dict(zlab_config(drafter_cfg, target_fields(str(target_dir)), "float32"))
    with torch.device("meta"):  # no second initialisation: the weights come next
        model = getattr(zlab_dflash, config.architectures[0])(config)  # DFlashDraftModel or DFlash2DraftModel
    model.load_state_dict(weights, strict=True, assign=True)
    code = Path(zlab_dflash.__file__)
    artifact = {"path": None, "untrained_seed": seed, "modeling_file": str(code), "modeling_sha256": sha256_file(code)}
    return model.to(device, dtype).eval(), artifact


class ExportedDrafter:
    """Greedy drafting with the shipped model's `draft_tokens` (DFlash: argmax of each slot's logits; DFlash2: the
    candidate selector's walk from the anchor), using the target's own embedding and lm_head (as the engines do).
    The interface `speculative_generate` needs: `block_size`, `layer_ids`, `start()` (a new sequence) and
    `draft(ctx_new_1SK, anchor_11, pos, block_size)` → drafts [block_size-1]."""

    def __init__(self, model, target):
        self.model = model.eval()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.block_size, self.layer_ids = int(model.block_size), list(model.target_layer_ids)
        self.cache = None

    def start(self) -> None:
        self.cache = self.model.draft_cache()

    def draft(self, ctx_new_1SK: torch.Tensor, anchor_11: torch.Tensor, pos: int, block_size: int) -> torch.Tensor:
        assert self.cache.get_seq_length() + ctx_new_1SK.shape[1] == pos, "new context does not end at the anchor"
        return self.model.draft_tokens(ctx_new_1SK, anchor_11, self.cache, self.embed, self.lm_head, block_size)[0]

    # --- a replay's drafts at many anchors at once (`replay_generate(anchors_at_once=N)`)

    @torch.no_grad()
    def start_replay(self, ctx_1TK: torch.Tensor, tokens_1T: torch.Tensor) -> None:
        """A known sequence `tokens_1T` to draft along: the keys and values of its context positions (the T tapped
        states given) computed in one drafting call, as a decode's first step computes a prompt's."""
        self.tokens, self.cache = tokens_1T, self.model.draft_cache()
        self.model.draft_block(ctx_1TK, tokens_1T[:, :1], self.cache, self.embed, self.lm_head)  # (block dropped)

    def draft_anchors(self, anchors: list[int], block_size: int) -> list[list[int]]:
        """The drafts a decode's step makes at each anchor position in `anchors` (its token `tokens[a]`, its context
        every position before `a`), in batched forwards of the shipped model: a row per anchor, its block's queries
        seeing the context keys before its anchor (through the model's own masks for sliding layers) and its own
        block, as `draft_tokens` computes them at that step — the same drafts but for float rounding (float32: the
        masked context keys add exact zeros; in bfloat16 the sums round otherwise). As many rows a forward as keep
        each layer's keys, expanded to every head, within `REPLAY_ELEMENTS`."""
        c = self.model.config
        rows = max(1, REPLAY_ELEMENTS // ((self.cache.get_seq_length() + block_size) * c.num_attention_heads
                                          * c.head_dim))
        return [d for i in range(0, len(anchors), rows) for d in self._draft_rows(anchors[i:i + rows], block_size)]

    @torch.no_grad()
    def _draft_rows(self, anchors: list[int], block_size: int) -> list[list[int]]:
        m, dev, L = self.model, self.tokens.device, block_size
        a_B, T = torch.tensor(anchors, device=dev), self.cache.get_seq_length()
        if int(a_B.max()) > T:
            raise ValueError(f"anchor at {int(a_B.max())}: the replay's context holds {T} positions")
        block_BL = torch.full((len(anchors), L), m.mask_token_id, dtype=torch.long, device=dev)
        block_BL[:, 0] = self.tokens[0, a_B]
        pos_BL = a_B[:, None] + torch.arange(L, device=dev)
        ctx_pos_BT = torch.arange(T, device=dev).expand(len(anchors), T)
        seen_B1LK = torch.cat([ctx_pos_BT < a_B[:, None], torch.ones_like(pos_BL, dtype=torch.bool)], 1)[:, None,
                                                                                                          None]
        seen_B1LK = seen_B1LK.expand(-1, -1, L, -1)
        masks = {kind: seen_B1LK if mask is None else mask & seen_B1LK
                 for kind, mask in m.default_masks(torch.cat([ctx_pos_BT, pos_BL], 1), L).items()}
        h_BLH = m(position_ids=pos_BL, noise_embedding=self.embed(block_BL), past_key_values=_SharedContext(
            self.cache, len(anchors)), attention_mask=masks)[:, 1:]
        logits = self.lm_head(h_BLH)
        if hasattr(m, "candidate_selector"):  # DFlash2 drafts by its selector's walk (its `draft_tokens`)
            return m.candidate_selector.walk(h_BLH, logits, block_BL[:, 0]).tolist()
        return logits.argmax(-1).tolist()  # (DFlash's `draft_tokens` at temperature 0)


# the most key elements (rows × keys × heads × head dim) a batched drafting forward holds a layer: 1 GiB in float32
# (attention with a mask and grouped keys expands them to every head)
REPLAY_ELEMENTS = 1 << 28


class _SharedContext:
    """One sequence's context keys and values ([1, G, T, D] a layer) before every row's block keys and values: the
    cache a batch of blocks at different anchors reads (their masks hide what is past each one's anchor)."""

    def __init__(self, cache, rows: int):
        self.cache, self.rows = cache, rows

    def update(self, k, v, layer_idx: int, *args, **kwargs):
        kc, vc = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        return (torch.cat([kc.expand(self.rows, -1, -1, -1), k], 2),
                torch.cat([vc.expand(self.rows, -1, -1, -1), v], 2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)


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


class PhaseTimer:
    """Milliseconds between marks, per step: CUDA events on a GPU (resolved once, after the generation's last sync;
    the time the stream spends between two marks, launch gaps included), `time.perf_counter` on a CPU."""

    def __init__(self, dev: torch.device):
        self.cuda, self.steps = dev.type == "cuda", []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self, *marks) -> None:
        self.steps.append(marks)

    def spans_ms(self) -> list[list[float]]:
        """Per step, the spans between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
        span = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: (b - a) * 1e3)
        return [[span(a, b) for a, b in zip(m, m[1:], strict=False)] for m in self.steps]


@dataclass
class GenStats:
    block_size: int  # L (1 for the target alone)
    prompt_tokens: int = 0
    new_tokens: int = 0  # generated tokens returned (the prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # per verify step: drafts accepted n, τ = n + 1
    emitted: list[int] = field(default_factory=list)  # per verify step: tokens appended (≤ τ at the end)
    draft_ms: list[float] = field(default_factory=list)  # per verify step: drafting (none for the target alone)
    verify_ms: list[float] = field(default_factory=list)  # per step: the target forward (L tokens, or 1 alone)
    rollback_ms: list[float] = field(default_factory=list)  # per verify step: snapshot + restore + refeed
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
    def tau_emitted(self) -> float:
        return sum(self.emitted) / self.steps if self.steps else float("nan")

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
        return {**asdict(self), "steps": self.steps, "tau_mean": self.tau_mean, "tau_emitted": self.tau_emitted,
                "tau_hist": self.tau_hist, "tok_per_s": self.tok_per_s}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(stats: list[GenStats]) -> dict:
    """Pooled over generations: τ over all verify steps, summed histogram, share of steps accepting ≥ k drafts,
    mean ms per step of each phase, tok/s = Σ tokens / Σ seconds."""
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
        "tau_emitted": sum(sum(s.emitted) for s in stats) / steps if steps else float("nan"),
        "tau_hist": hist, "accept_ge": [sum(hist[k:]) / steps if steps else float("nan") for k in range(1, L)],
        "tok_per_s": tokens / secs if secs > 0 else float("nan"),
        "target_forwards": sum(s.target_forwards for s in stats), "refeeds": sum(s.refeeds for s in stats),
        **{k: _mean([x for s in stats for x in getattr(s, k)]) for k in ("draft_ms", "verify_ms", "rollback_ms")},
    }


# --- generation ------------------------------------------------------------------------------------------------


def _eos_set(eos_ids) -> set[int]:
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def _emit(out: list[int], tokens: list[int], eos: set[int], max_new_tokens: int) -> int:
    """Append a verify step's tokens to `out` up to eos or the budget; returns how many were appended."""
    for k, t in enumerate(tokens):
        out.append(t)
        if t in eos or len(out) >= max_new_tokens:
            return k + 1
    return len(tokens)


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def greedy_generate(target, prompt_ids, max_new_tokens: int, eos_ids=None) -> tuple[list[int], GenStats]:
    """The target alone: prefill, then one token per cached forward; stops after eos or max_new_tokens."""
    dev, eos = _device(target), _eos_set(eos_ids)
    ids = _as_ids(prompt_ids, dev)
    _check_budget(max_new_tokens)
    st, timer = GenStats(block_size=1, prompt_tokens=ids.shape[1]), PhaseTimer(dev)
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
        m0 = timer.mark()
        logits, _ = _forward(target, torch.tensor([[out[-1]]], device=dev), pos, cache, None, 1)
        out.append(int(logits[-1].argmax()))
        timer.step(m0, timer.mark())
        pos += 1
        st.target_forwards += 1
        st.accepted.append(0)
        st.emitted.append(1)
    _sync(dev)
    st.seconds = time.perf_counter() - t0
    st.new_tokens = len(out)
    st.verify_ms = [s[0] for s in timer.spans_ms()]
    return out, st


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens: int, eos_ids=None,
                         rollback: str = "auto") -> tuple[list[int], GenStats]:
    """Greedy speculative decoding of `target` with `drafter` (see the module doc); returns (new tokens, stats).

    `drafter`: an `ExportedDrafter` (or anything with its interface). `rollback`: "auto" (crop when the cache allows
    it exactly, else refeed), "crop" or "refeed".
    """
    if rollback not in ("auto", "crop", "refeed"):
        raise ValueError(f"rollback must be 'auto', 'crop' or 'refeed', got {rollback!r}")
    dev, eos, L, layer_ids = _device(target), _eos_set(eos_ids), drafter.block_size, list(drafter.layer_ids)
    ids = _as_ids(prompt_ids, dev)
    _check_budget(max_new_tokens)
    P = ids.shape[1]
    st, timer = GenStats(block_size=L, prompt_tokens=P), PhaseTimer(dev)
    _sync(dev)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    logits, ctx = _forward(target, ids, 0, cache, layer_ids, 1)  # ctx: tapped states the drafter has not seen
    out = [int(logits[-1].argmax())]
    st.target_forwards = 1
    kind = rollback_kind(cache) if rollback == "auto" else rollback
    if kind == "crop" and rollback_kind(cache) != "crop":
        raise ValueError("this target's cache has recurrent/sliding layers that cannot be cropped: use rollback=refeed")
    st.rollback = kind
    drafter.start()
    anchor = torch.tensor([out], device=dev)  # [1, 1]
    _sync(dev)
    st.prefill_s = time.perf_counter() - t0
    pos = P  # position of the anchor = tokens in the target cache
    while len(out) < max_new_tokens and out[-1] not in eos:
        m0 = timer.mark()
        drafts = drafter.draft(ctx, anchor, pos, L).to(dev).long()
        m1 = timer.mark()
        snap = snapshot(cache) if kind == "refeed" else None
        m2 = timer.mark()
        block = torch.cat([anchor[0], drafts])[None]
        logits, hid = _forward(target, block, pos, cache, layer_ids, 0)
        pred_dev = logits.argmax(-1)
        both = torch.cat([drafts, pred_dev]).tolist()  # the step's one device → host sync
        m3 = timer.mark()
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
        timer.step(m0, m1, m2, m3, timer.mark())
        st.target_forwards += 1
        ctx, anchor = None if hid is None else hid[:, : n + 1], pred_dev[n:n + 1][None]
        st.accepted.append(n)
        st.emitted.append(_emit(out, d[:n] + [pred[n]], eos, max_new_tokens))
        pos += n + 1
    _sync(dev)
    st.seconds = time.perf_counter() - t0
    st.new_tokens = len(out)
    spans = timer.spans_ms()  # per step: draft, snapshot, verify, rollback
    st.draft_ms = [s[0] for s in spans]
    st.verify_ms = [s[2] for s in spans]
    st.rollback_ms = [s[1] + s[3] for s in spans]
    return out, st


@torch.no_grad()
def replay_generate(target, drafter, prompt_ids, greedy: list[int], max_new_tokens: int,
                    eos_ids=None, anchors_at_once: int = 0) -> tuple[list[int], GenStats]:
    """The verify steps `speculative_generate` would take, replayed on the target's known greedy output `greedy`
    (`greedy_generate`'s, same budget and eos) instead of verified by the target: ONE target forward over prompt +
    `greedy` gives every tapped state, then the drafter drafts step after step exactly as in a real decode (same
    calls, same new context, same anchors) and a step accepts the drafts that equal `greedy`'s next tokens.

    Why that is the decode's τ: a verify step accepts d_k only while d_1..d_k equal the target's own greedy tokens,
    so the target's predictions it uses are `greedy`'s tokens, and the drafter's next context is the tapped states of
    those same tokens (here from one forward instead of the verify forwards: equal but for float rounding). Hence
    the same steps, accepted counts and emitted tokens — except that a last step's drafts past eos or the budget are
    not checked (the target's tokens there are unknown): `accepted` of the last step may be lower than the decode's,
    `emitted` and `tau_emitted` are exact. Costs one target forward per prompt instead of one or two per step;
    there are no speed figures (`verify_ms`, `rollback_ms` empty) and no lossless check (the output is `greedy`).

    `anchors_at_once=N` (a drafter with `draft_anchors`): where the walk reaches an anchor not drafted yet, the
    drafts at it and the N-1 positions after it come from one batched forward (`ExportedDrafter.draft_anchors`)
    instead of a drafting call a step; the drafts are equal but for float rounding (a flipped near-tie changes a
    step), so the steps are those of the decode as the sequential replay's are; `draft_ms` is then empty.
    """
    dev, eos, L, layer_ids = _device(target), _eos_set(eos_ids), drafter.block_size, list(drafter.layer_ids)
    ids = _as_ids(prompt_ids, dev)
    _check_budget(max_new_tokens)
    greedy = [int(t) for t in greedy]
    if not greedy or len(greedy) > max_new_tokens or any(t in eos for t in greedy[:-1]) or (
            len(greedy) < max_new_tokens and greedy[-1] not in eos):
        raise ValueError(f"replay needs the target's greedy output for this budget ({max_new_tokens} new tokens, eos "
                         f"{sorted(eos)}): {len(greedy)} tokens given that neither end at eos nor fill the budget")
    P = ids.shape[1]
    st, timer = GenStats(block_size=L, prompt_tokens=P, rollback="replay"), PhaseTimer(dev)
    _sync(dev)
    t0 = time.perf_counter()
    seq = torch.cat([ids, torch.tensor([greedy], device=dev)], 1)
    _, hid = _forward(target, seq, 0, _new_cache(target), layer_ids, 1)
    st.target_forwards = 1
    drafter.start()
    out, ctx, pos = greedy[:1], hid[:, :P], P  # pos: the anchor's position
    batched, drafts, last = anchors_at_once > 0 and len(greedy) > 1, {}, P + len(greedy) - 1  # (anchors < last)
    if batched:
        drafter.start_replay(hid[:, : last - 1], seq)  # (the last anchor's context)
    _sync(dev)
    st.prefill_s = time.perf_counter() - t0
    while len(out) < max_new_tokens and out[-1] not in eos:
        if batched:
            if pos not in drafts:
                anchors = list(range(pos, min(pos + anchors_at_once, last)))
                drafts.update(zip(anchors, drafter.draft_anchors(anchors, L), strict=True))
            d = drafts[pos]
        else:
            m0 = timer.mark()
            d = drafter.draft(ctx, torch.tensor([[out[-1]]], device=dev), pos, L).tolist()
            timer.step(m0, timer.mark())
        truth = greedy[len(out): len(out) + L]  # the target's tokens after the anchor (L-1 drafts' and the bonus)
        m = min(L - 1, len(truth))  # drafts that can be checked
        n = next((k for k in range(m) if d[k] != truth[k]), m)
        st.accepted.append(n)
        st.emitted.append(_emit(out, truth[: n + 1], eos, max_new_tokens))
        ctx = hid[:, pos: pos + n + 1]
        pos += n + 1
    _sync(dev)
    st.seconds = time.perf_counter() - t0
    st.new_tokens = len(out)
    st.draft_ms = [s[0] for s in timer.spans_ms()]
    return out, st


class AnswerDrafter:
    """Drafts a known answer: the block after the anchor at position `pos` is `answer`'s tokens there (the answer
    starts at position `prompt_len`). With the target's own greedy answer as `answer`, `speculative_generate` returns
    that answer in a few block forwards (`greedy_by_blocks`); with any other answer, still the target's greedy output
    (the verify steps decide), only slower."""

    def __init__(self, answer: list[int], prompt_len: int, block_size: int):
        self.answer, self.prompt_len, self.block_size, self.layer_ids = list(answer), prompt_len, block_size, []

    def start(self) -> None:
        pass

    def draft(self, ctx_new_1SK, anchor_11, pos: int, block_size: int) -> torch.Tensor:
        k = pos - self.prompt_len  # the anchor is answer token k
        d = self.answer[k + 1: k + block_size]
        return torch.tensor(d + [0] * (block_size - 1 - len(d)))


@torch.no_grad()
def batched_greedy(target, prompts: list[list[int]], max_new_tokens: int, eos_ids=None, batch: int = 64) -> list[list[int]]:
    """Greedy answers of many prompts in left-padded batches (`generate`): the target's greedy output but for the
    rounding that padding and batching change, i.e. a near-perfect draft of it."""
    from transformers import GenerationConfig

    dev, eos = _device(target), sorted(_eos_set(eos_ids))
    pad = eos[0] if eos else 0
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad)
    out = []
    for b in range(0, len(prompts), batch):
        rows = prompts[b: b + batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long, device=dev)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r, device=dev), 1
        gen = target.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, width:].tolist()
        out += [g[: next((i + 1 for i, t in enumerate(g) if t in eos), len(g))] for g in gen]
    return out


def greedy_by_blocks(target, prompt_ids, draft: list[int], max_new_tokens: int, eos_ids=None,
                     block_size: int = 32) -> tuple[list[int], GenStats]:
    """The target's greedy output verified in blocks of `block_size` against `draft` (e.g. `batched_greedy`'s): exactly
    what `greedy_generate` returns (each token is the target's own greedy choice, as in any speculative decode), in
    about max_new_tokens / block_size forwards where the draft is right. Its stats are marked `rollback="drafted"`:
    they time a speculative decode, not the target alone."""
    out, st = speculative_generate(target, AnswerDrafter(draft, len(prompt_ids), block_size), prompt_ids,
                                   max_new_tokens, eos_ids)
    st.rollback = "drafted"
    return out, st
