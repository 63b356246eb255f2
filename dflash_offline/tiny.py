"""The embedded default target: tiny Qwen3.5 / Qwen3 models and a locally trained tokenizer, built offline.

`build_target(out_dir, arch)` writes a directory that loads through the real `from_pretrained` path:
- a byte-level BPE tokenizer (~2000 ids) trained on the demo corpus with the `tokenizers` library, Qwen-style
  special tokens appended after the BPE vocab, a dedicated mask token `<|MASK|>` (a real embedding row, not
  pad/eos) and a Qwen3-style chat template (see CHAT_TEMPLATE);
- `qwen3_5`: `Qwen3_5ForConditionalGeneration` (checkpoint keys `model.language_model.*`, `model.visual.*`,
  `lm_head.weight`), 8 text layers in the real 3 linear (Gated DeltaNet) : 1 full-attention pattern;
  `qwen3`: `Qwen3ForCausalLM`, 6 layers. Hidden 64, untied embeddings, bf16 safetensors;
- `dflash_target.json`: the sidecar naming the mask token and recording the build parameters.

Same parameters → byte-identical files. Random init is drawn from `torch.manual_seed(seed)`; the optional short
training (`train_steps`) runs under `torch.use_deterministic_algorithms(True)` with at most 4 threads (1, 2 and 4
threads give bit-identical weights). A different CPU (other SIMD kernels) may round differently after training;
untrained builds depend only on the RNG.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash_offline import __version__, democorpus
from dflash_offline.cache.fsio import write_text_atomic

SIDECAR = "dflash_target.json"
FORMAT_VERSION = 1
ARCHS = ("qwen3_5", "qwen3")
MASK_TOKEN = "<|MASK|>"
TOKENIZER_VOCAB = 2000  # BPE merges + byte alphabet + added tokens
VOCAB_MULTIPLE = 64  # embedding rows are the tokenizer size rounded up to this

# Added after the BPE vocab, in this order (so their ids are the last ones, as in Qwen tokenizers).
# Qwen marks the think/tool tags as added but *not* special (skip_special_tokens keeps them); so do we.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

# Qwen3-style ChatML. Choices (written here, not inherited):
# - a system message, if any, must be first; with `tools` the tool list is appended to the system turn;
# - every assistant turn with a non-empty `reasoning_content` is rendered as "<think>\n{reasoning}\n</think>\n\n"
#   before its content — not only the turns after the last user message as Qwen3 does — so thinking in earlier
#   turns is kept (and trained on) too; turns without reasoning get no think block;
# - assistant `tool_calls` render as "<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>", one per
#   call, separated from the content by a newline; consecutive `tool` messages are merged into one user turn of
#   "<tool_response>\n...\n</tool_response>" blocks;
# - `add_generation_prompt` emits "<|im_start|>assistant\n"; with `enable_thinking=False` it is followed by an
#   empty "<think>\n\n</think>\n\n".
CHAT_TEMPLATE = r"""
{%- set first = 0 -%}
{%- if messages and messages[0].role == 'system' -%}{%- set first = 1 -%}{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if first == 1 -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou can call these functions (JSON schemas):\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nTo call a function, reply with <tool_call>\n{"name": <name>, "arguments": <JSON object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first == 1 -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[first:] -%}
  {%- if message.role == 'system' -%}
    {{- raise_exception('the system message must be the first message') -}}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if message.reasoning_content -%}
      {{- '<think>\n' + (message.reasoning_content | trim) + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- message.content or '' -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
      {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- raise_exception('unknown role: ' + message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()

# --------------------------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int = TOKENIZER_VOCAB):
    """Train a byte-level BPE on `texts`, wrap it as a `PreTrainedTokenizerFast`, save it in `out_dir`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = len(SPECIAL_TOKENS) + len(TAG_TOKENS) + 1
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # digits one by one (as Qwen), then GPT-2-style word splitting on bytes
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tok.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, mask_token=MASK_TOKEN, extra_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768, clean_up_tokenization_spaces=False, split_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    for t in SPECIAL_TOKENS + TAG_TOKENS + [MASK_TOKEN]:
        assert len(tokenizer.encode(t, add_special_tokens=False)) == 1, t
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# model configs


def padded_vocab(tokenizer) -> int:
    return math.ceil(len(tokenizer) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


TINY_DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_hidden_layers": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 4,
             "linear_key_head_dim": 16, "linear_value_head_dim": 16}


def make_config(arch: str, tokenizer, dims: dict | None = None):
    """The tiny config for `arch`, its vocab and token ids taken from `tokenizer`; `dims` overrides TINY_DIMS
    (qwen3_5 only; the testbed's larger target)."""
    from transformers import Qwen3_5Config, Qwen3Config

    d = {**TINY_DIMS, **(dims or {})}
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = dict(
        vocab_size=padded_vocab(tokenizer), hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], max_position_embeddings=32768, tie_word_embeddings=False,
        pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], bos_token_id=None,
    )
    if arch == "qwen3":
        return Qwen3Config(num_hidden_layers=6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           dtype="bfloat16", **common)
    if arch != "qwen3_5":
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    n_layers = d["num_hidden_layers"]
    # as the real config: theta 1e7, a quarter of each head rotated, interleaved M-RoPE over T/H/W sections (for
    # text all three position streams are equal anyway); the tiny head (16) has 2 frequencies: T 1, H 1, W none
    freqs = d["head_dim"] // 8
    section = [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3] if freqs > 2 else [1, 1, 0]
    text = dict(
        common, num_hidden_layers=n_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        **{k: d[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim")},
        linear_conv_kernel_dim=4, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=d["hidden_size"], num_position_embeddings=16)
    return Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="bfloat16",
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


def model_class(arch: str):
    import transformers

    return {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration, "qwen3": transformers.Qwen3ForCausalLM}[arch]


# --------------------------------------------------------------------------------------------------------------
# optional short training on the demo corpus


@contextmanager
def _deterministic_cpu(max_threads: int = 4):
    """Deterministic algorithms, at most `max_threads` threads; restores the previous settings on exit.

    `fill_uninitialized_memory` is switched off: it NaN-fills every new tensor and nearly doubles a step's time,
    while the kernels are deterministic without it (1, 2 and 4 threads were measured to give bit-identical weights;
    more threads only add overhead for a model this small).
    """
    import torch.utils.deterministic as tud

    threads, det, fill = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), \
        tud.fill_uninitialized_memory
    torch.set_num_threads(min(threads, max_threads))
    torch.use_deterministic_algorithms(True)
    tud.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
        tud.fill_uninitialized_memory = fill


def corpus_rows(tokenizer, records: Iterable[dict], seq_len: int) -> torch.Tensor:
    """Chat-template every record, concatenate the token ids, cut into [rows, seq_len] (tail dropped)."""
    ids: list[int] = []
    for rec in records:
        ids.extend(tokenizer.apply_chat_template(rec["messages"], tokenize=True, return_dict=False))
    n_rows = len(ids) // seq_len
    return torch.tensor(ids[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def _lm_loss(model, rows_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV = model(input_ids=rows_BT).logits
    return torch.nn.functional.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), rows_BT[:, 1:].flatten())


def train_lm(model, rows_NT: torch.Tensor, steps: int, seed: int, batch_size: int = 8, lr: float = 3e-3,
             log: Callable[[str], None] = print) -> dict:
    """Next-token CE with AdamW (fp32, CPU) on random rows; returns losses and timing.

    The last `batch_size` rows are held out: `eval_loss_before/after` are measured on them.
    """
    held_BT, train_NT = rows_NT[-batch_size:], rows_NT[:-batch_size]
    if len(train_NT) < batch_size:
        raise ValueError(f"only {len(rows_NT)} rows of training text; raise corpus_docs")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    with _deterministic_cpu():
        model.eval()
        with torch.no_grad():
            eval_before = _lm_loss(model, held_BT).item()
        model.train()
        t0, losses = time.perf_counter(), []
        for step in range(steps):
            batch_BT = train_NT[torch.randint(len(train_NT), (batch_size,), generator=gen)]
            loss = _lm_loss(model, batch_BT)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if (step + 1) % max(1, steps // 10) == 0 or step == 0:
                log(f"  step {step + 1}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.1f}s)")
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            eval_after = _lm_loss(model, held_BT).item()
    k = min(10, steps)
    return {"steps": steps, "batch_size": batch_size, "seq_len": rows_NT.shape[1], "lr": lr,
            "train_loss_first": round(sum(losses[:k]) / k, 4), "train_loss_last": round(sum(losses[-k:]) / k, 4),
            "eval_loss_before": round(eval_before, 4), "eval_loss_after": round(eval_after, 4),
            "seconds": round(seconds, 2)}


# --------------------------------------------------------------------------------------------------------------
# the target directory


def build_params(arch: str, seed: int = 0, train_steps: int = 0, corpus_docs: int = 4000, seq_len: int = 256) -> dict:
    """Everything that changes the bytes of a build (recorded in the sidecar, compared for idempotency)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return {"arch": arch, "seed": seed, "train_steps": train_steps, "corpus_docs": corpus_docs,
            "seq_len": seq_len, "tokenizer_vocab": TOKENIZER_VOCAB, "format_version": FORMAT_VERSION}


def build_target(out_dir: str | Path, arch: str = "qwen3_5", seed: int = 0, train_steps: int = 0,
                 corpus_docs: int = 4000, seq_len: int = 256, log: Callable[[str], None] = print) -> Path:
    """Write tokenizer + tiny `arch` model (+ sidecar) into `out_dir`; same arguments → identical bytes."""
    from transformers import GenerationConfig

    params = build_params(arch, seed, train_steps, corpus_docs, seq_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(out, democorpus.corpus_texts(corpus_docs, seed))
    log(f"tokenizer: {len(tokenizer)} ids ({time.perf_counter() - t0:.1f}s)")

    config = make_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = model_class(arch)(config).float()
    train = None
    if train_steps > 0:
        rows_NT = corpus_rows(tokenizer, democorpus.generate(corpus_docs, seed), seq_len)
        log(f"training {train_steps} steps on {rows_NT.numel()} demo-corpus tokens")
        train = train_lm(model, rows_NT, train_steps, seed, log=log)
        log(f"trained: eval loss {train['eval_loss_before']} -> {train['eval_loss_after']} ({train['seconds']}s)")
    model = model.to(torch.bfloat16)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    model.save_pretrained(str(out))

    text_config = config.get_text_config()
    sidecar = {
        "built_by": "dflash_offline.tiny", "code_version": __version__, "arch": arch,
        "model_class": type(model).__name__, "params": params,
        "mask_token": MASK_TOKEN, "mask_token_id": tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        "pad_token_id": pad, "eos_token_id": eos, "tokenizer_size": len(tokenizer),
        "vocab_size": text_config.vocab_size, "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers, "layer_types": list(text_config.layer_types),
        "rope_theta": text_config.rope_parameters["rope_theta"],
        # timing stays out of the sidecar so that a rebuild is byte-identical
        "train": None if train is None else {k: v for k, v in train.items() if k != "seconds"},
    }
    write_json(out / SIDECAR, sidecar)
    log(f"{arch} target written to {out} ({time.perf_counter() - t0:.1f}s)")
    return out


def write_json(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_sidecar(model_dir: str | Path) -> dict:
    path = Path(model_dir) / SIDECAR
    if not path.is_file():
        raise ValueError(f"{path} not found: {model_dir} was not built by dflash_offline.tiny "
                         "(build one with `python -m stages.build_tiny --out DIR`)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_mask_token_id(model_dir: str | Path) -> int:
    """The drafter mask token id of a tiny target (from its sidecar)."""
    return int(read_sidecar(model_dir)["mask_token_id"])
