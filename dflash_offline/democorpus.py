"""The bundled demo corpus: a deterministic, structured, learnable chat corpus generated on the fly.

Every record is `{"messages": [{"role": ..., "content": ...}, ...]}` in the OpenAI/HF chat layout:
1–4 user/assistant exchanges, an optional system prompt, some tool exchanges (assistant `tool_calls` →
`tool` message → assistant answer), non-ASCII text (accents, CJK, Cyrillic, emoji) and, in some documents,
assistant thinking in `reasoning_content`.

The tasks are templated and every answer is a deterministic function of its prompt (arithmetic with worked
steps, counting, reversing/sorting/spelling words, numbers in words, a fixed translation dictionary, capitals,
unit conversions, emoji), so a small drafter can learn them and reach a clearly higher acceptance than an
untrained one.

Determinism: document i of seed s is drawn from its own `random.Random("democorpus:s:i")` (string seeds are
hashed with SHA-512 by CPython, identical on every platform), so `generate(n)` is a prefix of `generate(n + m)`.

`generate_longtail` makes documents whose lengths follow a log-normal, long-tailed chat length distribution
(plain pseudo-words), for padding-fraction benchmarks of the packer.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_offline.cache.fsio import atomic_path

# --------------------------------------------------------------------------------------------------------------
# fixed tables (the "knowledge" of the corpus)

WORDS = [
    "apple", "river", "stone", "cloud", "garden", "window", "candle", "forest", "bridge", "rabbit", "silver",
    "orange", "pencil", "mirror", "castle", "ladder", "planet", "island", "button", "dragon", "meadow", "violin",
    "tiger", "lemon", "harbor", "rocket", "velvet", "marble", "anchor", "puzzle", "falcon", "tunnel",
]

# english -> (French, German, Japanese)
DICTIONARY = {
    "water": ("eau", "Wasser", "水"),
    "bread": ("pain", "Brot", "パン"),
    "house": ("maison", "Haus", "家"),
    "cat": ("chat", "Katze", "猫"),
    "dog": ("chien", "Hund", "犬"),
    "tree": ("arbre", "Baum", "木"),
    "book": ("livre", "Buch", "本"),
    "school": ("école", "Schule", "学校"),
    "coffee": ("café", "Kaffee", "コーヒー"),
    "sea": ("mer", "Meer", "海"),
    "mountain": ("montagne", "Berg", "山"),
    "flower": ("fleur", "Blume", "花"),
    "car": ("voiture", "Auto", "車"),
    "friend": ("ami", "Freund", "友達"),
    "morning": ("matin", "Morgen", "朝"),
    "night": ("nuit", "Nacht", "夜"),
    "apple": ("pomme", "Apfel", "りんご"),
    "bird": ("oiseau", "Vogel", "鳥"),
    "rain": ("pluie", "Regen", "雨"),
    "street": ("rue", "Straße", "通り"),
    "brother": ("frère", "Bruder", "兄弟"),
    "key": ("clé", "Schlüssel", "鍵"),
    "cheese": ("fromage", "Käse", "チーズ"),
    "beautiful": ("beau", "schön", "美しい"),
}
LANGUAGES = ("French", "German", "Japanese")

# country -> (capital in English, capital in the local language)
CAPITALS = {
    "France": ("Paris", "Paris"),
    "Germany": ("Berlin", "Berlin"),
    "Japan": ("Tokyo", "東京"),
    "China": ("Beijing", "北京"),
    "South Korea": ("Seoul", "서울"),
    "Greece": ("Athens", "Αθήνα"),
    "Russia": ("Moscow", "Москва"),
    "Spain": ("Madrid", "Madrid"),
    "Italy": ("Rome", "Roma"),
    "Portugal": ("Lisbon", "Lisboa"),
    "Austria": ("Vienna", "Wien"),
    "Czechia": ("Prague", "Praha"),
    "Poland": ("Warsaw", "Warszawa"),
    "Denmark": ("Copenhagen", "København"),
    "Iceland": ("Reykjavik", "Reykjavík"),
    "Vietnam": ("Hanoi", "Hà Nội"),
    "Thailand": ("Bangkok", "กรุงเทพฯ"),
    "Egypt": ("Cairo", "القاهرة"),
    "Mexico": ("Mexico City", "Ciudad de México"),
    "Brazil": ("Brasilia", "Brasília"),
    "Canada": ("Ottawa", "Ottawa"),
    "Australia": ("Canberra", "Canberra"),
    "Türkiye": ("Ankara", "Ankara"),
    "Sweden": ("Stockholm", "Stockholm"),
}

EMOJI = {
    "cat": "🐱", "dog": "🐶", "sun": "☀️", "moon": "🌙", "star": "⭐", "tree": "🌳", "fish": "🐟",
    "apple": "🍎", "heart": "❤️", "rain": "🌧️", "rocket": "🚀", "pizza": "🍕", "book": "📖", "music": "🎵",
}

# (from unit, to unit, factor, what is measured)
UNITS = [
    ("km", "m", 1000, "length"), ("m", "cm", 100, "length"), ("cm", "mm", 10, "length"),
    ("kg", "g", 1000, "mass"), ("h", "min", 60, "time"), ("min", "s", 60, "time"),
    ("L", "mL", 1000, "volume"), ("day", "h", 24, "time"), ("week", "day", 7, "time"),
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a precise tutor. Show your work step by step.",
    "You are a concise assistant. Answer briefly and exactly.",
    "Tu es un assistant serviable. Réponds avec précision.",
    "あなたは親切なアシスタントです。正確に答えてください。",
    "You are a friendly assistant 🙂 who loves numbers and words.",
]

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

P_SYSTEM = 0.4  # share of documents with a system prompt
P_THINKING = 0.35  # share of documents whose assistant turns carry reasoning_content
P_TOOL = 0.35  # chance that a tool-capable task is answered through a tool call


def number_to_words(n: int) -> str:
    """English words for 0 <= n < 1_000_000 ("three hundred forty-seven")."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_to_words supports 0..999999, got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_to_words(n % 100)
        return _ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + number_to_words(n % 1000)
    return number_to_words(n // 1000) + " thousand" + rest


# --------------------------------------------------------------------------------------------------------------
# tasks: each returns (prompt, steps, answer, tool); steps may be "" and tool may be None.
# tool = (name, arguments dict, result dict, answer given the result)


def _column_add(a: int, b: int) -> list[str]:
    steps, carry, place = [], 0, 0
    names = ["ones", "tens", "hundreds", "thousands"]
    while a or b or carry:
        da, db = a % 10, b % 10
        s = da + db + carry
        steps.append(f"{names[place]}: {da} + {db} + {carry} = {s}, write {s % 10}, carry {s // 10}.")
        carry, a, b, place = s // 10, a // 10, b // 10, place + 1
    return steps


def task_add(rng: random.Random):
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    steps = "\n".join(_column_add(a, b))
    tool = ("calculator", {"expression": f"{a} + {b}"}, {"result": a + b}, f"{a} + {b} = {a + b}.")
    return f"What is {a} + {b}?", steps, f"{a} + {b} = {a + b}.", tool


def task_sub(rng: random.Random):
    a = rng.randint(20, 999)
    b = rng.randint(1, a - 1)
    tens = a - b % 10
    steps = f"First subtract the ones: {a} - {b % 10} = {tens}.\nThen the rest: {tens} - {b - b % 10} = {a - b}."
    return f"Compute {a} - {b}.", steps, f"{a} - {b} = {a - b}.", None


def task_mul(rng: random.Random):
    a, b = rng.randint(2, 12), rng.randint(11, 99)
    t, o = b - b % 10, b % 10
    steps = f"{a} × {t} = {a * t}.\n{a} × {o} = {a * o}.\n{a * t} + {a * o} = {a * b}."
    tool = ("calculator", {"expression": f"{a} * {b}"}, {"result": a * b}, f"{a} × {b} = {a * b}.")
    return f"Multiply {a} by {b}.", steps, f"{a} × {b} = {a * b}.", tool


def task_count(rng: random.Random):
    step = rng.choice([1, 1, 2, 3, 5, 10])
    start = rng.randint(0, 20) * step
    n = rng.randint(4, 12)
    seq = [start + step * i for i in range(n)]
    if rng.random() < 0.3:
        seq = seq[::-1]
        prompt = f"Count down from {seq[0]} to {seq[-1]} in steps of {step}."
    elif step == 1:
        prompt = f"Count from {seq[0]} to {seq[-1]}."
    else:
        prompt = f"Count from {seq[0]} to {seq[-1]} in steps of {step}."
    steps = f"Start at {seq[0]}, change by {step} each time, stop at {seq[-1]}: that is {n} numbers."
    return prompt, steps, ", ".join(map(str, seq)), None


def task_reverse(rng: random.Random):
    words = rng.sample(WORDS, rng.randint(3, 6))
    steps = f"The list has {len(words)} words. Read it from the end: " + ", ".join(reversed(words)) + "."
    return f"Reverse this list: {', '.join(words)}", steps, ", ".join(reversed(words)), None


def task_sort(rng: random.Random):
    words = rng.sample(WORDS, rng.randint(3, 6))
    firsts = ", ".join(f"{w} ({w[0]})" for w in words)
    steps = f"First letters: {firsts}.\nOrder them alphabetically."
    return f"Sort alphabetically: {', '.join(words)}", steps, ", ".join(sorted(words)), None


def task_spell(rng: random.Random):
    word = rng.choice(WORDS + list(DICTIONARY))
    steps = f'"{word}" has {len(word)} letters.'
    return f"Spell the word {word} letter by letter.", steps, "-".join(word.upper()), None


def task_words(rng: random.Random):
    n = rng.choice([rng.randint(0, 99), rng.randint(100, 999), rng.randint(1000, 99999)])
    parts = []
    if n >= 1000:
        parts.append(f"{n // 1000} thousands → {number_to_words(n // 1000)} thousand")
    if n % 1000 >= 100:
        parts.append(f"{n % 1000 // 100} hundreds → {_ONES[n % 1000 // 100]} hundred")
    if n % 100 or n == 0:
        parts.append(f"{n % 100} → {number_to_words(n % 100)}")
    return f"Write {n} in words.", "\n".join(parts), f"{n} is written {number_to_words(n)}.", None


def task_translate(rng: random.Random):
    lang_i = rng.randrange(len(LANGUAGES))
    lang = LANGUAGES[lang_i]
    words = rng.sample(sorted(DICTIONARY), rng.randint(1, 3))
    pairs = [f"{w} → {DICTIONARY[w][lang_i]}" for w in words]
    if len(words) == 1:
        prompt = f'Translate "{words[0]}" into {lang}.'
        answer = f'In {lang}, "{words[0]}" is "{DICTIONARY[words[0]][lang_i]}".'
    else:
        prompt = f"Translate these words into {lang}: {', '.join(words)}"
        answer = "\n".join(f"- {p}" for p in pairs)
    return prompt, f"Look up each word in the {lang} dictionary: " + "; ".join(pairs) + ".", answer, None


def task_capital(rng: random.Random):
    country = rng.choice(sorted(CAPITALS))
    en, local = CAPITALS[country]
    answer = f"The capital of {country} is {en}" + (f" ({local})." if local != en else ".")
    steps = f"{country} → {en}. Local name: {local}."
    tool = ("lookup_capital", {"country": country}, {"capital": en, "local_name": local}, answer)
    return f"What is the capital of {country}?", steps, answer, tool


def _unit(name: str, x: int) -> str:
    return name + "s" if name in ("day", "week") and x != 1 else name


def task_convert(rng: random.Random):
    src, dst, factor, kind = rng.choice(UNITS)
    x = rng.randint(1, 99)
    answer = f"{x} {_unit(src, x)} = {x * factor} {_unit(dst, x * factor)}."
    steps = f"1 {src} = {factor} {_unit(dst, factor)} ({kind}).\n{x} × {factor} = {x * factor}."
    tool = ("convert_units", {"value": x, "from": src, "to": dst}, {"value": x * factor, "unit": dst}, answer)
    return f"Convert {x} {_unit(src, x)} to {_unit(dst, 2)}.", steps, answer, tool


def task_emoji(rng: random.Random):
    names = rng.sample(sorted(EMOJI), rng.randint(1, 3))
    steps = "; ".join(f"{n} → {EMOJI[n]}" for n in names)
    return f"Which emoji stands for: {', '.join(names)}?", steps, " ".join(EMOJI[n] for n in names), None


TASKS = [task_add, task_sub, task_mul, task_count, task_reverse, task_sort, task_spell, task_words,
         task_translate, task_capital, task_convert, task_emoji]

# --------------------------------------------------------------------------------------------------------------
# documents


def _exchange(rng: random.Random, thinking: bool) -> list[dict]:
    prompt, steps, answer, tool = rng.choice(TASKS)(rng)
    user = {"role": "user", "content": prompt}
    if tool is not None and rng.random() < P_TOOL:
        name, args, result, final = tool
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
        if thinking:
            call["reasoning_content"] = f"I should use the {name} tool for this."
        response = {"role": "tool", "name": name, "content": json.dumps(result, ensure_ascii=False)}
        done = {"role": "assistant", "content": final}
        if thinking:
            done["reasoning_content"] = f"The tool returned {response['content']}."
        return [user, call, response, done]
    if thinking:
        reply = {"role": "assistant", "content": answer, "reasoning_content": steps or answer}
    else:
        reply = {"role": "assistant", "content": f"{steps}\n{answer}" if steps else answer}
    return [user, reply]


def make_document(rng: random.Random) -> dict:
    """One chat record from `rng` (1–4 exchanges, optional system prompt, optional thinking)."""
    messages = []
    if rng.random() < P_SYSTEM:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    thinking = rng.random() < P_THINKING
    for _ in range(rng.randint(1, 4)):
        messages.extend(_exchange(rng, thinking))
    return {"messages": messages}


def generate(n_docs: int, seed: int = 0) -> Iterator[dict]:
    """`n_docs` demo chat records; the same (n_docs, seed) always gives the same records."""
    for i in range(n_docs):
        yield make_document(random.Random(f"democorpus:{seed}:{i}"))


def write_jsonl(path: str | Path, n_docs: int, seed: int = 0, records: Iterable[dict] | None = None) -> Path:
    """Write records (default: `generate(n_docs, seed)`) as UTF-8 JSONL via a temp file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for rec in generate(n_docs, seed) if records is None else records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


# --------------------------------------------------------------------------------------------------------------
# long-tailed lengths (padding benchmarks)

_SYLLABLES = ["lo", "rem", "ip", "sum", "do", "lor", "sit", "am", "et", "con", "sec", "te", "tur", "ad", "pi",
              "sci", "el", "it", "sed", "ei", "us", "mod", "tem", "por", "in", "ci", "di", "dunt", "ut", "la",
              "bo", "re", "ma", "gna", "ali", "qua", "ve", "ni", "mi", "nim", "na", "ra", "to", "ex"]


def _pseudo_words(rng: random.Random, n_words: int) -> str:
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
        if len(sentence) >= rng.randint(6, 18):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def generate_longtail(n_docs: int, seed: int = 0, median_tokens: float = 400.0, sigma: float = 1.0,
                      max_tokens: int = 16384, tokens_per_word: float = 1.5) -> Iterator[dict]:
    """Records whose lengths are log-normal (median `median_tokens`, shape `sigma`, capped at `max_tokens`).

    Lengths are targeted in tokens assuming `tokens_per_word` tokens per pseudo-word (≈ 1.5 for the tiny
    tokenizer; measure with the real one when exact numbers matter). With the defaults about 10 % of the
    documents are longer than ~1500 tokens and several per hundred exceed 4000 characters.
    """
    for i in range(n_docs):
        rng = random.Random(f"democorpus-longtail:{seed}:{i}")
        tokens = min(max_tokens, max(8.0, rng.lognormvariate(math.log(median_tokens), sigma)))
        n_words = max(1, round(tokens / tokens_per_word))
        user_words = max(1, min(40, n_words // 10))
        yield {"messages": [
            {"role": "user", "content": _pseudo_words(rng, user_words)},
            {"role": "assistant", "content": _pseudo_words(rng, n_words - user_words)},
        ]}


# --------------------------------------------------------------------------------------------------------------
# raw text (tokenizer training) and checks


def record_text(record: dict) -> str:
    """All text of a record (roles, contents, reasoning, tool calls) joined by newlines."""
    parts = []
    for m in record["messages"]:
        parts.append(m["role"])
        if m.get("reasoning_content"):
            parts.append(m["reasoning_content"])
        if m.get("content"):
            parts.append(m["content"])
        for call in m.get("tool_calls") or []:
            parts.append(json.dumps(call["function"], ensure_ascii=False))
    return "\n".join(parts)


def corpus_texts(n_docs: int, seed: int = 0, longtail_docs: int | None = None) -> Iterator[str]:
    """Raw texts for tokenizer training: the demo records plus (default n_docs // 10) long-tail records."""
    for rec in generate(n_docs, seed):
        yield record_text(rec)
    for rec in generate_longtail(n_docs // 10 if longtail_docs is None else longtail_docs, seed, max_tokens=2000):
        yield record_text(rec)


def validate_record(record: dict, where: str = "record") -> None:
    """Raise ValueError naming `where` unless `record` is a well-formed chat record."""
    msgs = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: expected {{'messages': [...]}} with at least one message")
    for j, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"{where}: message {j} has role {role!r}, expected system/user/assistant/tool")
        if role == "system" and j != 0:
            raise ValueError(f"{where}: system message at position {j}; it must come first")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {j} content must be a string")
        if role == "tool" and (j == 0 or msgs[j - 1]["role"] not in ("assistant", "tool")):
            raise ValueError(f"{where}: tool message {j} must follow an assistant tool call")
        if role == "assistant" and not (m["content"] or m.get("tool_calls")):
            raise ValueError(f"{where}: assistant message {j} has neither content nor tool_calls")


def feature_counts(records: Iterable[dict]) -> dict[str, int]:
    """How many records have each feature (system, reasoning, tool, non_ascii, multi_turn) plus the total."""
    counts = dict.fromkeys(("records", "system", "reasoning", "tool", "non_ascii", "multi_turn", "cjk", "emoji"), 0)
    for rec in records:
        msgs = rec["messages"]
        text = record_text(rec)
        counts["records"] += 1
        counts["system"] += msgs[0]["role"] == "system"
        counts["reasoning"] += any(m.get("reasoning_content") for m in msgs)
        counts["tool"] += any(m["role"] == "tool" for m in msgs)
        counts["non_ascii"] += not text.isascii()
        counts["multi_turn"] += sum(m["role"] == "user" for m in msgs) > 1
        counts["cjk"] += any("\u3040" <= c <= "\u9fff" for c in text)
        counts["emoji"] += any(ord(c) >= 0x1F300 for c in text)
    return counts
