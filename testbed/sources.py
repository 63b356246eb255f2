"""Real text every machine has: the Python source files of the running interpreter's standard library and of
installed packages, turned into "continue this file" chat records (the testbed's corpus).

Selection is deterministic for a given set of installed files: every `*.py` under the standard library (its
`site-packages` left out) and under each named package's directory is listed with a portable name
(`stdlib/json/decoder.py`, `torch/nn/modules/linear.py`), files that are not UTF-8 or larger than
`MAX_FILE_BYTES` are left out, and the rest are ranked by the SHA-256 of their name and taken in that order until
`max_bytes` (an even spread over packages, independent of walk order). A file is held out when the first byte of
the SHA-256 of its name is below `256 / heldout_every`: held-out files are disjoint from training files by name,
whatever the versions installed. `FileList.digest` (SHA-256 over the sorted `name<TAB>content sha256` lines) is
the corpus's identity: another Python or package version gives another digest.

Records: a file's leading comment block (license header) is dropped, its lines are cut into chunks of at most `CHUNK_LINES` lines (and `CHUNK_CHARS` characters); a chunk
of at least `MIN_CHUNK_LINES` lines becomes `{"messages": [user: "<name>\\n" + its first `PROMPT_LINES` lines,
assistant: the rest], "category": <package>}`. `records(files, first_only=True)` takes each file's first chunk
(a file's opening lines, what evaluation prompts with).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.fsio import atomic_path

DEFAULT_PACKAGES = ("torch", "transformers", "numpy", "huggingface_hub", "accelerate", "pyarrow", "jinja2",
                    "safetensors", "triton")
MAX_FILE_BYTES = 256 * 1024
CHUNK_LINES = 120
CHUNK_CHARS = 6000
MIN_CHUNK_LINES = 16
PROMPT_LINES = 12
MARKERS = ("<|", "|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@dataclass(frozen=True)
class SourceFile:
    name: str  # portable name: "<package>/<path inside it>" ("stdlib/..." for the standard library)
    path: Path  # where it is on this machine
    sha256: str  # of its bytes
    size: int

    @property
    def package(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass
class FileList:
    train: list[SourceFile]
    heldout: list[SourceFile]
    roots: dict[str, str]  # package → directory listed
    digest: str  # identity of the selection (names + contents)

    def summary(self) -> dict:
        per: dict[str, int] = {}
        for f in self.train + self.heldout:
            per[f.package] = per.get(f.package, 0) + 1
        return {"digest": self.digest, "train_files": len(self.train), "heldout_files": len(self.heldout),
                "train_bytes": sum(f.size for f in self.train), "heldout_bytes": sum(f.size for f in self.heldout),
                "files_per_package": dict(sorted(per.items())), "roots": self.roots}


def name_hash(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def package_roots(packages: tuple[str, ...] | list[str]) -> dict[str, Path]:
    """{"stdlib": the standard library, package: its directory} for the packages installed here."""
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots[name] = Path(list(spec.submodule_search_locations)[0])
    return roots


def _walk(pkg: str, root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if pkg == "stdlib" and rel.parts and rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        if path.is_file() and not path.is_symlink():
            yield f"{pkg}/{rel.as_posix()}", path


def select(packages=DEFAULT_PACKAGES, max_bytes: int = 96 << 20, heldout_every: int = 32,
           roots: dict[str, Path] | None = None) -> FileList:
    """The deterministic train/held-out split of the sources under `roots` (default: `package_roots(packages)`)."""
    roots = roots if roots is not None else package_roots(packages)
    candidates = []
    for pkg, root in roots.items():
        for name, path in _walk(pkg, root):
            if path.stat().st_size <= MAX_FILE_BYTES:
                candidates.append((name_hash(name), name, path))
    candidates.sort()
    cut = 256 // heldout_every
    train, heldout, total = [], [], 0
    for h, name, path in candidates:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data.strip():
            continue
        f = SourceFile(name, path, hashlib.sha256(data).hexdigest(), len(data))
        if h[0] < cut:
            heldout.append(f)
        elif total + f.size <= max_bytes:
            train.append(f)
            total += f.size
    for part in (train, heldout):
        part.sort(key=lambda f: f.name)
    lines = "".join(f"{f.name}\t{f.sha256}\n" for f in sorted(train + heldout, key=lambda f: f.name))
    return FileList(train, heldout, {k: str(v) for k, v in roots.items()}, hashlib.sha256(lines.encode()).hexdigest())


def chunks(text: str) -> Iterator[list[str]]:
    """The file's lines (ends kept) in chunks of ≤ CHUNK_LINES lines and ≤ CHUNK_CHARS characters."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        j, chars = i, 0
        while j < len(lines) and j - i < CHUNK_LINES and (chars + len(lines[j]) <= CHUNK_CHARS or j == i):
            chars += len(lines[j])
            j += 1
        yield lines[i:j]
        i = j


def strip_header(text: str) -> str:
    """The file without its leading comment block (license headers, shebang, encoding line): a prompt of license
    text is answered from memory with the rest of the license, which any drafter predicts."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
        i += 1
    return "".join(lines[i:])


def record(name: str, lines: list[str]) -> dict | None:
    """A "continue this file" chat from one chunk, or None when it is too short or holds a chat-marker string (a
    literal `<|im_end|>` or `<think>` in source text would tokenize to the marker and end the turn early)."""
    if len(lines) < MIN_CHUNK_LINES or any(m in line for line in lines for m in MARKERS):
        return None
    prompt, answer = "".join(lines[:PROMPT_LINES]), "".join(lines[PROMPT_LINES:])
    if not answer.strip():
        return None
    return {"messages": [{"role": "user", "content": f"{name}\n{prompt}"},
                         {"role": "assistant", "content": answer}], "category": name.split("/", 1)[0]}


def records(files: list[SourceFile], first_only: bool = False) -> Iterator[dict]:
    """The chat records of `files`, in order (each file's first usable chunk only with `first_only`)."""
    for f in files:
        text = strip_header(f.path.read_text(encoding="utf-8"))
        for lines in chunks(text):
            rec = record(f.name, lines)
            if rec is not None:
                yield rec
                if first_only:
                    break


def write_jsonl(path: Path, recs) -> int:
    """Write records (atomically: a temporary sibling renamed into place); returns how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def looping(text: str, tail: int = 128) -> bool:
    """Whether `text` ends in a loop: its last `tail` characters (a quarter of a text shorter than 4 × `tail`, at
    least 32) occur earlier in it (greedy decoding of a small model repeats itself; such answers are easy to draft
    and inflate τ)."""
    tail = min(tail, len(text) // 4)
    return tail >= 32 and text[-tail:] in text[:-1]
