"""docs/full-run.md, executed: every block fenced ```` ```bash run ```` in that page runs here, command by command and
in order, on a stand-in Qwen3.6-27B in the real layout (tests/standin.py: the real tokenizer, chat template, vocabulary
and 64-layer pattern, the vision-language wrapper, sharded safetensors + index; width 64, random weights), with
`make regen ENGINE=` answered by a real `transformers serve` on a loopback port.

A command is the page's, verbatim but for the substitutions in `SUBS` (paths, sizes, the port) and the `ARGS=` that
`EXTRA` appends (the drafter's width, the steps, the evaluation's size). An entry of either that no longer matches
the page is a failure, and so is a pipeline of other commands than `PIPELINE`: the page and this table change
together. The engines' blocks (plain ```` ```bash ````: vLLM, SGLang) are not run; their serving lines are compared
with what `make export` prints. `transformers serve` refuses the vision-language layout (it loads an image and video
processor, which needs torchvision), so it serves the stand-in's language model alone (`standin.text_only`: the same
weights, the same greedy answers) under its own path, the `MODEL=` of the regen command.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import standin  # noqa: E402
from serving import free_port, serve, stop  # noqa: E402

DOC = REPO / "docs" / "full-run.md"
PROMPTS, PILOT = 40, 12  # prompts in data/prompts/all.jsonl, and drawn for the pilot
# (in the page, here), in one pass, the first that matches at a place; each must match at least once
SUBS = [
    ("make ", "make -o .venv/.installed "),  # the stages are under test, not the install (make test set it up)
    ("MODEL=/ckpt/Qwen3.6-27B", "MODEL={served}"),  # the text-only stand-in transformers serve answers with
    ("/ckpt/Qwen3.6-27B", "{target}"),
    ("http://localhost:8000/v1", "http://127.0.0.1:{port}/v1"),
    ("shuf -n 80000 ", f"shuf -n {PILOT} "),
    ("--max_new_tokens=4096", "--max_new_tokens=8"),
    ("--heldout_every=100", "--heldout_every=3"),
    ("NPROC=8", "NPROC=1"),
    ("cache/hidden-<key12>", "{cache}"),  # what `make extract` printed
]
EXTRA = {  # make target → ARGS= appended (the page's command has none): the 3.6 recipe's drafter at the stand-in's width
    # (and in the CPU's precision: the recipe's float8 linears need a GPU, as the page says)
    "train": "--num_heads=4 --num_kv_heads=2 --head_dim=16 --intermediate_size=128 --num_anchors=16 "
             "--selector_rank=16 --global_batch_tokens=8192 --epochs=4 --log_every=1 --precision=auto",
    "eval": "--num_prompts=2 --max_new_tokens=8",
}
PIPELINE = ["shuf", "regen", "extract", "extract", "verify", "status", "train", "train", "export", "eval", "eval",
            "report"]


def blocks(text: str, info: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is exactly `info`."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?)^```\s*$", text, flags=re.M | re.S)


def commands(body: str) -> list[str]:
    """A block's commands: continuation lines joined, comment lines and trailing `  # ...` comments dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


def target_of(cmd: str) -> str:
    return cmd.split()[cmd.split().index("make") + 1] if cmd.startswith("make ") else cmd.split()[0]


def substitute(cmd: str, values: dict, used: set) -> str:
    """`cmd` with SUBS applied in one pass (a replacement is not substituted again), EXTRA's ARGS= appended; the
    SUBS entries that matched go into `used`."""
    pages, extra = [page for page, _ in SUBS], EXTRA.get(target_of(cmd))

    def one(m: re.Match) -> str:
        i = pages.index(m[0])
        used.add(i)
        return SUBS[i][1].format(**values)

    cmd = re.sub("|".join(map(re.escape, pages)), one, cmd)
    if extra:
        assert "ARGS=" not in cmd, f"{cmd}: the page gives ARGS= here; move EXTRA's settings into SUBS"
        cmd += f' ARGS="{extra}"'
    return cmd


def write_prompts(path: Path) -> None:
    """The bundled chat corpus cut before each record's first assistant turn: prompts as users bring them."""
    from fixtures import democorpus

    conv = democorpus.write_jsonl(path.parent / "conversations.jsonl", PROMPTS, seed=7)
    lines = []
    for line in conv.read_text().splitlines():
        rec = json.loads(line)
        first = next(i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant")
        lines.append(json.dumps({**rec, "messages": rec["messages"][:first]}) + "\n")
    path.write_text("".join(lines))
    (path.parent / "conversations.jsonl").unlink()


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def site(tmp_path_factory, real_fixtures):
    """A working directory as the page assumes one: the repository's Makefile and manifests, the prompts in
    data/prompts/all.jsonl; the stand-in target in ckpt/Qwen3.6-27B and its text-only twin beside it."""
    work = tmp_path_factory.mktemp("full-run")
    for name in ("Makefile", "manifests"):
        (work / name).symlink_to(REPO / name)
    (work / "data" / "prompts").mkdir(parents=True)
    write_prompts(work / "data" / "prompts" / "all.jsonl")
    target = standin.build(work / "ckpt" / "Qwen3.6-27B", "qwen3.6", depth=64)
    served = standin.text_only(target, work / "ckpt" / "Qwen3.6-27B-text")
    return work, target, served


def test_the_documented_full_run_runs(site):
    work, target, served = site
    text = DOC.read_text()
    run = [c for body in blocks(text, "bash run") for c in commands(body)]
    assert [target_of(c) for c in run] == PIPELINE, "docs/full-run.md runs other commands: update PIPELINE"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(work / "hf"), "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    values, used, ran = {"target": target, "served": served, "port": free_port(), "cache": None}, set(), []
    server = serve(served, values["port"], work / "serve.log", env)
    try:
        for page_cmd in run:
            cmd = substitute(page_cmd, values, used)
            t0 = time.perf_counter()
            res = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=600)
            ran.append((cmd, time.perf_counter() - t0, res.stdout + res.stderr))
            assert res.returncode == 0, f"docs/full-run.md: `{page_cmd}` failed (exit {res.returncode}) as\n{cmd}\n" \
                                        f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            if "DRY_RUN=1" in cmd:
                assert not (work / "cache").exists(), "make extract DRY_RUN=1 wrote into cache/"
            elif target_of(page_cmd) == "extract":
                found = re.findall(r"^cache/hidden-[0-9a-f]{12}$", res.stdout, flags=re.M)
                assert found, f"make extract printed no cache path: {res.stdout[-2000:]}\n{res.stderr[-2000:]}"
                values["cache"] = found[-1]  # (a line of the writer thread may follow it)
    finally:
        stop(server)
        print("\n".join(f"{s:6.1f} s  {c}" for c, s, _ in ran))
    assert used == set(range(len(SUBS))), f"SUBS entries the page no longer needs: {set(range(len(SUBS))) - used}"
    out = {i: o for i, (_, _, o) in enumerate(ran)}

    # 0-1: the pilot's prompts, answered by the server, a few set aside for the evaluation
    pilot, held = jsonl(work / "data" / "prompts" / "pilot.jsonl"), jsonl(work / "data" / "heldout-pilot.jsonl")
    answered = jsonl(work / "data" / "regen" / "pilot.jsonl")
    assert len(pilot) == PILOT and len(answered) + len(held) == PILOT
    assert len(held) >= 2, f"{len(held)} held-out prompts for make eval's 2: raise PILOT, or lower --heldout_every in SUBS"
    assert all(r["messages"][-1]["role"] == "user" for r in held)
    assert all(r["messages"][-1]["role"] == "assistant" and r["regen"]["new_tokens"] == [8] for r in answered)
    # 2: the plan (which wrote nothing), the cache, complete, verified and shown so
    assert "dry run ok" in out[2] and "storage plan:" in out[2] and "taps [1, 16, 31, 46, 61]" in out[2]
    assert "every shard committed, hashed and matching" in out[4]
    assert "complete]" in out[5] and "verified: ok" in out[5]
    # 3: the recipe's drafter (5 layers, the last full, the others sliding over 2048) trained a few steps; resumed
    cfg = json.loads((work / "runs" / "q36-pilot" / "config.json").read_text())
    assert cfg["train"]["sliding_window"] == 2048 and cfg["train"]["num_layers"] == 5
    assert cfg["train"]["variant"] == "dflash2" and cfg["train"]["weighting"] == "dpace"  # (the recipe's drafter)
    assert "train done: 2 steps (0 → 2)" in out[6] and "resumed runs/q36-pilot at step 2" in out[7]
    # 4-5: the export, and the page's serving lines are what it prints
    assert {"config.json", "model.safetensors", "dflash.py"} <= {p.name for p in (work / "export" / "q36-pilot").iterdir()}
    exported = json.loads((work / "export" / "q36-pilot" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["dflash_config"]["selector_top_k"] == 16
    serving = [c for body in blocks(text, "bash") for c in commands(body) if "speculative" in c]
    printed = [re.sub(r" \[.*\]$", "", line.split(":", 1)[1].strip()) for line in out[8].splitlines()
               if line.strip().startswith(("vLLM:", "SGLang:"))]
    assert len(serving) == len(printed) == 2, (serving, out[8])
    paths = {"/ckpt/Qwen3.6-27B": str(target), "export/q36-pilot": str(work / "export" / "q36-pilot")}
    assert [re.sub("|".join(map(re.escape, paths)), lambda m: paths[m[0]], c) for c in serving] == printed
    # 6: real speculative decoding on the held-out prompts, lossless with the trained and an untrained drafter
    for name in ("eval.json", "eval-untrained.json"):
        ev = json.loads((work / "runs" / "q36-pilot" / name).read_text())
        assert ev["lossless"] and ev["num_prompts"] == 2, (name, ev)
        print(f"{name}: real τ {ev['tau_mean']:.2f}, lossless {ev['lossless']}")  # 1.00: random weights, nothing learnt
    assert (work / "runs" / "q36-pilot" / "report" / "index.md").is_file()


def test_the_text_only_stand_in_is_the_same_language_model(tmp_path, real_fixtures):
    """What transformers serve answers with is the target: the same logits as the vision-language stand-in's text
    path, token for token."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    vl = standin.build(tmp_path / "vl", "qwen3.6", depth=4)
    text = standin.text_only(vl, tmp_path / "text")
    assert json.loads((text / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    ids = torch.tensor([[248045, 846, 198, 9419, 0, 248046, 198]])
    with torch.no_grad():
        a = Qwen3_5ForConditionalGeneration.from_pretrained(vl, dtype=torch.float32)(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)
