"""make verify on CPU: a value change the checksums cannot see (the manifest was updated too) is caught and named;
batched recompute finds exactly what row-by-row finds, with one forward per batch; device=cuda without CUDA is
refused before anything is read."""

import json
import re
import shutil

import pytest
import torch

from dflash_offline import verification
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import hidden_shard_name, read_hidden, write_hidden_shard
from dflash_offline.config import VerifyConfig
from stages import verify


def copy_cache(hidden_cache, tmp_path):
    """The shared cache's root (hidden + token caches, linked by a relative path) copied, so it can be tampered."""
    shutil.copytree(hidden_cache.parent, tmp_path / "root")
    return tmp_path / "root" / hidden_cache.name


def scale_row(cache, shard: int, row: int, layer_pos: int, factor: float) -> None:
    """Rewrite `shard` with one row of one layer scaled, and record the new file's checksum in the manifest."""
    m = read_manifest(cache)
    ids, path = m["config"]["layer_ids"], cache / hidden_shard_name(shard)
    x = read_hidden(path, ids).chunk(len(ids), dim=-1)
    tensors = {f"hidden.L{lid}": t.clone() for lid, t in zip(ids, x, strict=True)}
    tensors[f"hidden.L{ids[layer_pos]}"][row] *= factor
    rec = write_hidden_shard(path, tensors, "bf16", ids, {"shard": shard, "key": m["key"]})
    entry = next(s for s in m["shards"] if s["index"] == shard)
    assert entry["files"][path.name]["sha256"] != rec["sha256"]
    entry["files"][path.name] = rec
    (cache / "manifest.json").write_text(json.dumps(m, sort_keys=True))


def test_changed_values_with_a_matching_checksum_name_the_shard_and_row(hidden_cache, tmp_path, capsys):
    cache = copy_cache(hidden_cache, tmp_path)
    m = read_manifest(cache)
    assert m["num_shards"] >= 3
    shard, row = next((i, r) for i, r in verification.sample_rows(m, 2, set()) if i == 1)  # a row the sample checks
    lid = m["config"]["layer_ids"][1]
    scale_row(cache, shard, row, 1, 1.1)
    cfg = VerifyConfig(cache=str(cache), rows=2, device="cpu").resolve()
    assert verification.check_files(cache, read_manifest(cache), (cache / m["config"]["tokens_dir"]).resolve()) == []
    with pytest.raises(SystemExit) as exit_:
        verify.main([f"--cache={cache}", "--rows=2", "--device=cpu"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    err = re.search(rf"BAD shard {shard}: row {row} layer {lid}: rel err (\S+) > 0.02\n", out)
    assert err and float(err[1]) == pytest.approx(0.1, abs=2e-3), out
    assert out.count("BAD shard") == 1
    assert f"SHARD={shard}\n" in out and "hash " in out and "load " in out and "recompute " in out
    v = read_manifest(cache)["verified"]
    assert v["ok"] is False and [b["shard"] for b in v["bad"]] == [shard]
    assert v["max_rel_err"] == pytest.approx(0.1, abs=2e-3) and v["rows_per_shard"] == cfg.rows
    assert set(v["phase_seconds"]) == {"hash", "load", "recompute"}


def test_a_few_tokens_of_large_norm_do_not_hide_altered_values_on_the_others():
    """An attention-sink-like token (norm ×300) dominates a row's ‖a − b‖ / ‖b‖: every other token altered by 30 %
    moved that by < 0.01, under even bf16's tol. Per token, then RMS over tokens, the change shows at its size; an
    unaltered row, or the sink alone altered by 1 %, stays at that size too."""
    g = torch.Generator().manual_seed(0)
    fresh = torch.randn(64, 2 * 32, generator=g)  # 64 tokens, 2 layers × 32
    fresh[0] *= 300
    stored = fresh.clone()
    stored[1:] *= 1.3
    row = [((x - y).norm() / y.norm()).item() for x, y in zip(stored.chunk(2, -1), fresh.chunk(2, -1), strict=True)]
    assert max(row) < 0.01  # what the row-wide error said
    errs = verification.layer_errors(stored, fresh, 2)
    assert errs == pytest.approx([0.3 * (63 / 64) ** 0.5] * 2, rel=1e-4)
    assert verification.layer_errors(fresh, fresh, 2) == [0.0, 0.0]
    sink = fresh.clone()
    sink[0] *= 1.01
    assert verification.layer_errors(sink, fresh, 2) == pytest.approx([0.01 / 64**0.5] * 2, rel=1e-3)


def test_batched_recompute_equals_row_by_row_with_one_forward_per_batch(hidden_cache, tmp_path):
    from dflash_offline.target import load_target

    cache = copy_cache(hidden_cache, tmp_path)
    m = read_manifest(cache)
    scale_row(cache, 0, 3, 0, 1.01)  # within tol: errors to compare, none below the bf16 noise floor
    scale_row(cache, 2, 5, 2, 1.05)  # over tol
    m = read_manifest(cache)
    picked = verification.sample_rows(m, 8, set())  # every row of every shard
    assert len(picked) % 3 and len({i for i, _ in picked}) >= 3  # batches straddle shards, the last one padded
    model = load_target(m["config"]["extract"]["target"], m["config"]["layer_ids"], device="cpu",
                        dtype=torch.bfloat16)
    forward, calls = model.tapped_layers, []
    model.tapped_layers = lambda *rows: calls.append(rows[0].shape[0]) or forward(*rows)
    tokens_dir = (cache / m["config"]["tokens_dir"]).resolve()
    by_row = verification.recompute(cache, m, tokens_dir, model, picked, 0.02, batch_rows=1)
    assert calls == [1] * len(picked)
    calls.clear()
    batched = verification.recompute(cache, m, tokens_dir, model, picked, 0.02, batch_rows=3)
    assert calls == [3] * -(-len(picked) // 3)  # fixed shape, the last batch padded
    assert batched == by_row
    bad, worst = batched
    assert [(b["shard"], b["reason"].split(":")[0]) for b in bad] == [(2, f"row 5 layer {m['config']['layer_ids'][2]}")]
    assert worst == pytest.approx(0.05, abs=2e-3)


def test_device_cuda_without_cuda_is_refused_before_reading_anything(hidden_cache, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    cache = copy_cache(hidden_cache, tmp_path)
    monkeypatch.setattr(verify, "read_manifest", lambda *a: pytest.fail("read the manifest"))
    with pytest.raises(ValueError, match="verify.device=cuda but CUDA is not available"):
        verify.verify(cache, VerifyConfig(cache=str(cache), device="cuda").resolve())
    assert "verified" not in json.loads((cache / "manifest.json").read_text())


# --- the manifest as untrusted input -------------------------------------------------------------------------


def edit_manifest(cache, fn) -> None:
    m = json.loads((cache / "manifest.json").read_text())
    fn(m)
    (cache / "manifest.json").write_text(json.dumps(m))


def flip_a_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))


def hashes_only(cache) -> dict:
    return verify.verify(cache, VerifyConfig(cache=str(cache), rows=0, device="cpu").resolve())


def list_a_good_copy(cache, m) -> None:
    """Shard 0's entry names an intact copy of its file: the checksum checks a file training never opens."""
    shutil.copy(cache / hidden_shard_name(0), cache / "backup.safetensors")
    m["shards"][0]["files"] = {"backup.safetensors": m["shards"][0]["files"][hidden_shard_name(0)]}


@pytest.mark.parametrize("edit,reason", [
    (list_a_good_copy, "lists the files ['backup.safetensors'], but shard 0 is the one file hidden-00000.safetensors"),
    (lambda c, m: m["shards"][0].update(files={}), "lists the files [], but shard 0 is the one file"),
    (lambda c, m: m["shards"][0]["files"][hidden_shard_name(0)].update(bytes=1),
     "hidden-00000.safetensors is {size} bytes, its manifest entry says 1"),
    (lambda c, m: m["shards"][0].update(rows=3), "hidden-00000.safetensors holds (key, shard, quant, rows, layer_ids)"),
])
def test_verify_checks_the_file_training_reads_against_its_entry(hidden_cache, tmp_path, edit, reason):
    """With the manifest naming another file (or none) verify recorded ok for a cache whose own shard was corrupt
    (flipped here where the entry lists another file); bytes and rows were never compared with the file."""
    cache = copy_cache(hidden_cache, tmp_path)
    path = cache / hidden_shard_name(0)
    if "lists the files" in reason:
        flip_a_byte(path)
    edit_manifest(cache, lambda m: edit(cache, m))
    v = hashes_only(cache)
    assert not v["ok"] and [b["shard"] for b in v["bad"]] == [0], v["bad"]
    assert v["bad"][0]["reason"].startswith(reason.format(size=path.stat().st_size)), v["bad"][0]["reason"]


def test_a_crafted_header_is_named_by_verify_and_refused_by_training(hidden_cache, tmp_path):
    """A header whose checksums the manifest agrees with, holding a 0-row tensor: training died in a
    ZeroDivisionError when the stream read it; now it is a layout the manifest does not describe."""
    from dflash_offline.cache.shards import META_KEY, HiddenShardFile, write_safetensors
    from dflash_offline.dataset import open_hidden_cache

    cache = copy_cache(hidden_cache, tmp_path)
    m = read_manifest(cache)
    ids, path = m["config"]["layer_ids"], cache / hidden_shard_name(1)
    f = HiddenShardFile(path, m["shards"][1]["files"][path.name], "")
    meta = json.loads(f.header["__metadata__"][META_KEY])
    f.close()
    tensors = dict(zip([f"hidden.L{lid}" for lid in ids], read_hidden(path, ids).chunk(len(ids), -1), strict=True))
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    tensors[f"hidden.L{ids[1]}"] = tensors[f"hidden.L{ids[1]}"][:0]
    meta["row_digests"][f"hidden.L{ids[1]}"] = []
    rec = write_safetensors(path, tensors, {META_KEY: json.dumps(meta, sort_keys=True)})
    edit_manifest(cache, lambda m: m["shards"][1]["files"].update({path.name: rec}))
    v = hashes_only(cache)
    assert [b["shard"] for b in v["bad"]] == [1] and f"has hidden.L{ids[1]} = " in v["bad"][0]["reason"], v["bad"]
    assert "expected BF16 [8, 128, 64]" in v["bad"][0]["reason"]
    edit_manifest(cache, lambda m: m.pop("verified"))
    with pytest.raises(ValueError, match=rf"{path.name} has hidden.L{ids[1]} = .* in its header, expected BF16"):
        open_hidden_cache(cache, ids)


def test_a_count_edited_into_the_manifest_is_refused_before_anything_is_sized_by_it(hidden_cache, tmp_path):
    """num_shards = 10**15: status and train were killed by the OOM killer, verify ran for minutes; now each is
    one line (status: its count is shown unchecked, with why) in milliseconds."""
    import signal

    from dflash_offline.cache.manifest import ManifestError
    from dflash_offline.dataset import open_hidden_cache
    from stages import status

    cache = copy_cache(hidden_cache, tmp_path)
    edit_manifest(cache, lambda m: m.update(num_shards=10**15))
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("still sizing something by num_shards after 20 s"))
    signal.alarm(20)
    try:
        want = r"num_shards is 1000000000000000, but its token cache \(\.\./tokens-\w+\) has 19 shards"
        with pytest.raises(ManifestError, match=want):
            hashes_only(cache)
        with pytest.raises(ManifestError, match=want):
            open_hidden_cache(cache, read_manifest(cache)["config"]["layer_ids"])
        r = status.report(cache)
    finally:
        signal.alarm(0)
    assert r["num_shards"] is None and r["pending"] is None and not r["complete"]
    assert re.search(want, r["tokens_error"])


@pytest.fixture
def read_only(monkeypatch):
    """read_only(tree): make `tree` unwritable for this process. Not root: chmod the tree (restored after the
    test). Root, whom chmod does not stop: every call that creates, writes, renames or removes a file under `tree`
    fails with EROFS, as on a read-only mount (os.open with a write flag, open() in a write mode, os.replace,
    os.rename, os.unlink, os.mkdir)."""
    import builtins
    import errno
    import os
    import stat
    from pathlib import Path

    trees, chmodded = [], []

    def inside(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and any(
            Path(os.fsdecode(path)).resolve().is_relative_to(t) for t in trees)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def guard(real, writes):
        def call(path, *args, **kwargs):
            if writes(*args, **kwargs) and inside(path):
                refuse(path)
            return real(path, *args, **kwargs)
        return call

    def make(tree):
        tree = Path(tree).resolve()
        if os.geteuid() != 0:
            for p in [tree, *tree.rglob("*")]:
                chmodded.append((p, p.stat().st_mode))
                p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
            return
        if not trees:
            w = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
            monkeypatch.setattr(os, "open", guard(os.open, lambda flags, *a, **k: flags & w))
            writes = set("wax+")
            monkeypatch.setattr(builtins, "open", guard(builtins.open, lambda mode="r", *a, **k: set(mode) & writes))
            for name in ("replace", "rename", "unlink", "mkdir"):
                monkeypatch.setattr(os, name, guard(getattr(os, name), lambda *a, **k: True))
        trees.append(tree)

    yield make
    for p, mode in reversed(chmodded):
        p.chmod(mode)


def test_verify_status_and_training_work_on_a_read_only_cache(hidden_cache, tmp_path, read_only, capsys):
    """verify did all the work, then failed writing .lock ("fix the disk") and never named the bad shard: now it
    prints its verdict and says it could not record it; status and opening the cache for training write nothing."""
    from dflash_offline.dataset import HiddenStream, open_hidden_cache
    from stages import status

    cache = copy_cache(hidden_cache, tmp_path)
    flip_a_byte(cache / hidden_shard_name(2))
    before = (cache / "manifest.json").read_text()
    read_only(cache.parent)
    with pytest.raises(SystemExit) as exit_:
        verify.main([f"--cache={cache}", "--rows=0", "--device=cpu"])
    out = capsys.readouterr().out
    assert exit_.value.code == 1 and "BAD shard 2: hidden-00002.safetensors does not match its checksum" in out, out
    assert out.strip().splitlines()[-1].startswith(f"the verdict is not recorded in {cache}/manifest.json: it cannot "
                                                   f"be written here (")
    assert "SHARD=2" in out
    status.main([f"--cache={cache}"])
    assert "19/19 shards committed" in capsys.readouterr().out
    ids = read_manifest(cache)["config"]["layer_ids"]
    with HiddenStream(open_hidden_cache(cache, ids), batch_rows=4, prefetch=0) as stream:
        assert next(stream)["hidden"].shape == (4, 128, 3 * 64)
    assert (cache / "manifest.json").read_text() == before


# --- a verdict judged against the shards as they are now ----------------------------------------------------


def redo(cache, shards: str = "") -> None:
    """`make extract CACHE=<cache> [SHARD=<shards>]`, the command verify and training print, run in-process: the
    cache rerun from the inputs its manifest records, exactly those shards (or every uncommitted one)."""
    from dflash_offline.extract_plan import recorded_config
    from stages import extract

    extract.run(recorded_config([f"--cache={cache}"] + ([f"--shards={shards}"] if shards else [])), None)


def judged(cache, capsys) -> tuple[str, str, str]:
    """What a user is told now: `make status`'s verdict line, training's refusal (or "" where it opens the cache),
    and the same with require_verified=1."""
    from dflash_offline.cache.manifest import ManifestError
    from dflash_offline.dataset import open_hidden_cache
    from stages import status

    status.main([f"--cache={cache}"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  verified: "))
    refusals = []
    for require in (False, True):
        try:
            open_hidden_cache(cache, read_manifest(cache)["config"]["layer_ids"], require_verified=require)
            refusals.append("")
        except ManifestError as e:
            refusals.append(str(e))
    return line, *refusals


def test_a_repaired_shard_awaits_verify_not_another_redo(hidden_cache, tmp_path, capsys):
    """Shards 1 and 2 corrupted, verify FAILED naming SHARD=1-2, shard 1 redone with the printed command (the same
    bytes again): status still said "FAILED … shards 1-2" and training "redo them … SHARD=1-2", so a user redid
    work already done. Now only shard 2 is to redo; once it is redone too, status says the repair awaits
    `make verify` and training asks for that alone (it trains without require_verified: nothing is known bad); a
    verdict recorded by older code (no `seen`) is judged alike; and a fresh verify judges the repaired cache as it
    judges a copy never damaged."""
    cache = copy_cache(hidden_cache, tmp_path)
    for shard in (1, 2):
        flip_a_byte(cache / hidden_shard_name(shard))
    assert [b["shard"] for b in hashes_only(cache)["bad"]] == [1, 2]
    line, train, strict = judged(cache, capsys)
    assert re.search(r"FAILED at .*: shards 1-2", line) and "SHARD=1-2`" in train and "SHARD=1-2`" in strict, line

    redo(cache, "1")
    line, train, strict = judged(cache, capsys)
    assert re.search(r"FAILED at .*: shards 2 \(redo: make extract CACHE=\S+ SHARD=2, then make verify", line), line
    assert "not covered: shards 1 that it named have been (re)committed since" in line, line
    for refusal in (train, strict):
        assert "shard 2: hidden-00002.safetensors does not match its checksum" in refusal, refusal
        assert f"make extract CACHE={cache} SHARD=2`" in refusal and "shard 1:" not in refusal, refusal

    redo(cache, "2")
    assert all((cache / hidden_shard_name(i)).read_bytes() == (hidden_cache / hidden_shard_name(i)).read_bytes()
               for i in (1, 2))
    line, train, strict = judged(cache, capsys)
    assert line.startswith(f"  verified: repaired, awaiting make verify CACHE={cache}: the verdict of "), line
    assert line.endswith("is out of date: shards 1-2 that it named have been (re)committed since"), line
    assert "FAILED" not in line and "SHARD=" not in line and train == ""
    assert "does not cover the cache as it is now: shards 1-2 that it named have been (re)committed since" in strict
    assert f"run `make verify CACHE={cache}`" in strict and "SHARD=" not in strict and "make extract" not in strict
    edit_manifest(cache, lambda m: m["verified"].pop("seen"))  # as older code recorded it: judged by its `at`
    assert judged(cache, capsys) == (line, train, strict)

    clean = copy_cache(hidden_cache, tmp_path / "clean")
    for c in (cache, clean):
        assert hashes_only(c)["ok"]
    def same(c):  # (the paths and the minute each verdict was taken at set aside)
        at = r"\d{4}-\d\d-\d\d \d\d:\d\d"
        return tuple(re.sub(at, "<at>", x.replace(str(c), "<cache>")) for x in judged(c, capsys))

    assert same(cache) == same(clean)
    assert judged(cache, capsys)[1:] == ("", "") and "verified: ok at" in judged(cache, capsys)[0]


def test_shards_not_committed_are_told_to_finish_the_extraction_not_redone(hidden_cache, tmp_path, capsys):
    """Verify on an unfinished extraction said "Redo them with: make extract SHARD=4-6" for shards never made (a
    SHARD= redo while another extraction holds them); a damaged shard beside them still gets its redo command."""
    cache = copy_cache(hidden_cache, tmp_path)
    edit_manifest(cache, lambda m: m.update(shards=[s for s in m["shards"] if s["index"] not in (4, 5, 6)]))
    (cache / hidden_shard_name(1)).write_bytes(b"x")
    with pytest.raises(SystemExit) as exit_:
        verify.main([f"--cache={cache}", "--rows=0", "--device=cpu"])
    out = capsys.readouterr().out
    assert exit_.value.code == 1
    assert "3 shard(s) not committed yet (4-6)" in out and f"`make extract CACHE={cache}` makes them" in out, out
    assert "1 problem(s)" in out and "SHARD=1\n" in out and "BAD shard 1:" in out, out
    assert "BAD shard 4" not in out and "SHARD=1,4" not in out and "SHARD=4" not in out, out
    (cache / hidden_shard_name(1)).write_bytes((hidden_cache / hidden_shard_name(1)).read_bytes())
    with pytest.raises(SystemExit):
        verify.main([f"--cache={cache}", "--rows=0", "--device=cpu"])
    out = capsys.readouterr().out
    assert "not committed yet (4-6)" in out and "problem(s)" not in out and "SHARD=" not in out, out
    assert "hash " in out  # (the timing line all the same)
    assert [b["shard"] for b in read_manifest(cache)["verified"]["bad"]] == [4, 5, 6]
    line = judged(cache, capsys)[0]  # make status says the same
    assert "shards 4-6 were not committed yet (finish the extraction: make extract CACHE=" in line, line
    assert "SHARD=" not in line and "redo" not in line, line


def test_a_verdict_taken_before_shards_were_committed_does_not_prescribe_redoing_them(hidden_cache, tmp_path,
                                                                                      capsys):
    """Verify run while extraction was unfinished recorded "shard 4-6: not committed"; once the extraction finished
    them, training told the user to redo shards 4-6. Now the verdict no longer covers them: `make verify` only."""
    cache = copy_cache(hidden_cache, tmp_path)
    edit_manifest(cache, lambda m: m.update(shards=[s for s in m["shards"] if s["index"] not in (4, 5, 6)]))
    v = hashes_only(cache)
    assert [(b["shard"], b["reason"]) for b in v["bad"]] == [(i, "not committed") for i in (4, 5, 6)]
    redo(cache)  # the extraction finishes: every uncommitted shard
    line, train, strict = judged(cache, capsys)
    assert line.startswith(f"  verified: repaired, awaiting make verify CACHE={cache}"), line
    assert "shards 4-6 that it named have been (re)committed since" in line and "SHARD=" not in line
    assert train == "" and f"run `make verify CACHE={cache}`" in strict and "SHARD=" not in strict, strict
    assert hashes_only(cache)["ok"] and judged(cache, capsys)[1:] == ("", "")
