"""Identities that extraction checks before any weight loads: the target's fingerprint covers every byte of its
weights (and costs a stat per file once remembered), a token cache's tokenizer must give ids the target's meanings,
rows must fit the target's positions."""

import json
import shutil
import struct

import pytest

from dflash_offline import target as tgt
from dflash_offline import targetid, tokenization
from dflash_offline.cache.fsio import sha256_file
from dflash_offline.config import ExtractConfig, TokenizeConfig
from dflash_offline.targetid import TargetError, target_fingerprint
from stages import extract


def copy_target(src, dst, **config):
    """A copy of the tiny target at `dst` (its hash memo left out), config.json's text config updated with `config`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(targetid.HASH_MEMO))
    cfg = json.loads((dst / "config.json").read_text())
    (cfg.get("text_config") or cfg).update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def unsampled_offset(path) -> int:
    """A byte of the tensor data that the sampled fingerprint's 16 × 64 KiB windows do not read."""
    size = path.stat().st_size
    starts = [int(i * (size - targetid.SAMPLE_BYTES) / (targetid.SAMPLES - 1)) for i in range(targetid.SAMPLES)]
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    gap = next(s + targetid.SAMPLE_BYTES for s, nxt in zip(starts, starts[1:], strict=False)
               if nxt - s > targetid.SAMPLE_BYTES and s + targetid.SAMPLE_BYTES > header)
    return gap + 7


def test_a_change_outside_the_sampled_windows_changes_the_fingerprint(tmp_path, qwen35_dir, monkeypatch):
    """The sampled fingerprint missed a byte between its windows; the full one does not, and remembers each file's
    hash until the file changes (another inode, mtime or size)."""
    ckpt = copy_target(qwen35_dir, tmp_path / "t")
    before = {s: target_fingerprint(ckpt, scheme=s) for s in ("sampled", "sha256")}
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[unsampled_offset(weights)] ^= 0x10
    weights.write_bytes(bytes(data))
    assert target_fingerprint(ckpt, scheme="sampled") == before["sampled"]  # the old blind spot
    hashed = []
    real = targetid.sha256_file
    monkeypatch.setattr(targetid, "sha256_file", lambda p: (hashed.append(p.name), real(p))[1])
    after = target_fingerprint(ckpt)
    assert after["weights_fingerprint"] != before["sha256"]["weights_fingerprint"] and after["weights_hash"] == "sha256"
    assert hashed == ["model.safetensors"] and (ckpt / targetid.HASH_MEMO).is_file()
    assert target_fingerprint(ckpt) == after and hashed == ["model.safetensors"]  # remembered: a stat, no read
    shutil.copy(ckpt / targetid.HASH_MEMO, tmp_path / "memo")
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # same size, rewritten in place
    assert target_fingerprint(ckpt) != after and hashed == ["model.safetensors"] * 2


def test_a_read_only_checkpoint_remembers_its_hashes_in_the_user_cache(tmp_path, qwen35_dir, monkeypatch):
    ckpt = copy_target(qwen35_dir, tmp_path / "t")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real = targetid.write_json_atomic

    def read_only(path, obj, durable=True):
        if path.parent == ckpt:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, obj, durable)

    monkeypatch.setattr(targetid, "write_json_atomic", read_only)
    first = target_fingerprint(ckpt)
    assert not (ckpt / targetid.HASH_MEMO).exists() and len(list((tmp_path / "xdg" / "dflash_offline").iterdir())) == 1
    monkeypatch.setattr(targetid, "sha256_file", lambda p: pytest.fail("hashed again"))
    assert target_fingerprint(ckpt) == first
    # writable again and the weights changed: hashed once, remembered beside them; the user cache's copy, now stale,
    # does not hide that (it did: every later start hashed the file again)
    monkeypatch.setattr(targetid, "write_json_atomic", real)
    monkeypatch.setattr(targetid, "sha256_file", sha256_file)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    changed = target_fingerprint(ckpt)
    assert changed != first and (ckpt / targetid.HASH_MEMO).is_file()
    monkeypatch.setattr(targetid, "sha256_file", lambda p: pytest.fail("hashed again"))
    assert target_fingerprint(ckpt) == changed


def test_a_hub_cache_snapshot_gets_no_file_of_ours(tmp_path, qwen35_dir, monkeypatch):
    """A revision in the HF hub cache holds huggingface_hub's files only: the hashes go to the user cache, even
    though the snapshot directory is writable."""
    ckpt = copy_target(qwen35_dir, tmp_path / "hub" / "models--Qwen--Qwen3.6-27B" / "snapshots" / "abc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    files = sorted(p.name for p in ckpt.iterdir())
    first = target_fingerprint(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == files
    assert len(list((tmp_path / "xdg" / "dflash_offline").iterdir())) == 1
    monkeypatch.setattr(targetid, "sha256_file", lambda p: pytest.fail("hashed again"))
    assert target_fingerprint(ckpt) == first


def test_train_check_reads_an_old_cache_in_its_sampled_scheme(qwen35_dir):
    """A cache made before full hashes records the sampled fingerprint and no weights_hash: still the same target."""
    old = target_fingerprint(qwen35_dir, scheme="sampled")
    assert "weights_hash" not in old
    targetid.check_same_target(str(qwen35_dir), old, "cache/old", str(qwen35_dir))
    with pytest.raises(TargetError, match="weights_fingerprint"):
        targetid.check_same_target(str(qwen35_dir), dict(old, weights_fingerprint="0" * 64), "cache/old",
                                   str(qwen35_dir))


def configs(tmp_path, target, corpus, tokenizer=None, **kw):
    tok = TokenizeConfig(corpus=[str(corpus)], tokenizer=str(tokenizer or target), cache_root=str(tmp_path / "cache"),
                         seq_len=kw.pop("seq_len", 128), rows_per_shard=4, workers=1, max_docs=24)
    ext = ExtractConfig(target=str(target), cache_root=str(tmp_path / "cache"), num_draft_layers=3, device="cpu",
                        batch_rows=2, **kw)
    return ext.resolve(), tok.resolve()


@pytest.fixture
def no_weights(monkeypatch):
    monkeypatch.setattr(tgt, "load_target", lambda *a, **k: pytest.fail("weights loaded"))


def swapped_tokenizer(src, dst):
    """The target's tokenizer files with the ids of two ordinary tokens swapped: same size, other meanings."""
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, dst / f)
    tj = json.loads((dst / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_a_token_cache_of_another_tokenizer_is_refused_before_weights_load(tmp_path, qwen35_dir, chat_corpus,
                                                                           no_weights):
    other = swapped_tokenizer(qwen35_dir, tmp_path / "swapped")
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, tokenizer=other)
    tokens = tokenization.run(tok)
    ext.tokens = str(tokens)
    with pytest.raises(TargetError) as e:
        extract.run(ext, None)
    msg = str(e.value)
    assert "\n" not in msg and f"token cache {tokens} was made with tokenizer {other}" in msg
    assert f"target {qwen35_dir} ships another" in msg and f"--tokenizer={qwen35_dir}" in msg
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, tokenizer=other, dry_run=True)
    with pytest.raises(TargetError, match="ships another"):  # a dry run (stage 1a in memory) is refused too
        extract.run(ext, tok)
    assert not list((tmp_path / "cache").glob("hidden-*"))


def test_a_token_cache_that_records_no_tokenizer_is_said_to_be_unchecked(tmp_path, qwen35_dir, chat_corpus,
                                                                         no_weights, capsys):
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, dry_run=True)
    tokens = tokenization.run(tok)
    m = json.loads((tokens / "manifest.json").read_text())
    assert m["tokenizer_vocab"]["vocab_sha256"] and m["tokenizer_vocab"]["path"] == str(qwen35_dir)
    del m["tokenizer_vocab"]  # as a cache made before caches recorded their tokenizer
    (tokens / "manifest.json").write_text(json.dumps(m))
    ext.tokens = str(tokens)
    assert extract.run(ext, None) is None
    assert f"warning: token cache {tokens} records no tokenizer vocabulary" in capsys.readouterr().out
    tokenization.run(tok)  # the same key, so the same tokenizer files: the record is filled in
    assert json.loads((tokens / "manifest.json").read_text())["tokenizer_vocab"]["vocab_sha256"]


def test_rows_longer_than_the_targets_positions_are_refused(tmp_path, qwen35_dir, chat_corpus, no_weights):
    short = copy_target(qwen35_dir, tmp_path / "short", max_position_embeddings=64)
    ext, tok = configs(tmp_path, short, chat_corpus)
    want = rf"seq_len=128 is longer than {short}'s max_position_embeddings=64"
    with pytest.raises(TargetError, match=want):
        tokenization.run(tok)  # stage 1a alone, with the target's tokenizer: before a record is read
    with pytest.raises(TargetError, match=want):
        extract.run(ext, tok)
    _, tok = configs(tmp_path, qwen35_dir, chat_corpus)
    ext.tokens = str(tokenization.run(tok))  # made for the long target, extracted with the short one
    with pytest.raises(TargetError, match=rf"token cache {ext.tokens}: {want}"):
        extract.run(ext, None)
    assert not list((tmp_path / "cache").glob("hidden-*"))


@pytest.mark.parametrize("pinned", [False, True])
def test_a_cache_keyed_by_the_sampled_fingerprint_is_continued_not_redone(tmp_path, qwen35_dir, chat_corpus,
                                                                          monkeypatch, capsys, pinned):
    """A cache half made before full hashes (its key holds the sampled fingerprint) is continued under its key, in
    its directory, content-addressed or pinned (CACHE=): only its missing shards are computed."""
    from dflash_offline.cache.manifest import read_manifest

    real = targetid.target_fingerprint
    kw = {"cache": str(tmp_path / "pinned")} if pinned else {}
    monkeypatch.setattr(targetid, "target_fingerprint", lambda ckpt, weights=True, scheme="sampled": real(
        ckpt, weights, "sampled"))  # the code before full hashes
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, shards="0", **kw)
    old = extract.run(ext, tok)
    assert [s["index"] for s in read_manifest(old)["shards"]] == [0]
    monkeypatch.setattr(targetid, "target_fingerprint", real)
    capsys.readouterr()
    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus, **kw)
    assert extract.run(ext, tok) == old
    out = capsys.readouterr().out
    assert "was made before targets were hashed in full" in out and "shard 0 committed" not in out
    m = read_manifest(old)
    assert len(m["shards"]) == m["num_shards"] > 1 and "weights_hash" not in m["producer"]["target"]


def test_eval_refuses_a_held_out_cache_of_another_target(tmp_path, hidden_cache, qwen35_dir):
    """`stages.evaluate --cache=` feeds the cache's states to the run's drafter: a cache of other weights (here one
    byte the sampled fingerprint would miss) is refused in one line before anything loads; the cache's own passes."""
    from dflash_offline import evalrun
    from stages import evaluate

    other = copy_target(qwen35_dir, tmp_path / "other")
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[unsampled_offset(weights)] ^= 0x10
    weights.write_bytes(bytes(data))
    run = tmp_path / "run"
    run.mkdir()
    # (a run of `other`: its config records other's fingerprint, which the eval target passes)
    (run / "config.json").write_text(json.dumps({"train": {"cache": str(hidden_cache), "target": str(other)},
                                                 "target_id": target_fingerprint(other)}))
    with pytest.raises(TargetError) as e:
        evaluate.main([f"--run={run}", f"--cache={hidden_cache}", f"--prompts={tmp_path / 'none.jsonl'}"])
    msg = str(e.value)
    assert "\n" not in msg and f"--cache={hidden_cache} was extracted from {qwen35_dir}, not from the eval target " \
                              f"{other} (weights_fingerprint" in msg
    evalrun.check_cache_target(str(hidden_cache), qwen35_dir)


def test_verify_with_another_target_is_refused_before_it_records_a_verdict(tmp_path, hidden_cache, qwen35_dir,
                                                                            copy_cache, monkeypatch):
    """`make verify TARGET=` other weights would recompute every sampled row wrong, mark every shard bad in the shared
    manifest, and send every training to re-extract: refused in one line before the target loads, nothing recorded."""
    from dflash_offline import target as target_module
    from dflash_offline.config import VerifyConfig
    from stages import verify

    cache = copy_cache(hidden_cache, tmp_path / "cache")
    before = (cache / "manifest.json").read_bytes()
    other = copy_target(qwen35_dir, tmp_path / "other")
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[unsampled_offset(weights)] ^= 0x10
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(TargetError, match=rf"target {other} is not the target {cache} was extracted from .*verify with "
                                          rf"the target the cache was extracted from"):
        verify.verify(cache, VerifyConfig(cache=str(cache), rows=1, device="cpu", target=str(other)).resolve())
    assert (cache / "manifest.json").read_bytes() == before


def sharded_copy(src, dst):
    """The tiny target as released checkpoints are: its tensors in two files that model.safetensors.index.json lists."""
    from safetensors.torch import load_file, save_file

    dst = copy_target(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(dst / f), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    return dst


def test_a_checkpoint_cut_short_is_refused_before_stage_1a_naming_the_file(tmp_path, qwen35_dir, chat_corpus,
                                                                           no_weights):
    """A weight file the index lists that is absent, or shorter than its header's tensors need (an interrupted
    download), is refused in one line naming it, before a record is tokenized; a *.safetensors the index does not
    list is not the checkpoint's and leaves its fingerprint alone; a dry run plans without the weights."""
    ckpt = sharded_copy(qwen35_dir, tmp_path / "t")
    whole = target_fingerprint(ckpt)
    second = ckpt / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    shutil.copy(second, ckpt / "consolidated.safetensors")  # not listed: the loaders never read it
    assert target_fingerprint(ckpt) == whole
    before = target_fingerprint(ckpt, every_file=True)  # a cache made when the fingerprint took every file
    assert before != whole
    targetid.check_same_target(str(ckpt), before, "cache/x", str(ckpt))  # is still this target's
    for damage, want in ((lambda: second.unlink(), "missing, though t's model.safetensors.index.json lists it"),
                         (lambda: second.write_bytes(data[:-100]), f"{len(data) - 100:,} bytes where its header's "
                                                                   f"tensors need {len(data):,}"),
                         (lambda: second.write_bytes(data[:5]), "not a whole safetensors file")):
        damage()
        ext, tok = configs(tmp_path, ckpt, chat_corpus)
        with pytest.raises(TargetError) as e:
            extract.run(ext, tok)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{second}: {want}") and "download or copy it again" in msg, msg
        assert not (tmp_path / "cache").exists()  # nothing tokenized, no cache begun
        with pytest.raises(TargetError, match="incomplete"):  # the trainer's check of a cache's target says so too
            targetid.check_same_target(str(ckpt), whole, "cache/x", str(ckpt))
    ext, tok = configs(tmp_path, ckpt, chat_corpus, dry_run=True)
    extract.run(ext, tok)  # the storage plan, from config.json and the tokenizer
    second.write_bytes(data)
    assert target_fingerprint(ckpt) == whole


def test_a_token_cache_where_a_hidden_one_is_wanted_names_the_hidden_cache_made_from_it(tmp_path, hidden_cache,
                                                                                       qwen35_dir):
    """Training, the eval's teacher-forced estimate and verify read hidden states: given the token cache they were
    extracted from, each says so and names the hidden cache beside it, before a run directory exists (not "the
    manifest was edited or damaged", which would send a user to rebuild it)."""
    from dflash_offline import evalrun
    from dflash_offline.cache.manifest import ManifestError, read_manifest
    from stages import train, verify

    tokens = (hidden_cache / read_manifest(hidden_cache)["config"]["tokens_dir"]).resolve()
    want = (f"{tokens} is a token cache (stage 1a: token rows, no hidden states); pass the hidden-state cache "
            f"extracted from it (make extract writes cache/hidden-<key12>): {hidden_cache.resolve()}")
    for call in (lambda: train.main([f"--cache={tokens}", f"--run={tmp_path / 'r'}", "--steps=1"]),
                 lambda: evalrun.check_cache_target(str(tokens), qwen35_dir),
                 lambda: verify.main([f"--cache={tokens}", "--rows=0"])):
        with pytest.raises(ManifestError) as e:
            call()
        assert str(e.value) == want
    assert not (tmp_path / "r").exists()
    side = tmp_path / "side"  # a hidden cache pinned under any name (CACHE=) beside its token cache is named too
    shutil.copytree(tokens, side / tokens.name)
    shutil.copytree(hidden_cache, side / "my-run-cache")
    with pytest.raises(ManifestError, match=rf"pass the hidden-state cache extracted from it .*: "
                                            rf"{side / 'my-run-cache'}$"):
        verify.main([f"--cache={side / tokens.name}", "--rows=0"])
    ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(tmp_path / "c"), tokens=str(hidden_cache),
                        num_draft_layers=3, device="cpu").resolve()  # and the other way round
    with pytest.raises(ManifestError, match=rf"^{hidden_cache} is a hidden-state cache \(stage 1b\); pass a token "):
        extract.run(ext, None)


def test_a_single_file_checkpoint_cut_short_and_files_in_subfolders(tmp_path, qwen35_dir, chat_corpus, no_weights):
    """A lone model.safetensors cut short is refused naming it (its header is not read first), a dry run plans
    without it; an index may list files in a subfolder, fingerprinted by their path there."""
    ckpt = copy_target(qwen35_dir, tmp_path / "t")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    ext, tok = configs(tmp_path, ckpt, chat_corpus)
    with pytest.raises(TargetError, match=rf"^{weights}: .* bytes where its header's tensors need"):
        extract.run(ext, tok)
    ext, tok = configs(tmp_path, ckpt, chat_corpus, dry_run=True)
    extract.run(ext, tok)
    sub = sharded_copy(qwen35_dir, tmp_path / "s")
    index = json.loads((sub / "model.safetensors.index.json").read_text())
    (sub / "w").mkdir()
    for f in set(index["weight_map"].values()):
        (sub / f).rename(sub / "w" / f)
    index["weight_map"] = {k: f"w/{f}" for k, f in index["weight_map"].items()}
    (sub / "model.safetensors.index.json").write_text(json.dumps(index))
    got = target_fingerprint(sub)
    assert got["weights_fingerprint"] and json.loads((sub / targetid.HASH_MEMO).read_text()).keys() >= {
        "w/model-00001-of-00002.safetensors", "w/model-00002-of-00002.safetensors"}
