"""Projected taps (`[extract] project_dims=k`): the calibration's P, the stored z = Pᵀh, training on z, the export's
fold back to an ordinary z-lab drafter, verify, the storage plan and the refusals — on the tiny Qwen3.5 target."""

import dataclasses
import json
import re
import shutil
import struct

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_offline import projection, verification
from dflash_offline.anchors import block_input_ids, block_position_ids
from dflash_offline.cache import encodings
from dflash_offline.cache.manifest import PROJECTION_FILE, read_manifest
from dflash_offline.cache.projection_file import ProjectionError, read_projection, write_projection
from dflash_offline.cache.shards import hidden_shard_name, read_hidden, read_token_shard, token_shard_name
from dflash_offline.config import ConfigError, ExtractConfig, TokenizeConfig, VerifyConfig
from dflash_offline.dataset import open_hidden_cache
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, load_target_embeddings
from dflash_offline.export import ExportError, export
from dflash_offline.extract_plan import make_plan
from dflash_offline.projection import SecondMoment, retained, top_k
from dflash_offline.trainsetup import TrainConfig
from stages import extract, train, verify

K, ROWS = 32, 4  # projected dims a tap (the tiny target's hidden size is 64), calibration rows
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
            trackers="none", lr=3e-3, warmup_steps=1, steps=2, ckpt_every=2)


def configs(root, target, corpus, **kw):
    tok = TokenizeConfig(corpus=[str(corpus)], tokenizer=str(target), cache_root=str(root), seq_len=128,
                         rows_per_shard=4, workers=1, max_docs=12).resolve()
    ext = ExtractConfig(target=str(target), cache_root=str(root), num_draft_layers=3, device="cpu", batch_rows=2,
                        **kw).resolve()
    return ext, tok


@pytest.fixture(scope="module")
def caches(tmp_path_factory, qwen35_dir, chat_corpus):
    """{"full", "proj", "again"}: one token cache, extracted with full states, projected (k = 32 from 4 rows), and
    projected a second time into another directory."""
    root = tmp_path_factory.mktemp("projected")
    full = extract.run(*configs(root, qwen35_dir, chat_corpus))
    proj = extract.run(*configs(root, qwen35_dir, chat_corpus, project_dims=K, project_rows=ROWS))
    again = extract.run(*configs(root, qwen35_dir, chat_corpus, project_dims=K, project_rows=ROWS,
                                 cache=str(root / "again")))
    return {"full": full, "proj": proj, "again": again}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, caches):
    """Two-step runs on the full and on the projected cache."""
    root = tmp_path_factory.mktemp("runs")
    return {name: train.run(TrainConfig.of(cache=str(caches[name]), run=str(root / name), **TINY).resolve())
            for name in ("full", "proj")}


def projections(cache) -> dict[int, torch.Tensor]:
    with safe_open(str(cache / PROJECTION_FILE), framework="pt") as f:
        return {int(name.removeprefix("P.L")): f.get_tensor(name) for name in f.keys()}


def layers(cache, shard: int) -> list[torch.Tensor]:
    ids = read_manifest(cache)["config"]["layer_ids"]
    return read_hidden(cache / hidden_shard_name(shard), ids, dtype=torch.float32).chunk(len(ids), dim=-1)


# --- (a) the calibration ---------------------------------------------------------------------------------------


def test_calibration_gives_orthonormal_top_k_eigenvectors_deterministically(caches):
    m, Ps = read_manifest(caches["proj"]), projections(caches["proj"])
    ids = m["config"]["layer_ids"]
    assert sorted(Ps) == sorted(ids) and m["projection"]["dims"] == K and m["projection"]["rows"] == ROWS
    for P in Ps.values():
        assert P.dtype == torch.float32 and P.shape == (64, K)
        torch.testing.assert_close(P.t() @ P, torch.eye(K), atol=1e-5, rtol=0)
    # the same calibration again: the same file, byte for byte, and the same shards
    assert (caches["again"] / PROJECTION_FILE).read_bytes() == (caches["proj"] / PROJECTION_FILE).read_bytes()
    again = read_manifest(caches["again"])
    assert again["projection"]["sha256"] == m["projection"]["sha256"] and again["key"] == m["key"]
    assert [s["files"] for s in again["shards"]] == [s["files"] for s in m["shards"]]
    # P and the retained energy are those of E[h hᵀ] over the real tokens of the first ROWS rows of the full cache
    full = read_manifest(caches["full"])
    tokens = caches["full"] / full["config"]["tokens_dir"]
    docs = read_token_shard(tokens / token_shard_name(0))["doc_ids"][:ROWS]
    assert full["shards"][0]["rows"] >= ROWS
    real = torch.from_numpy(docs >= 0)
    for lid, h in zip(ids, layers(caches["full"], 0), strict=True):
        mom = SecondMoment(64)
        mom.add(h[:ROWS][real])
        P, kept = top_k(mom, K)
        assert m["projection"]["retained"][str(lid)] == pytest.approx(kept, rel=1e-9)
        assert kept == pytest.approx(retained(mom.spectrum()[0], K), rel=1e-12) and 0.5 < kept < 1
        torch.testing.assert_close(Ps[lid], P, atol=1e-5, rtol=0)


# --- (b) what the shards store ---------------------------------------------------------------------------------


def test_stored_z_is_p_transpose_h_of_the_full_cache(caches):
    m, Ps = read_manifest(caches["proj"]), projections(caches["proj"])
    ids = m["config"]["layer_ids"]
    for shard in range(m["num_shards"]):
        for lid, z, h in zip(ids, layers(caches["proj"], shard), layers(caches["full"], shard), strict=True):
            assert z.shape == (*h.shape[:2], K)
            want = h @ Ps[lid]
            assert ((z - want).norm() / want.norm()).item() < 4e-3  # bf16 rounding of z (2^-8 at most per value)
            torch.testing.assert_close(z, want, rtol=8e-3, atol=1e-5)


# --- (c) the fold is exact ---------------------------------------------------------------------------------------


def test_the_exported_drafter_on_full_states_equals_the_trained_one_on_projected_states(runs, caches, tmp_path,
                                                                                        qwen35_dir):
    from transformers import AutoModel

    run = runs["proj"]
    out = export(run, tmp_path / "out", dtype="float32")
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    cfg = json.loads((run / "config.json").read_text())
    dc = DrafterConfig(**cfg["drafter"])
    assert dc.tap_width == K and cfg["projection"]["dims"] == K
    trained = DFlashDrafter(dc).eval()
    trained.load_state_dict(load_file(str(run / "checkpoints" / "step-00000002" / "model.safetensors")))
    assert trained.fc.weight.shape == (64, 3 * K)
    ids = dc.target_layer_ids
    Ps = [projections(caches["proj"])[lid] for lid in ids]
    embed, head = (t.float() for t in load_target_embeddings(qwen35_dir))
    g = torch.Generator().manual_seed(0)
    B, S, L = 2, 48, dc.block_size
    h = torch.randn(B, S, 3 * 64, generator=g) * 3  # any h: fc(h) = fc' Pᵀ h holds on the whole space
    z = torch.cat([x @ P for x, P in zip(h.chunk(3, dim=-1), Ps, strict=True)], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(hf.fc(h), trained.fc(z), rtol=1e-5, atol=1e-5)
        ids_BS = torch.randint(0, 1980, (B, S), generator=g)
        pos, doc = torch.arange(S).repeat(B, 1), torch.zeros(B, S, dtype=torch.long)
        anchors, keep = torch.tensor([[3, 20], [10, 30]]), torch.ones(B, 2, dtype=torch.bool)
        masks = trained.build_masks(doc, anchors, keep, attn="dense")
        want = trained(z, ids_BS, pos, anchors, keep, embed, masks, attn="dense")
        got = hf(position_ids=torch.cat([pos, block_position_ids(pos, anchors, L)], dim=1),
                 noise_embedding=F.embedding(block_input_ids(ids_BS, anchors, keep, L, dc.mask_token_id), embed),
                 target_hidden=h, attention_mask=masks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got @ head.t(), want @ head.t(), rtol=1e-4, atol=1e-4)  # the draft logits
    prov = json.loads((out / "dflash_export.json").read_text())
    assert prov["projection"]["sha256"] == read_manifest(caches["proj"])["projection"]["sha256"]
    assert prov["drafter"]["tap_width"] == 0


def test_untrained_evaluation_of_a_projected_run_is_the_folded_fresh_drafter(runs, caches):
    from dflash_offline.evalrun import EvalConfig, load_drafter
    from dflash_offline.evaluation import run_info

    run = runs["proj"]
    model, artifact, dc = load_drafter(EvalConfig(run=str(run), untrained=True), run_info(run), run,
                                       torch.device("cpu"), torch.float32, print)
    assert dc.tap_width == 0 and model.fc.weight.shape == (64, 3 * 64) and artifact["untrained_seed"] == 0
    torch.manual_seed(0)
    fresh = DFlashDrafter(DrafterConfig(**json.loads((run / "config.json").read_text())["drafter"]))
    Ps = [projections(caches["proj"])[lid] for lid in dc.target_layer_ids]
    h = torch.randn(5, 3 * 64)
    z = torch.cat([x @ P for x, P in zip(h.chunk(3, dim=-1), Ps, strict=True)], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(model.fc(h), fresh.fc(z), rtol=1e-5, atol=1e-6)


def test_the_teacher_forced_estimate_of_the_folded_drafter_on_a_projected_cache_is_the_trained_ones(runs, caches):
    from dflash_offline.evaluation import teacher_forced
    from dflash_offline.projection import fold_state

    run = runs["proj"]
    dc = DrafterConfig(**json.loads((run / "config.json").read_text())["drafter"])
    trained = DFlashDrafter(dc).eval()
    trained.load_state_dict(load_file(str(run / "checkpoints" / "step-00000002" / "model.safetensors")))
    folded = DFlashDrafter(dataclasses.replace(dc, tap_width=0)).eval()
    folded.load_state_dict(fold_state(trained.state_dict(), [projections(caches["proj"])[i] for i in
                                                             dc.target_layer_ids]))
    embed, head = (t.float() for t in load_target_embeddings(read_manifest(caches["proj"])["config"]["extract"]
                                                             ["target"]))
    got, want = (teacher_forced(m, embed, head, caches["proj"], 7.0, 2, 2, 8) for m in (folded, trained))
    assert got["batches"] == want["batches"] == 2 and got["acc"] == want["acc"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


# --- (d) the export is an ordinary one ---------------------------------------------------------------------------


def test_the_export_of_a_projected_run_has_the_tensors_and_config_of_an_unprojected_one(runs, tmp_path):
    outs = {name: export(run, tmp_path / name) for name, run in runs.items()}

    def tensors(out):
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            return f.metadata(), {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}

    assert tensors(outs["proj"]) == tensors(outs["full"])
    assert tensors(outs["proj"])[1]["fc.weight"] == ((64, 3 * 64), "BF16")
    configs = [json.loads((outs[name] / "config.json").read_text()) for name in ("full", "proj")]
    assert configs[0] == configs[1]
    assert (outs["proj"] / "dflash.py").read_bytes() == (outs["full"] / "dflash.py").read_bytes()


def test_a_projected_run_keeps_its_projection_and_exports_without_its_cache(runs, caches, qwen35_dir, tmp_path):
    """Training copies the cache's P into RUN/projection.safetensors; with the cache gone (the run's records point at
    a path that does not exist), export folds with that copy: the same bytes as with the cache."""
    run = runs["proj"]
    assert (run / PROJECTION_FILE).read_bytes() == (caches["proj"] / PROJECTION_FILE).read_bytes()
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    gone = str(tmp_path / "no-such-cache")
    cfg = json.loads((moved / "config.json").read_text())
    cfg["projection"]["cache"] = cfg["train"]["cache"] = gone
    (moved / "config.json").write_text(json.dumps(cfg))
    for meta_file in (moved / "checkpoints").glob("step-*/meta.json"):
        meta = json.loads(meta_file.read_text())
        meta["config"]["projection"]["cache"] = gone
        meta_file.write_text(json.dumps(meta))
    a = export(run, tmp_path / "a")
    b = export(moved, tmp_path / "b", target=str(qwen35_dir))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    (moved / PROJECTION_FILE).unlink()  # … and without either, the error says what to restore
    with pytest.raises(ExportError, match=r"no-such-cache, which is gone .* or the run's copy of it; restore either"):
        export(moved, tmp_path / "c", target=str(qwen35_dir))


def test_resuming_after_the_cache_got_another_projection_is_refused(runs, caches, tmp_path):
    """The cache re-extracted in place keeps its key (dims, rows) but not its P: a resume would continue fc' on
    another basis, so it is refused, and the run's copy of the P it started on is left as it was."""
    run = tmp_path / "run"
    shutil.copytree(runs["proj"], run)
    meta_file = run / "checkpoints" / "step-00000002" / "meta.json"  # what the resume starts from records its P
    meta = json.loads(meta_file.read_text())
    meta["config"]["projection"]["sha256"] = "0" * 64  # as if it had started on another P
    meta_file.write_text(json.dumps(meta))
    (run / "config.json").unlink()  # not needed: a machine may hold only the checkpoints
    copy = (run / PROJECTION_FILE).read_bytes()
    with pytest.raises(ValueError, match=r"trained on projection 000000000000… and its cache now holds projection "
                                         r"[0-9a-f]{12}… .*restore the cache the run started on"):
        train.run(TrainConfig.of(cache=str(caches["proj"]), run=str(run), resume=True, **{**TINY, "steps": 4}).resolve())
    assert (run / PROJECTION_FILE).read_bytes() == copy and not (run / "config.json").exists()


def test_status_shows_the_projection(caches):
    from stages import status

    line = status.report(caches["proj"])["summary"]["projection"]
    rec = read_manifest(caches["proj"])["projection"]
    assert line.startswith(f"{K} of 64 dims a tap from {ROWS} calibration rows, energy kept ")
    assert line.endswith(f"{PROJECTION_FILE} {rec['sha256'][:12]}")
    assert "projection" not in status.report(caches["full"])["summary"]


# --- (e) the cache key, and a projection file that is not the manifest's ----------------------------------------


def test_the_cache_key_changes_with_the_projection(caches, qwen35_dir, chat_corpus, tmp_path):
    tokens = caches["full"] / read_manifest(caches["full"])["config"]["tokens_dir"]
    keys = {}
    for dims, rows in ((0, 64), (K, ROWS), (K, 8), (64, ROWS)):
        ext, _ = configs(tmp_path, qwen35_dir, chat_corpus, project_dims=dims, project_rows=rows)
        keys[dims, rows] = make_plan(ext, tokens).key
    assert len(set(keys.values())) == 4
    assert keys[0, 64] == read_manifest(caches["full"])["key"]  # off: the key of a full-state cache is unchanged
    assert keys[K, ROWS] == read_manifest(caches["proj"])["key"]


def test_a_projection_file_not_the_manifests_is_refused_by_the_trainer_and_export(caches, runs, copy_cache,
                                                                                 tmp_path):
    cache = copy_cache(caches["proj"], tmp_path / "cache")
    Ps = projections(cache)
    write_projection(cache, {lid: -P for lid, P in Ps.items()}, {"dims": K})  # another file, same shapes
    msg = rf"{cache / PROJECTION_FILE} has SHA-256 .* the manifest records .*extract the cache again"
    with pytest.raises(ProjectionError, match=msg):
        train.run(TrainConfig.of(cache=str(cache), run=str(tmp_path / "run"), **TINY).resolve())
    assert not (tmp_path / "run").exists()  # refused before the run started
    with pytest.raises(ProjectionError, match=msg):
        open_hidden_cache(cache, [1, 3, 5])
    (cache / PROJECTION_FILE).unlink()
    with pytest.raises(ProjectionError, match=rf"{cache / PROJECTION_FILE} is missing"):
        read_projection(cache, [1])
    # the run's cache extracted again since (another projection): export says so instead of folding the wrong P
    run = tmp_path / "run-copy"
    shutil.copytree(runs["proj"], run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["projection"]["sha256"] = "0" * 64
    (run / "config.json").write_text(json.dumps(cfg))
    meta_file = run / "checkpoints" / "step-00000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["projection"]["sha256"] = "0" * 64
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"is [0-9a-f]{12}…, the run trained on 0{12}…: the cache was extracted again"):
        export(run, tmp_path / "out")


def test_a_missing_or_replaced_projection_file_is_shown_by_status_and_refused_by_extract_before_load(
        caches, runs, copy_cache, qwen35_dir, chat_corpus, tmp_path, monkeypatch, capsys):
    """A projected cache whose projection.safetensors was deleted read "complete" in `make status`, and
    `make extract CACHE=` said nothing to do (or, unfinished, loaded the target first). Now status says DAMAGED with
    the fix (a run's copy), and extract refuses it before any weight loads; a run's copy put back makes it whole."""
    from dflash_offline import target
    from stages import status

    cache = copy_cache(caches["proj"], tmp_path / "cache")
    sha = read_manifest(cache)["projection"]["sha256"]
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, project_dims=K, project_rows=ROWS, cache=str(cache))
    assert status.report(cache)["complete"] and status.report(cache)["projection_error"] is None

    def no_load(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(target, "load_target", no_load)
    (cache / PROJECTION_FILE).unlink()
    r = status.report(cache)
    assert not r["complete"] and f"{cache / PROJECTION_FILE} is missing" in r["projection_error"]
    status.print_report(r, False)
    out = capsys.readouterr().out
    assert "DAMAGED]" in out and f"BAD projection: {cache / PROJECTION_FILE} is missing" in out, out
    assert f"RUN/{PROJECTION_FILE}: copy back the one whose SHA-256 is {sha[:12]}" in out, out
    with pytest.raises(ProjectionError, match=rf"{cache / PROJECTION_FILE} is missing.*copy back the one whose "
                                              rf"SHA-256 is {sha[:12]}"):
        extract.run(ext, tok)
    write_projection(cache, {lid: -P for lid, P in projections(caches["proj"]).items()}, {"dims": K})
    assert "the manifest records" in status.report(cache)["projection_error"]  # another size
    with pytest.raises(ProjectionError, match=r"is \d+ bytes, the manifest records \d+"):
        extract.run(ext, tok)
    data = bytearray((caches["proj"] / PROJECTION_FILE).read_bytes())
    data[-1] ^= 1  # the same size: status stats only, extract hashes it
    (cache / PROJECTION_FILE).write_bytes(bytes(data))
    assert status.report(cache)["projection_error"] is None
    with pytest.raises(ProjectionError, match=r"has SHA-256 .* the manifest records"):
        extract.run(ext, tok)
    shutil.copy(runs["proj"] / PROJECTION_FILE, cache / PROJECTION_FILE)  # the run's copy, put back
    assert status.report(cache)["complete"]
    assert extract.run(ext, tok) == cache  # nothing to do, and no weights loaded
    edit = read_manifest(cache)
    edit["projection"] = None
    (cache / "manifest.json").write_text(json.dumps(edit))
    assert "records no projection file, yet its committed shards" in status.report(cache)["projection_error"]
    assert status.report(caches["full"])["projection_error"] is None


# --- (f) verify ----------------------------------------------------------------------------------------------------


def test_verify_passes_on_a_projected_cache_and_catches_a_changed_row(caches, copy_cache, tmp_path):
    from dflash_offline.cache.shards import hidden_shard_metadata, write_hidden_shard

    v = verify.verify(caches["proj"], VerifyConfig(cache=str(caches["proj"]), rows=2, device="cpu").resolve())
    assert v["ok"] and v["max_rel_err"] < 5e-3  # the bf16 tolerance (0.02) holds with room
    cache = copy_cache(caches["proj"], tmp_path / "cache")
    m = read_manifest(cache)
    ids = m["config"]["layer_ids"]
    shard, row = verification.sample_rows(m, 2, set())[0]
    path = cache / hidden_shard_name(shard)
    tensors = {f"hidden.L{lid}": x.to(torch.bfloat16).clone() for lid, x in zip(ids, layers(cache, shard),
                                                                                 strict=True)}
    tensors[f"hidden.L{ids[2]}"][row] *= 1.1
    entry = next(s for s in m["shards"] if s["index"] == shard)
    meta = hidden_shard_metadata(shard, m["key"], m["projection"]["sha256"])
    entry["files"][path.name] = write_hidden_shard(path, tensors, "bf16", ids, meta)
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))
    v = verify.verify(cache, VerifyConfig(cache=str(cache), rows=2, device="cpu").resolve())
    assert not v["ok"] and len(v["bad"]) == 1
    assert v["bad"][0]["shard"] == shard and v["bad"][0]["reason"].startswith(f"row {row} layer {ids[2]}: rel err")
    # the same shard as another extraction with the same key wrote it (its own P): its checksum is the manifest's,
    # its header names the other projection — verify says so, training refuses the cache
    other = hidden_shard_metadata(shard, m["key"], "f" * 64)
    entry["files"][path.name] = write_hidden_shard(path, tensors, "bf16", ids, other)
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))
    v = verify.verify(cache, VerifyConfig(cache=str(cache), rows=0, device="cpu").resolve())
    assert not v["ok"] and [b["shard"] for b in v["bad"]] == [shard]
    assert f"'projection': '{'f' * 64}'" in v["bad"][0]["reason"]
    m = read_manifest(cache)
    del m["verified"]
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))
    with pytest.raises(ValueError, match=rf"{path.name} was projected with projection ffffffffffff…, the cache "
                                         rf"records {m['projection']['sha256'][:12]}…"):
        open_hidden_cache(cache, ids)


def test_verify_records_a_damaged_projection_file_as_a_failed_verdict(caches, copy_cache, tmp_path):
    """Hashes only (rows=0) too: a projection file that is not the manifest's fails the whole cache — recorded, shown
    by make status, and refused by training like any failed verdict."""
    from stages import status

    cache = copy_cache(caches["proj"], tmp_path / "cache")
    path = cache / PROJECTION_FILE
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\1")
    v = verify.verify(cache, VerifyConfig(cache=str(cache), rows=0, device="cpu").resolve())
    assert not v["ok"] and "has SHA-256" in v["projection"]
    assert read_manifest(cache)["verified"]["ok"] is False
    assert status.fmt_verdict(read_manifest(cache)["verified"]).endswith("extract the cache again (delete "
                                                                         f"{cache}; a new projection changes every "
                                                                         "stored value, so the shards cannot be kept)")
    with pytest.raises(ValueError, match=r"verified.ok is false: .*projection.safetensors has SHA-256 .* extract the "
                                         r"cache again"):
        train.run(TrainConfig.of(cache=str(cache), run=str(tmp_path / "run"), **TINY).resolve())
    assert not (tmp_path / "run" / "checkpoints").exists()
    # the advised fix, the file put back: make verify is what is asked for, not the restore again
    shutil.copy(caches["proj"] / PROJECTION_FILE, path)
    line = status.fmt_verdict(read_manifest(cache)["verified"], str(cache), status.report(cache)["projection_error"]
                              is None)
    assert "which matches the manifest now: put back since? run make verify CACHE=" in line, line
    with pytest.raises(ValueError, match=r"found the projection file bad \(.*has SHA-256.*\); it matches the manifest "
                                         r"now: run `make verify CACHE="):
        train.run(TrainConfig.of(cache=str(cache), run=str(tmp_path / "run"), **TINY).resolve())
    assert verify.verify(cache, VerifyConfig(cache=str(cache), rows=0, device="cpu").resolve())["ok"]
    m = read_manifest(cache)  # a projection record without its size: one line, not a KeyError
    del m["projection"]["bytes"]
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))
    with pytest.raises(ValueError, match=r"projection.bytes is missing"):
        status.report(cache)


# --- (g) the storage plan ------------------------------------------------------------------------------------------


def tensor_bytes(path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items() if name != "__metadata__")


@pytest.mark.parametrize("quant", ["bf16", "fp4"])
def test_the_planned_bytes_of_a_projected_cache_are_the_bytes_its_shards_hold(caches, tmp_path, qwen35_dir,
                                                                              chat_corpus, quant):
    cache = caches["proj"] if quant == "bf16" else extract.run(*configs(
        tmp_path, qwen35_dir, chat_corpus, quant=quant, project_dims=K, project_rows=ROWS))
    m = read_manifest(cache)
    per_token = encodings.bytes_per_token(quant, 3, K)
    assert per_token == {"bf16": 3 * K * 2, "fp4": 3 * (K // 2 + K // 16 + 4)}[quant]
    tokens = cache / m["config"]["tokens_dir"]
    ext, _ = configs(tmp_path, qwen35_dir, chat_corpus, quant=quant, project_dims=K, project_rows=ROWS)
    assert make_plan(ext, tokens).bytes_per_token == per_token
    seq_len = m["producer"]["tokens"]["producer"]["seq_len"]
    for s in m["shards"]:
        (name,) = s["files"]
        assert tensor_bytes(cache / name) == s["rows"] * seq_len * per_token


def test_the_dry_run_plan_sizes_the_projected_width(tmp_path, qwen35_dir, chat_corpus, capsys):
    extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, project_dims=K, dry_run=True))
    out = capsys.readouterr().out
    assert f"3 taps × {K} projected dims (of hidden 64)" in out
    assert re.search(rf"bf16 \(chosen\) +{3 * K * 2} ", out) and re.search(rf"\n\S* +fp4 +{3 * (K // 2 + K // 16 + 4)} ", out)


# --- (h) refusals, before any weight loads ------------------------------------------------------------------------


def test_bad_project_dims_are_refused_naming_the_field_before_weights_load(tmp_path, qwen35_dir, chat_corpus,
                                                                          monkeypatch):
    from dflash_offline import target

    for bad in (48, -32, 33):
        with pytest.raises(ConfigError, match=rf"^extract.project_dims={bad}: give a multiple of 32"):
            configs(tmp_path, qwen35_dir, chat_corpus, project_dims=bad)
    with pytest.raises(ConfigError, match=r"^extract.project_rows must be > 0"):
        configs(tmp_path, qwen35_dir, chat_corpus, project_dims=K, project_rows=0)

    def no_load(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(target, "load_target", no_load)
    with pytest.raises(ConfigError, match=r"^extract.project_dims=96 is larger than .* hidden size 64"):
        extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, project_dims=96))
    assert not list(tmp_path.glob("hidden-*"))


def test_calibration_rows_with_fewer_real_tokens_than_dims_are_refused(tmp_path, qwen35_dir, chat_corpus,
                                                                       monkeypatch):
    """Fewer samples than k: the top-k eigenvectors past the moment's rank would be arbitrary directions (and the
    retained energy 1.0): refused, nothing recorded."""
    real_batches = projection.calibration_batches

    def mostly_padding(cfg, plan):
        for batch, real in real_batches(cfg, plan):
            batch[2][:, 10:] = -1  # doc_ids: 10 real tokens a row
            yield batch, real

    monkeypatch.setattr(projection, "calibration_batches", mostly_padding)
    with pytest.raises(ValueError, match=rf"^extract.project_rows=2: the calibration rows hold 20 real tokens, fewer "
                                         rf"than project_dims={K}: raise project_rows"):
        extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, project_dims=K, project_rows=2))
    cache = next(tmp_path.glob("hidden-*"))
    assert "projection" not in read_manifest(cache) and not (cache / PROJECTION_FILE).exists()


# --- (h) several processes --------------------------------------------------------------------------------------


class TwoRanks:
    """An accelerator of two processes whose other rank sends `other` (this rank's own tensor when None)."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, other=None):
        self.other, self.sent = other, None

    def gather(self, t):
        self.sent = t
        return torch.cat([t, t if self.other is None else self.other])


def test_processes_reading_different_projections_under_one_key_are_refused(caches, tmp_path):
    """Two machines, each with its own extraction of the same cache key, hold different P: ranks would train one fc'
    on different bases. Copies of one extraction (same key, same P, another path) are fine."""
    from dflash_offline.trainsetup import same_start_on_every_rank

    info = open_hidden_cache(caches["proj"], read_manifest(caches["proj"])["config"]["layer_ids"])
    here = TwoRanks()
    same_start_on_every_rank(here, False, tmp_path / "run", info)  # both ranks read this cache: no error
    copy = dataclasses.replace(info, cache_dir=tmp_path / "copy")
    same_start_on_every_rank(TwoRanks(here.sent), False, tmp_path / "run", copy)
    other = dataclasses.replace(info, projection=dict(info.projection, sha256="f" * 64))
    with pytest.raises(ValueError, match=r"the processes read different caches \(rank\(s\) 0; rank\(s\) 1; this "
                                         rf"one's key {info.key[:12]}, projection ffffffffffff\): every machine must "
                                         r"read one cache"):
        same_start_on_every_rank(TwoRanks(here.sent), False, tmp_path / "run", other)
    full = dataclasses.replace(info, projection=None)
    with pytest.raises(ValueError, match="the processes read different caches"):
        same_start_on_every_rank(TwoRanks(here.sent), False, tmp_path / "run", full)
