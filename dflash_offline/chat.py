"""Chat records → the text the target's chat template renders and the character spans to supervise.

Messages (validated here, normalized before the template sees them):
- roles system / user / assistant / tool; `content` a string (may be null in an assistant turn that calls tools or
  only has reasoning);
  `reasoning_content` (aliases `reasoning`, `thinking`) a string;
- `tool_calls` in every shape users have: OpenAI's `{"type": "function", "id": ..., "function": {"name": ...,
  "arguments": ...}}` or a flat `{"name": ..., "arguments": ...}`; `arguments` an object or a JSON string (as the
  OpenAI API and vLLM/SGLang servers return it), parsed into the object every Qwen template renders (Qwen3.5/3.6
  iterate over its items and fail on a string; Qwen3 prints an object as `tojson`, which is the JSON those servers
  serialized). A string that is not a JSON object skips the record (`invalid_tool_call`);
- a `tool` message may carry `tool_call_id` / `name`; a record-level `tools` list (OpenAI function format) goes to
  the template, which renders it into the system turn as the served model sees it.

Reasoning (`thinking`): content may hold the thinking as text — `<think>R</think>A`, a dangling `R</think>A` (the
template opened the block: the model's reasoning leaked into `content`), or an unclosed `<think>R` (generation
stopped while thinking). "keep" moves R into `reasoning_content` when the record has none (so the template renders
one well-formed think block); a record that has one keeps its content verbatim, think tags and all — it is what the
target generated after its reasoning, and the real Qwen templates render it so; "strip" drops R and
`reasoning_content`. Either way the template's own rules decide where a think block is rendered; an *empty* block the template inserts (`<think>\\n\\n</think>\\n\\n`: Qwen3
in its final turn, Qwen3.5/3.6 in every turn after the last user message) is prompt at serving time (the non-thinking
generation prompt ends with it), so it is not supervised unless `empty_think="supervise"`. Likewise the `<think>\n`
that opens a non-empty block where the template's thinking generation prompt ends with it (Qwen3.5/3.6: the served
model never writes it; Qwen3 writes its own and keeps it supervised).

Samples (`turns`): "last" renders the whole conversation once and supervises every assistant turn in it. The real
templates drop `reasoning_content` from turns before the last user message, so with "last" those turns are trained
without the reasoning the target wrote before them. "each" renders one sample per assistant turn — the conversation
up to and including that turn, exactly the prompt the target answered plus its answer — and supervises only that
turn, so every turn is trained with its reasoning as generated. Where a sample's rendering is the start of the next
one's (the steps of a tool loop, which the template renders unchanged until the next user message), the next sample
supervises both turns and the shorter one is dropped: the same tokens in the same context, extracted once. Tokens
still grow with the square of the number of user turns.

Supervision comes from structure, not from searching the text for turn markers: the conversation is rendered with
every `<|im_start|>` / `<|im_end|>` inside any string of the record (message text, reasoning, tool arguments, tool
schemas) replaced by placeholders of the same length, so the only turn markers in that rendering are the ones the
template writes. It must equal the real rendering once the placeholders are put back (same characters at the same
offsets), and the template must have written exactly one `<|im_start|>assistant\\n` … `<|im_end|>` turn per
assistant message; otherwise the record is a `template_error`. The k-th such turn is the k-th assistant message; its
supervised span runs from after the header through `<|im_end|>` inclusive.

A turn the target did not finish (`make regen` records `regen.finish_reason`, one per regenerated assistant turn:
"length" = stopped at max_new_tokens) is supervised only up to its last generated character: the template closes it
(`\n</think>\n\n` after a cut reasoning, `<|im_end|>` after a cut answer) with tokens the target never wrote there,
and a drafter must not learn to end a turn mid-sentence (counted as `truncated_turns`).
"""

from __future__ import annotations

import json
import re
from collections import Counter

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_OPEN = IM_START + "assistant\n"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
# same-length stand-ins for the turn markers inside record strings (Unicode private-use characters)
PLACEHOLDERS = {IM_START: "\ue000" * len(IM_START), IM_END: "\ue001" * len(IM_END)}
# identity of the rendering and masking rules below; part of the token cache key (change it with the rules)
RULES = "chat/v6: OpenAI text parts joined, ShareGPT conversations read as messages; content kept verbatim beside given reasoning, tool calls normalized, think tags split, structural spans, empty think block masked by option, truncated regen turns end at their last generated character, <think> opened by the generation prompt masked"
THINK_OPEN_LINE = THINK_OPEN + "\n"


def template_opens_think(tok) -> bool:
    """Whether the chat template's generation prompt with thinking on ends with an opened `<think>` (Qwen3.5/3.6; not
    Qwen3): the served model then starts inside the block, and the `<think>\n` of a rendered turn is prompt."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=True)
    except Exception:  # noqa: BLE001 - a template that cannot render this: nothing to mask
        return False
    return text.endswith(THINK_OPEN_LINE)


class RecordError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# --- validation ----------------------------------------------------------------------------------------------


def validate_messages(obj: dict, counts: Counter | None = None, answered: bool = True) -> list[dict]:
    """The record's messages in the form templates take; `counts` tallies tool arguments parsed from strings.
    `answered=False` accepts a conversation without an assistant turn (a prompt, for `make regen`)."""
    if "messages" not in obj:
        raise RecordError("missing_messages", f"keys {sorted(obj)[:6]}; expected 'messages' (or input_ids+loss_mask)")
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        raise RecordError("wrong_type", f"'messages' is a {type(msgs).__name__}; expected a list of messages")
    if not msgs:
        raise RecordError("empty_conversation", "'messages' is an empty list")
    out = [validate_message(m, i, counts if counts is not None else Counter()) for i, m in enumerate(msgs)]
    if answered and not any(m["role"] == "assistant" for m in out):
        raise RecordError("no_assistant_turn", "nothing to learn from: the conversation has no assistant message")
    return out


def validate_message(m, i: int, counts: Counter) -> dict:
    if not isinstance(m, dict):
        raise RecordError("wrong_type", f"messages[{i}] is a {type(m).__name__}; expected an object")
    if "role" not in m:
        raise RecordError("missing_role", f"messages[{i}] has no 'role' (one of {', '.join(ROLES)})")
    if m["role"] not in ROLES:
        raise RecordError("unknown_role", f"messages[{i}].role = {m['role']!r}; expected one of {', '.join(ROLES)}")
    content = m.get("content")
    if content is None and m["role"] == "assistant" and (m.get("tool_calls") or any(m.get(k) for k in REASONING_KEYS)):
        content = ""  # what servers return for a turn that only calls tools, or only thought (cut off)
    if isinstance(content, list):
        content = text_parts(content, i)
        counts["content_parts_joined"] += 1
    if not isinstance(content, str):
        raise RecordError("non_string_content", f"messages[{i}].content is {type(content).__name__}; expected a string "
                                                f"(or a list of text parts)")
    msg = {"role": m["role"], "content": content}
    for key in REASONING_KEYS:
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise RecordError("wrong_type", f"messages[{i}].{key} is {type(m[key]).__name__}; expected a string")
            msg["reasoning_content"] = m[key]
            break
    if m.get("tool_calls"):
        msg["tool_calls"] = tool_calls(m["tool_calls"], i, counts)
    if m["role"] == "tool":
        msg.update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
    return msg


def text_parts(parts: list, i: int) -> str:
    """OpenAI-style content parts (`[{"type": "text", "text": ...}, ...]`) as the one string Qwen3.5/3.6's templates
    render them as (the texts joined; Qwen3's template would drop them); any other part is refused: the drafter
    learns the text stack."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str) or part.get("type", "text") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RecordError("non_text_content", f"messages[{i}].content[{j}] is a {kind!r} part; only text parts "
                                                  f"({{\"type\": \"text\", \"text\": ...}}) are read")
        texts.append(part["text"])
    return "".join(texts)


def tool_calls(calls, i: int, counts: Counter) -> list[dict]:
    """OpenAI-format calls with object arguments, from any of the shapes the module docstring lists."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RecordError("wrong_type", f"{where} is a {type(calls).__name__}; expected a list of calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError("invalid_tool_call", f"{where}[{j}] has no function name; expected {{\"function\": "
                                                   "{\"name\": ..., \"arguments\": {...}}} or {\"name\": ..., ...}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise RecordError("invalid_tool_call", f"{where}[{j}].arguments is a string that is not JSON ({e.msg} "
                                                       f"at column {e.colno}); expected a JSON object") from None
            counts["tool_arguments_parsed"] += 1
        if not isinstance(args, dict):
            raise RecordError("invalid_tool_call", f"{where}[{j}].arguments is a {type(args).__name__}; expected an "
                                                   "object (or a string holding a JSON object)")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    counts["tool_calls"] += len(out)
    return out


def validate_tools(obj: dict) -> list[dict] | None:
    """The record's `tools` list (None when absent or empty)."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        kind = type(tools).__name__ if not isinstance(tools, list) else "list with a non-object entry"
        raise RecordError("wrong_type", f"'tools' is a {kind}; expected a list of tool schemas (JSON objects)")
    return tools or None


# --- reasoning -----------------------------------------------------------------------------------------------


def split_think(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a content holding think tags, as the module docstring describes; (None, content) when
    it holds none. Text before a `<think>` that is closed is dropped, as the Qwen templates drop it."""
    close = content.find(THINK_CLOSE)
    if close >= 0:
        head, answer = content[:close], content[close + len(THINK_CLOSE) :]
        return head.rsplit(THINK_OPEN, 1)[-1].strip("\n"), answer.lstrip("\n")
    opened = content.find(THINK_OPEN)
    if opened >= 0:
        return content[opened + len(THINK_OPEN) :].strip("\n"), content[:opened]
    return None, content


def strip_think(content: str) -> str:
    """The answer alone: every think block, a dangling `R</think>` and an unclosed `<think>R` removed."""
    answer = THINK_RE.sub("", content)
    if THINK_CLOSE in answer:
        answer = answer.rsplit(THINK_CLOSE, 1)[1].lstrip()
    return answer.split(THINK_OPEN, 1)[0] if THINK_OPEN in answer else answer


def prepare_messages(messages: list[dict], thinking: str, counts: Counter) -> list[dict]:
    """Assistant turns with their reasoning kept in `reasoning_content` or stripped (`thinking` keep|strip)."""
    out = []
    for m in messages:
        if m["role"] != "assistant" or (thinking == "keep" and "think>" not in m["content"]):
            out.append(m)
            continue
        m = dict(m)
        given = m.pop("reasoning_content", None)
        if thinking == "strip":
            answer = strip_think(m["content"])
            counts["think_stripped"] += bool((given or "").strip() or answer != m["content"])
            m["content"] = answer
        elif (given or "").strip():  # its reasoning is given: the content is the target's own text after it, kept as
            m["reasoning_content"] = given  # it is (the real Qwen templates split a content only without one)
        else:
            found, m["content"] = split_think(m["content"])
            m["reasoning_content"] = given if found is None else found
        out.append(m)
    return out


# --- rendering and spans -------------------------------------------------------------------------------------


def truncated_turns(obj: dict, messages: list[dict]) -> set[int]:
    """Indices in `messages` of the assistant turns `make regen` stopped at max_new_tokens (the record's
    `regen.finish_reason`, one per assistant turn in order; none when it does not match the turns)."""
    reasons = (obj.get("regen") or {}).get("finish_reason") if isinstance(obj.get("regen"), dict) else None
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not isinstance(reasons, list) or len(reasons) != len(assistant):
        return set()
    return {i for i, why in zip(assistant, reasons, strict=True) if why == "length"}


def conversation_samples(tok, messages: list[dict], tools: list | None, turns: str, empty_think: str,
                         counts: Counter, truncated: set[int] = frozenset(), opens_think: bool = False,
                         settings: dict | None = None) -> list[tuple[str, list[tuple[int, int]]]]:
    """(rendered text, supervised character spans) of each sample of a prepared conversation (`turns` last|each;
    `truncated`: indices of assistant turns cut at max_new_tokens, `truncated_turns`; `opens_think`:
    `template_opens_think`; `settings`: the chat template's keyword arguments, e.g. Qwen3.8's reasoning_effort)."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    marked = holds_marker(messages, tools)
    if turns == "last":
        text, spans = render(tok, messages, tools, marked, settings)
        samples = [(text, list(zip(assistant, spans, strict=True)))]
    else:
        samples = turn_samples(tok, messages, tools, assistant, marked, settings)
    counts["chat_records"] += 1
    counts["samples"] += len(samples)
    return [(text, [supervised_span(text, span, messages[i], empty_think, counts, i in truncated, opens_think)
                     for i, span in chosen]) for text, chosen in samples]


def turn_samples(tok, messages, tools, assistant: list[int], marked: bool, settings=None) -> list[tuple[str, list]]:
    """turns=each: per assistant turn i, the rendering of messages[:i + 1] and [(i, span of turn i)]. A rendering
    that the next one starts with, followed by a turn marker (the template renders turn i alike in both, e.g. the
    steps of a tool loop), is not kept on its own: the next sample, whose tokens up to there are the same (the
    marker is a special token, so tokenization splits there), supervises turn i too."""
    out = []
    for i in assistant:
        text, spans = render(tok, messages[: i + 1], tools, marked, settings)
        turns = [(i, spans[-1])]
        if out and text.startswith(out[-1][0]) and text.startswith(IM_START, len(out[-1][0])):
            turns = out.pop()[1] + turns
        out.append((text, turns))
    return out


def render(tok, messages: list[dict], tools: list | None, marked: bool = True,
           settings: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The template's text and the span of each assistant turn in it (after its header, through `<|im_end|>`).
    `marked=False` promises that no string of the messages or tools holds a turn marker (one rendering suffices)."""
    text = apply(tok, messages, tools, settings)
    structural = text
    if marked:
        structural = apply(tok, neutralize(messages), neutralize(tools), settings)
        restored = structural.replace(PLACEHOLDERS[IM_START], IM_START).replace(PLACEHOLDERS[IM_END], IM_END)
        if restored != text:
            raise RecordError("template_error", "the chat template renders a message holding <|im_start|>/<|im_end|> "
                                                "text differently from the same message without it: the turns cannot "
                                                "be located; remove those markers from the record")
    spans = turn_spans(structural)
    expected = sum(m["role"] == "assistant" for m in messages)
    if len(spans) != expected:
        raise RecordError("template_error", f"the chat template wrote {len(spans)} assistant turn(s) for {expected} "
                                            "assistant message(s); only ChatML templates (<|im_start|>assistant\\n … "
                                            "<|im_end|>) are supported")
    return text, spans


def apply(tok, messages: list[dict], tools: list | None, settings: dict | None = None) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **({"tools": tools} if tools else {}), **(settings or {}))


def record_settings(obj: dict, base: dict | None, tok=None) -> dict | None:
    """The template settings a record renders with: a regenerated record's own (`regen.template`, all it was answered
    under: make regen writes it; a setting it does not name was the template's default), else `base`
    (tokenize.template_kwargs). With `tok`, a record whose own settings render otherwise than with `base` over them
    is refused (`template_mismatch`): the cache key and the manifest name `base`, and it is what will be served."""
    regen = obj.get("regen")
    own = regen.get("template") if isinstance(regen, dict) else None
    if own is None:
        return base
    if not isinstance(own, dict) or any(not isinstance(v, str | bool | int | float) for v in own.values()):
        raise RecordError("invalid_regen_template", "regen.template must be an object of the chat template's "
                                                    "settings (strings, booleans, numbers)")
    if tok is not None:
        try:
            agree = settings_agree(tok, own, base or {})
        except Exception as e:  # noqa: BLE001 - the template's own refusal of the record's settings
            raise RecordError("template_error", f"the chat template refuses regen.template {json.dumps(own)}: "
                                                f"{type(e).__name__}: {e}") from None
        if not agree:
            raise RecordError("template_mismatch", mismatch(own, base or {}))
    return own


_AGREE: dict = {}  # (own, base) → whether they render alike (a regen output's records share one `own`)
PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi."},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}]


def settings_agree(tok, own: dict, base: dict) -> bool:
    """Whether the template renders a short conversation (and its generation prompt) alike under `own` and under
    `base` with `own`'s enable_thinking (THINKING= of regen, which stage 1a's `thinking` handles): a setting either
    leaves to the template's default agrees with the other's value equal to it. Raises the template's refusal."""
    key = (id(tok), tok.chat_template, json.dumps(own, sort_keys=True), json.dumps(base, sort_keys=True))
    if key not in _AGREE:
        both = {**base, **{k: own[k] for k in ("enable_thinking",) if k in own}}
        try:
            _AGREE[key] = all(apply(tok, PROBE, None, {**own, **gen}) == apply(tok, PROBE, None, {**both, **gen})
                              for gen in ({}, {"add_generation_prompt": True}))
        except Exception as e:  # noqa: BLE001 - remembered too: a refusal is not rendered again for every record
            _AGREE[key] = e
    if isinstance(_AGREE[key], Exception):
        raise _AGREE[key]
    return _AGREE[key]


def mismatch(own: dict, base: dict) -> str:
    return (f"answered under the chat template settings {json.dumps(own, sort_keys=True)} (regen.template; a setting "
            f"not named there was the template's default), which render otherwise than tokenize.template_kwargs "
            f"{json.dumps(base, sort_keys=True)}: set template_kwargs to what the corpus was regenerated with (it keys "
            f"the cache and is what you will serve), or regenerate with --template_kwargs")


def template_reads(tok, names) -> list[str]:
    """Which of `names` the tokenizer's chat template reads as variables (jinja's parse; a whole-word search where
    the template does not parse with plain jinja)."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    try:
        from jinja2 import Environment, meta

        read = meta.find_undeclared_variables(Environment().parse(template))
        return [n for n in names if n in read]
    except Exception:  # noqa: BLE001 - an HF extension jinja does not know: fall back to the text
        return [n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", template)]


def parse_settings(text: str, field: str = "tokenize.template_kwargs") -> dict:
    """The chat template's keyword arguments given as a JSON object of scalars (`{"reasoning_effort": "low"}`);
    raises ValueError naming `field` otherwise."""
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field}: not JSON ({e}): give an object, e.g. '{{\"reasoning_effort\": \"low\"}}'") from None
    reserved = {"tools", "tokenize", "add_generation_prompt", "messages", "conversation"}
    if not isinstance(obj, dict) or any(not isinstance(v, str | bool | int | float) for v in obj.values()):
        raise ValueError(f"{field}: {text!r} is not an object of strings, booleans and numbers")
    if bad := sorted(reserved & set(obj)):
        raise ValueError(f"{field}: {', '.join(bad)} is set by the tokenizer stage itself, not a template setting")
    return obj


def turn_spans(text: str) -> list[tuple[int, int]]:
    """Spans of the `<|im_start|>assistant\\n` … `<|im_end|>` turns of a rendering whose only markers are the
    template's own: from after the header through `<|im_end|>` inclusive."""
    spans, at = [], 0
    while (start := text.find(ASSISTANT_OPEN, at)) >= 0:
        body = start + len(ASSISTANT_OPEN)
        end = text.find(IM_END, body)
        if end < 0:
            raise RecordError("template_error", "the chat template left an assistant turn without <|im_end|>")
        spans.append((body, end + len(IM_END)))
        at = end
    return spans


def supervised_span(text: str, span: tuple[int, int], message: dict, empty_think: str,
                    counts: Counter, truncated: bool = False, opens_think: bool = False) -> tuple[int, int]:
    """The turn's span, without a leading empty think block unless `empty_think="supervise"`, without the opening
    `<think>\n` of a block where the generation prompt opens it (`opens_think`), and for a `truncated` turn ending at
    its last generated character (`generated_end`); counts think blocks."""
    body, end = span
    if text.startswith(EMPTY_THINK, body):
        counts["think_empty"] += 1
        if empty_think == "prompt":
            body += len(EMPTY_THINK)
    elif text.startswith(THINK_OPEN, body):
        counts["think_kept"] += 1
        if opens_think and text.startswith(THINK_OPEN_LINE, body):
            body += len(THINK_OPEN_LINE)
    elif (message.get("reasoning_content") or "").strip():
        counts["think_dropped_by_template"] += 1
    if truncated:
        counts["truncated_turns"] += 1
        end = generated_end(text, (body, end), message)
    return body, end


def generated_end(text: str, span: tuple[int, int], message: dict) -> int:
    """Where a cut turn's generated text ends in its rendering: after the last characters of its answer, else of its
    reasoning (as the template rendered them), else at the span's start (nothing of it was kept); before the closing
    `<|im_end|>` at least when the template changed them past recognition."""
    body, end = span
    last = (message.get("content") or "").rstrip() or (message.get("reasoning_content") or "").rstrip()
    if not last:
        return body
    needle = last[-256:]
    at = text.rfind(needle, body, end)
    return at + len(needle) if at >= 0 else end - len(IM_END)


def holds_marker(messages: list[dict], tools: list | None) -> bool:
    """Whether any string of the messages or tools holds `<|im_start|>` or `<|im_end|>` (nested values are checked
    in their JSON text, which holds a marker iff one of their strings does: JSON escapes neither '<' nor '|')."""
    def has(text: str) -> bool:
        return IM_START in text or IM_END in text

    for m in messages:
        for v in m.values():
            if has(v) if isinstance(v, str) else v is not None and has(json.dumps(v, ensure_ascii=False, default=str)):
                return True
    return tools is not None and has(json.dumps(tools, ensure_ascii=False, default=str))


def neutralize(x):
    """A copy with the turn markers in every string replaced by their same-length placeholders."""
    if isinstance(x, str):
        return x.replace(IM_START, PLACEHOLDERS[IM_START]).replace(IM_END, PLACEHOLDERS[IM_END])
    if isinstance(x, dict):
        return {neutralize(k): neutralize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [neutralize(v) for v in x]
    return x
