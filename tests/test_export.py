"""z-lab-format export: config fields, exact tensor set, the remote-code model equal to the training drafter,
inference masks and cache, lossless speculative decoding with the exported model, re-export rules, the CLI."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_offline.anchors import block_input_ids, block_position_ids
from dflash_offline.checkpoint import save_checkpoint
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, load_target_embeddings
from dflash_offline.export import ExportError, export, provenance, provenance_paths, usage
from dflash_offline.target import read_target_info
from dflash_offline.trainsetup import TrainConfig

REPO = Path(__file__).resolve().parents[1]
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
            trackers="none", lr=3e-3, warmup_steps=1, steps=2, ckpt_every=2)
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight")


def zlab_keys(num_layers: int) -> set[str]:
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}


def load_hf(out):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, hidden_cache) -> Path:
    from stages import train

    run = tmp_path_factory.mktemp("export") / "run"
    return train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), **TINY).resolve())


def fake_run(root: Path, target: Path, std: float = 0.3, **kw) -> tuple[Path, DFlashDrafter]:
    """A run directory holding one checkpoint of a randomly initialised drafter (no training) for `target`."""
    info = read_target_info(target)
    dc = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=info.intermediate_size,
                       vocab_size=info.vocab_size, target_layer_ids=[1, 3], num_target_layers=info.num_layers,
                       mask_token_id=1999, rope_theta=info.rope_theta, rms_norm_eps=info.rms_norm_eps,
                       **{"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kw})
    torch.manual_seed(0)
    model = DFlashDrafter(dc)
    with torch.no_grad():  # larger than the init so attention patterns matter in the comparisons
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
    cfg = {"train": {"target": str(target), "cache": ""}, "drafter": dataclasses.asdict(dc)}
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_checkpoint(root, 7, model, config=cfg, rng=False)
    return root, model.eval()


# --- the trained run -----------------------------------------------------------------------------------------


def test_config_has_every_engine_field(trained_run, tmp_path, qwen35_dir):
    from transformers import AutoConfig

    out = export(trained_run, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    dc = json.loads((trained_run / "config.json").read_text())["drafter"]
    info = read_target_info(qwen35_dir)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 16
    assert cfg["dflash_config"]["mask_token_id"] == dc["mask_token_id"] == 1999
    assert cfg["dflash_config"]["target_layer_ids"] == dc["target_layer_ids"] == [1, 3, 5]
    assert cfg["num_target_layers"] == info.num_layers == 8
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["num_hidden_layers"] == 2
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == info.rope_theta == 1e7
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["max_position_embeddings"] == 32768
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        64, 4, 2, 16)
    assert cfg["intermediate_size"] == info.intermediate_size and cfg["vocab_size"] == info.vocab_size
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert (out / "dflash.py").read_text() == (REPO / "dflash_offline" / "zlab_dflash.py").read_text()
    hf = AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    assert hf.model_type == "qwen3" and hf.rope_parameters["rope_theta"] == 1e7 and hf.block_size == 16
    assert hf.dflash_config["target_layer_ids"] == [1, 3, 5]


def test_weights_are_exactly_the_zlab_tensors(trained_run, tmp_path):
    out = export(trained_run, tmp_path / "out")  # bfloat16 by default
    ckpt = load_file(str(trained_run / "checkpoints" / "step-00000002" / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        tensors = {k: f.get_tensor(k) for k in keys}
    assert keys == zlab_keys(2)
    assert not any("embed" in k or "lm_head" in k for k in keys)
    for k, t in tensors.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, ckpt[k].to(torch.bfloat16)), k


def test_exported_model_equals_training_drafter(trained_run, tmp_path, qwen35_dir):
    out = export(trained_run, tmp_path / "out", dtype="float32")
    hf = load_hf(out)
    dc = DrafterConfig(**json.loads((trained_run / "config.json").read_text())["drafter"])
    ref = DFlashDrafter(dc).eval()
    ref.load_state_dict(load_file(str(trained_run / "checkpoints" / "step-00000002" / "model.safetensors")))
    embed = load_target_embeddings(qwen35_dir)[0].float()
    g = torch.Generator().manual_seed(0)
    B, S, L = 2, 64, dc.block_size
    hidden = torch.randn(B, S, 3 * dc.hidden_size, generator=g)
    ids = torch.randint(0, 1980, (B, S), generator=g)
    doc = torch.zeros(B, S, dtype=torch.long)  # row 0: docs [0,30) [30,64); row 1: [0,30) [30,50) [50,64)
    doc[:, 30:] = 1
    doc[1, 50:] = 2
    pos = torch.cat([torch.arange(30), torch.arange(34)]).repeat(B, 1)
    pos[1, 50:] = torch.arange(14)
    anchors = torch.tensor([[3, 10, 31, 40], [5, 33, 51, 60]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    with torch.no_grad():
        # packed rows with the training masks: every query, every anchor at once
        masks = ref.build_masks(doc, anchors, keep, attn="dense")
        want = ref(hidden, ids, pos, anchors, keep, embed, masks, attn="dense")
        bids = block_input_ids(ids, anchors, keep, L, dc.mask_token_id)
        got = hf(position_ids=torch.cat([pos, block_position_ids(pos, anchors, L)], dim=1),
                 noise_embedding=F.embedding(bids, embed), target_hidden=hidden, attention_mask=masks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # inference form: one block, the context is its document up to the anchor, default masks, ids + table
        for b, a in ((0, 1), (1, 2)):
            p = int(anchors[b, a])
            start = int((doc[b] == doc[b, p]).nonzero()[0])
            ctx_pos = pos[b:b + 1, start:p]
            got1 = hf(position_ids=torch.cat([ctx_pos, pos[b:b + 1, p:p + 1] + torch.arange(L)], dim=1),
                      input_ids=bids[b:b + 1, a * L:(a + 1) * L], embed_tokens=embed,
                      target_hidden=hidden[b:b + 1, start:p])
            torch.testing.assert_close(got1[0], want[b, a * L:(a + 1) * L], rtol=1e-5, atol=1e-5)


def test_reexport_is_idempotent_and_foreign_outputs_are_refused(trained_run, tmp_path, qwen35_dir):
    out = export(trained_run, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors", "dflash.py", "dflash_export.json"}
    export(trained_run, out)  # an earlier export of the same run: replaced, byte for byte the same
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    other, _ = fake_run(tmp_path / "other", qwen35_dir)
    with pytest.raises(ExportError, match="export of another run"):
        export(other, out)
    export(other, out, force=True)
    assert json.loads((out / "dflash_export.json").read_text())["run"] == "../other"  # relative to the export
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    # --force=1 replaces an export of another run, never what is not an export: files of their own, a cache, a run
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    for where, why in ((foreign, "not an export: it holds notes.txt"), (cache, "a hidden-state or token cache"),
                       (other, "is the run"), (trained_run, "is the run"), (trained_run.parent, "parent directory")):
        for force in (False, True):
            with pytest.raises(ExportError, match=why) as e:
                export(trained_run if where != other else other, where, force=force)
            assert "--force=1 (make" not in str(e.value), where  # (not offered where it cannot apply)
    assert (foreign / "notes.txt").read_text() == "mine" and (cache / "manifest.json").read_text() == "{}"
    assert (other / "config.json").is_file() and (trained_run / "config.json").is_file()
    # an export that gained files of its own (to publish it: a README, a .git) is not replaced, --force or not
    (out / "README.md").write_text("model card")
    (out / ".git").mkdir()
    for force in (False, True):
        with pytest.raises(ExportError, match=r"now also holds \.git, README\.md, which the export did not write"):
            export(other, out, force=force)
        with pytest.raises(ExportError, match="now also holds"):
            export(trained_run, out, force=force)  # (the same run's export too)
    assert (out / "README.md").read_text() == "model card" and (out / ".git").is_dir()
    (out / "README.md").unlink()
    (out / ".git").rmdir()
    a_run = tmp_path / "a-run"  # another run's directory, as export's target
    shutil.copytree(other, a_run)
    with pytest.raises(ExportError, match="a training run"):
        export(trained_run, a_run, force=True)
    assert sorted(p.name for p in a_run.iterdir()) == sorted(p.name for p in other.iterdir())
    (tmp_path / "empty").mkdir()
    export(trained_run, tmp_path / "empty", step=2)
    with pytest.raises(ValueError, match="steps available: 2"):
        export(trained_run, tmp_path / "x", step=5)
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "y")
    with pytest.raises(ExportError, match="dtype"):
        export(trained_run, tmp_path / "z", dtype="int8")


def test_the_provenance_holds_no_path_of_the_exporting_machine_and_survives_a_move(tmp_path, qwen35_dir):
    """dflash_export.json is shipped with the drafter: the run is recorded relative to the export, the target
    relative to the run (a hub id as named), so the file names no absolute path, and a run moved together with its
    export is still recognised as the export's run (re-export in place, eval's EXPORT=)."""
    from dflash_offline.evaluation import export_for_eval

    run, _ = fake_run(tmp_path / "site" / "runs" / "a", qwen35_dir)
    out = export(run, tmp_path / "site" / "export" / "a")
    prov = json.loads((out / "dflash_export.json").read_text())
    strings = [v for v in prov.values() if isinstance(v, str)]
    assert not [v for v in strings if v.startswith("/") or str(tmp_path) in v], prov
    assert prov["run"] == "../../runs/a" and prov["target"] == os.path.relpath(qwen35_dir.resolve(), run.resolve())
    assert provenance_paths(out, prov) == {"run": run.resolve(), "target": str(qwen35_dir.resolve())}
    (tmp_path / "site").rename(tmp_path / "moved")
    run, out = tmp_path / "moved" / "runs" / "a", tmp_path / "moved" / "export" / "a"
    export(run, out)  # still an export of this run: replaced, not refused
    assert export_for_eval(str(out), -1, run, log=lambda m: None) == out
    with pytest.raises(ValueError, match="is an export of run .*moved/runs/a, not of RUN="):
        export_for_eval(str(out), -1, fake_run(tmp_path / "b", qwen35_dir)[0], log=lambda m: None)
    # a target named by hub id is recorded as that id, not as the snapshot directory it resolved to
    hub = provenance(run, out, "Qwen/Qwen3.6-27B", tmp_path / "hf" / "snapshots" / "abc", None)
    assert hub == {"run": "../../runs/a", "target": "Qwen/Qwen3.6-27B"}


def test_docs_serving_gives_the_command_lines_make_export_prints_for_a_qwen36_27b_export(tmp_path):
    """docs/serving.md's vLLM and SGLang lines for the Qwen3.6-27B recipe are `usage`'s, as `make export` prints them
    (vLLM: num_speculative_tokens = block_size - 1 = 15, the V2 runner for a DFlash2 drafter and for mixed
    sliding/full layers)."""
    from test_recipes import QWEN36_27B, resolved_drafter, target_dir

    drafter = dataclasses.asdict(resolved_drafter("qwen3.6-27b", target_dir(tmp_path / "t", QWEN36_27B)))
    vllm, sglang, _ = (line.split(" ", 1)[1].strip() for line in
                       usage(Path("export/q36-dflash"), drafter, "/ckpt/Qwen3.6-27B"))
    assert json.loads(vllm.split("'")[1])["num_speculative_tokens"] == drafter["block_size"] - 1 == 15
    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().splitlines()
    assert vllm in doc and vllm.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /ckpt/Qwen3.6-27B ")
    assert sglang.removesuffix(" [--speculative-dflash-block-size 16]") in doc
    # the Qwen3.5-27B recipe's drafter (full attention in every layer) needs the V2 runner as DFlash2, not as DFlash
    for variant, v2 in (("dflash2", True), ("dflash", False)):
        d35 = dataclasses.asdict(resolved_drafter("qwen3.5-27b", target_dir(tmp_path / variant, QWEN36_27B),
                                                  **({} if variant == "dflash2" else {"variant": variant})))
        assert d35["variant"] == variant and set(d35["layer_types"] or ["full_attention"]) == {"full_attention"}
        assert ("VLLM_USE_V2_MODEL_RUNNER=1" in usage(Path("e"), d35)[0]) is v2, variant


# --- synthetic runs (no training): sliding window, cache, speculative decoding, CLI ----------------------------


@pytest.mark.parametrize("window", [None, 6])
def test_inference_masks_and_cache(tmp_path, qwen3_dir, window):
    kw = {"sliding_window": window, "layer_types": ["sliding_attention", "full_attention"]} if window else {}
    run, ref = fake_run(tmp_path / "run", qwen3_dir, **kw)
    out = export(run, tmp_path / "out", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["use_sliding_window"] is bool(window) and cfg["sliding_window"] == window
    assert cfg["rope_theta"] == 1e6 and cfg["dflash_config"]["block_size"] == 16
    vllm_line = usage(out, json.loads((out / "dflash_export.json").read_text())["drafter"])[0]
    assert ("VLLM_USE_V2_MODEL_RUNNER=1" in vllm_line) is bool(window)  # mixed sliding/full layers
    hf = load_hf(out)
    dc, L = ref.cfg, ref.cfg.block_size
    embed = load_target_embeddings(qwen3_dir)[0].float()
    g = torch.Generator().manual_seed(1)
    S = 48
    hidden = torch.randn(1, S, 2 * dc.hidden_size, generator=g)
    ids = torch.randint(0, 1980, (1, S), generator=g)
    pos = torch.arange(S)[None]
    anchors, keep = torch.tensor([[20, 33]]), torch.tensor([[True, True]])
    with torch.no_grad():
        want = ref(hidden, ids, pos, anchors, keep, embed,
                   ref.build_masks(torch.zeros(1, S, dtype=torch.long), anchors, keep, attn="dense"), attn="dense")
        bids = block_input_ids(ids, anchors, keep, L, dc.mask_token_id)

        def block(a):
            p = int(anchors[0, a])
            return p, bids[:, a * L:(a + 1) * L], torch.arange(p, p + L)[None]

        # fresh: the whole context before the anchor, default masks (other keys than the training form's masked
        # ones, so other summation order: atol 1e-5)
        for a in (0, 1):
            p, b_ids, b_pos = block(a)
            got = hf(position_ids=torch.cat([pos[:, :p], b_pos], dim=1), input_ids=b_ids, embed_tokens=embed,
                     target_hidden=hidden[:, :p])
            torch.testing.assert_close(got[0], want[0, a * L:(a + 1) * L], rtol=1e-5, atol=1e-5)
        # incremental: context 0..19 with block 0, crop to the context, then context 20..32 with block 1
        from dflash_offline.zlab_dflash import DraftKVCache

        cache = DraftKVCache()
        p0, b_ids, b_pos = block(0)
        hf(position_ids=torch.cat([pos[:, :p0], b_pos], dim=1), input_ids=b_ids, embed_tokens=embed,
           target_hidden=hidden[:, :p0], past_key_values=cache, use_cache=True)
        cache.crop(p0)
        p1, b_ids, b_pos = block(1)
        got = hf(position_ids=torch.cat([pos[:, p0:p1], b_pos], dim=1), input_ids=b_ids, embed_tokens=embed,
                 target_hidden=hidden[:, p0:p1], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(got[0], want[0, L:], rtol=1e-5, atol=1e-5)
        assert cache.get_seq_length() == p1 + L


def greedy(target, ids, n):
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_spec_generate_is_lossless(tmp_path, qwen3_dir, qwen35_dir, arch):
    """Speculative decoding with the exported drafter reproduces the target's greedy output, whatever the drafter
    proposes; with an lm_head that has one live row, drafts often agree, exercising multi-token acceptance."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    target_dir = qwen3_dir if arch == "qwen3" else qwen35_dir
    run, _ = fake_run(tmp_path / "run", target_dir)
    hf = load_hf(export(run, tmp_path / "out", dtype="float32"))
    cls = AutoModelForCausalLM if arch == "qwen3" else Qwen3_5ForConditionalGeneration
    target = cls.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    prompt = torch.randint(0, 1980, (1, 9), generator=torch.Generator().manual_seed(2))
    n = 24 if arch == "qwen3" else 12
    out = hf.spec_generate(target, prompt, max_new_tokens=n, return_stats=True)
    assert torch.equal(out.output_ids, greedy(target, prompt, n))
    if arch == "qwen3":
        with torch.no_grad():
            head = target.get_output_embeddings().weight
            live = head[7].clone()
            head.zero_()
            head[7] = live  # logits are 0 everywhere but token 7: argmax is 7 or 0
        out = hf.spec_generate(target, prompt, max_new_tokens=n, return_stats=True)
        assert torch.equal(out.output_ids, greedy(target, prompt, n))
        assert max(out.acceptance_lengths) > 1
        stopped = hf.spec_generate(target, prompt, max_new_tokens=n, stop_token_ids=[7])
        new = stopped[0, prompt.shape[1]:].tolist()
        assert 7 not in new[:-1] and (new[-1] == 7 or len(new) == n)



def test_spec_generate_stops_at_a_stop_token_accepted_inside_a_block(tmp_path, qwen3_dir):
    """No drafting after the block that accepted the first stop token, wherever it sits in the block."""
    from transformers import AutoModelForCausalLM

    run, _ = fake_run(tmp_path / "run", qwen3_dir)
    hf = load_hf(export(run, tmp_path / "out", dtype="float32"))
    target = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # two live rows: outputs of 7s and 9s (and 0s) that drafts often agree with
        head = target.get_output_embeddings().weight
        live = head[[7, 9]].clone()
        head.zero_()
        head[[7, 9]] = live
    prompt = torch.randint(0, 1980, (1, 9), generator=torch.Generator().manual_seed(6))
    full = hf.spec_generate(target, prompt, max_new_tokens=48, return_stats=True)
    new, acc = full.output_ids[0, 9:].tolist(), full.acceptance_lengths
    hit = new.index(9)
    start = [1 + sum(acc[:i]) for i in range(len(acc))]  # first new-token index of each block
    block = max(i for i, s in enumerate(start) if s <= hit)
    end = start[block] + acc[block] - 1
    assert hit < end and new[end] != 9, "the fixture no longer puts the stop inside a block that ends otherwise"
    st = hf.spec_generate(target, prompt, max_new_tokens=48, stop_token_ids=[9], return_stats=True)
    assert st.output_ids[0, 9:].tolist() == new[:hit + 1]
    assert st.acceptance_lengths == acc[:block + 1]  # that block was the last


def test_cli(tmp_path, qwen3_dir, capsys):
    from stages import export as stage

    run, _ = fake_run(tmp_path / "run", qwen3_dir)
    stage.main([f"--run={run}", f"--export={tmp_path / 'out'}", "--dtype=float16"])
    printed = capsys.readouterr().out
    assert str(tmp_path / "out") in printed
    assert '"method": "dflash"' in printed and '"num_speculative_tokens": 15' in printed
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path" in printed
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16
    # as a module: errors exit 2 with the message (before torch is imported), --help lists the settings
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "stages.export", f"--run={tmp_path / 'nope'}", "--export=x"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = subprocess.run([sys.executable, "-m", "stages.export", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0 and "--run" in res.stdout and "--dtype" in res.stdout


def test_an_export_builds_the_drafter_for_its_shapes_without_drawing_weights(trained_run, tmp_path):
    """The export's drafter on the meta device (its tensors' shapes) draws no weights, and the config's
    transformers_version is read from the installed package: drawing on meta imports torch._dynamo, and importing
    transformers takes seconds too, which the testbed's first export of a call paid (5–6 s on an H100 host, 4.3 s
    on 2 CPUs, 0.15 s now); the exported weights are the run's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = ("import sys; from dflash_offline.export import export; "
            f"export({str(trained_run)!r}, {str(tmp_path / 'out')!r}, force=True); "
            "print('dynamo', 'torch._dynamo' in sys.modules, 'transformers', 'transformers' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr
    assert "dynamo False transformers False" in res.stdout
    import transformers

    assert json.loads((tmp_path / "out" / "config.json").read_text())["transformers_version"] == transformers.__version__
    from dflash_offline.drafter import DFlashDrafter, DrafterConfig

    with torch.device("meta"):  # (shapes only, the parameters unset)
        meta = DFlashDrafter(DrafterConfig(**json.loads((trained_run / "config.json").read_text())["drafter"]))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == \
            {k: tuple(v.shape) for k, v in meta.state_dict().items()}


def test_a_target_of_other_shapes_is_refused(tmp_path, qwen3_dir):
    """--target= names the checkpoint whose ids and limits config.json copies: one of another depth, width or
    vocabulary (same RoPE) is not the target the drafter was trained on."""
    import shutil

    run, _ = fake_run(tmp_path / "run", qwen3_dir)
    other = tmp_path / "other"
    shutil.copytree(qwen3_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] += 2
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=rf"target {other} is not the one the drafter was trained on: "
                                          rf"num_target_layers {cfg['num_hidden_layers']} \(the drafter's "
                                          rf"{cfg['num_hidden_layers'] - 2}\); wrong --target="):
        export(run, tmp_path / "out", target=str(other))
    assert not (tmp_path / "out").exists()
    export(run, tmp_path / "out", target=str(qwen3_dir))  # the right one


def test_another_location_of_the_target_must_hold_the_runs_target(tmp_path, qwen3_dir):
    """--target= where the run's target moved: a copy of it is exported against; a checkpoint of the same shapes with
    other weights (Qwen3.5- and Qwen3.6-27B share one) is refused by the fingerprint the run recorded, naming both."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_offline.targetid import TargetError, target_fingerprint

    run, _ = fake_run(tmp_path / "run", qwen3_dir)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "target_id": target_fingerprint(qwen3_dir)}))
    moved = tmp_path / "moved"
    shutil.copytree(qwen3_dir, moved)
    export(run, tmp_path / "out", target=str(moved))
    weights = sorted(moved.glob("*.safetensors"))[0]
    sd = load_file(str(weights))
    name = next(iter(sd))
    save_file({**sd, name: sd[name] + 1}, str(weights))
    with pytest.raises(TargetError, match=rf"export target {moved} is not the target {run} was trained for "
                                          rf"\({qwen3_dir}; weights_fingerprint .*make export TARGET="):
        export(run, tmp_path / "out2", target=str(moved))
    assert not (tmp_path / "out2").exists()


def test_an_export_of_another_step_of_the_run_is_replaced_and_said_so(tmp_path, qwen3_dir, capsys):
    """EXPORT= holding this run's export of another step (which an eval.json may name): replaced, in one line."""
    run, model = fake_run(tmp_path / "run", qwen3_dir)
    save_checkpoint(run, 9, model, config=json.loads((run / "config.json").read_text()), rng=False)
    export(run, tmp_path / "out", step=7)
    capsys.readouterr()
    export(run, tmp_path / "out", step=7)  # (the same step again: nothing to say)
    assert "replacing" not in capsys.readouterr().out
    export(run, tmp_path / "out")
    assert f"{(tmp_path / 'out').resolve()}: replacing its export of step 7 with step 9" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "dflash_export.json").read_text())["step"] == 9


def sglang_mask_token_id(config: dict, tokenizer_dir) -> int:
    """The id the string `dflash_config.mask_token` (default "<|MASK|>") stands for in the target tokenizer: looked up
    in its vocabulary, else the id adding it as a special token gives (the next id). SGLang 0.5.23 checks a string the
    vocabulary holds against `mask_token_id` and adds one only when the config has no id
    (tests/test_engine_rules.py states its rules in full)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    token = config["dflash_config"].get("mask_token", "<|MASK|>")
    if token in tok.get_vocab():
        return tok.get_vocab()[token]
    tok.add_special_tokens({"mask_token": token})
    return tok.mask_token_id


def test_the_exported_mask_token_resolves_to_the_trained_id_in_sglang(tmp_path, qwen3_dir, real_fixtures):
    """Tiny target (a real <|MASK|> token), and the real Qwen3 (151669: the row past its 151,669 tokens) and
    Qwen3.5/3.6 (248070: <|audio_start|>) tokenizers: the config's mask_token maps back to mask_token_id."""
    from dflash_offline.export import ExportError, mask_token_for

    run, dc = fake_run(tmp_path / "run", qwen3_dir)
    cfg = json.loads((export(run, tmp_path / "out") / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token"] == "<|MASK|>"
    assert sglang_mask_token_id(cfg, qwen3_dir) == cfg["dflash_config"]["mask_token_id"]
    fixtures = real_fixtures
    for name, mask_id, token in (("qwen3", 151669, "<|MASK|>"), ("qwen3.6", 248070, "<|audio_start|>"),
                                 ("qwen3.5", 248070, "<|audio_start|>")):
        tokenizer_json = str(fixtures / name / "tokenizer.json")
        assert mask_token_for(tokenizer_json, mask_id) == token
        real = {**cfg, "dflash_config": {**cfg["dflash_config"], "mask_token_id": mask_id, "mask_token": token}}
        assert sglang_mask_token_id(real, fixtures / name) == mask_id, name
    with pytest.raises(ExportError, match="past the target tokenizer"):
        mask_token_for(str(fixtures / "qwen3" / "tokenizer.json"), 151700)
