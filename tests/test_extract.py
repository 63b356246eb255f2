"""Stage 1b end to end on CPU: exact hidden states, reruns, SHARD= redo, kill -9, concurrent extractors, verify, FP8,
fail-fast checks."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_offline import extraction
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import hidden_shard_name, read_hidden, read_token_shard, token_shard_name
from dflash_offline.config import ExtractConfig, TokenizeConfig, VerifyConfig
from stages import extract, verify

REPO = Path(__file__).resolve().parents[1]


def configs(tmp_path, target, corpus, **kw):
    tok = TokenizeConfig(corpus=[str(corpus)], tokenizer=str(target), cache_root=str(tmp_path / "cache"),
                         seq_len=128, rows_per_shard=kw.pop("rows_per_shard", 4), workers=1, max_docs=kw.pop("docs", 40))
    ext = ExtractConfig(target=str(target), cache_root=str(tmp_path / "cache"), num_draft_layers=3, device="cpu",
                        batch_rows=2, **kw)
    return ext.resolve(), tok.resolve()


def extract_run(tmp_path, target, corpus, **kw):
    ext, tok = configs(tmp_path, target, corpus, **kw)
    return extract.run(ext, tok)


def shard_files(cache):
    return {s["index"]: cache / next(iter(s["files"])) for s in read_manifest(cache)["shards"]}


def reference_states(target, ids, layer_ids):
    """Each document alone through the full HF model (an independent path), hidden_states[id + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.as_tensor(ids)[None].long(), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_hidden_states_equal_each_document_alone(tmp_path, arch, qwen35_dir, qwen3_dir, chat_corpus):
    target = qwen35_dir if arch == "qwen3_5" else qwen3_dir
    cache = extract_run(tmp_path, target, chat_corpus, dtype="float32")
    m = read_manifest(cache)
    layer_ids = m["config"]["layer_ids"]
    n_layers = json.loads((Path(target) / "config.json").read_text())
    n_layers = (n_layers.get("text_config") or n_layers)["num_hidden_layers"]
    assert layer_ids == [round(1 + i * (n_layers - 4) / 2) for i in range(3)]
    assert m["producer"]["target"]["arch"] == arch and len(m["shards"]) == m["num_shards"] > 1
    tokens_dir = (cache / m["config"]["tokens_dir"]).resolve()
    toks = read_token_shard(tokens_dir / token_shard_name(1))
    stored = read_hidden(cache / hidden_shard_name(1), layer_ids, dtype=torch.float32)
    assert stored.shape == (toks["input_ids"].shape[0], 128, 3 * 64)
    checked = 0
    for r in range(2):
        for d in range(int(toks["doc_ids"][r].max()) + 1):
            sel = toks["doc_ids"][r] == d
            ref = reference_states(target, toks["input_ids"][r][sel], layer_ids)
            got = stored[r][torch.from_numpy(sel)]
            assert ((got - ref).norm() / ref.norm()).item() < 8e-3  # bf16 storage rounding of fp32 states
            checked += 1
        assert stored[r][torch.from_numpy(toks["doc_ids"][r] < 0)].abs().sum() == 0  # padding stored as zeros
    assert checked >= 3


def test_rerun_skips_and_shard_redo_replaces_exactly_that_shard(tmp_path, qwen35_dir, chat_corpus, capsys):
    cache = extract_run(tmp_path, qwen35_dir, chat_corpus)
    files = shard_files(cache)
    stamp = {i: (p.stat().st_mtime_ns, p.stat().st_ino) for i, p in files.items()}
    assert extract_run(tmp_path, qwen35_dir, chat_corpus) == cache
    assert "nothing to do" in capsys.readouterr().out
    assert {i: (p.stat().st_mtime_ns, p.stat().st_ino) for i, p in files.items()} == stamp
    before = read_manifest(cache)["shards"][2]
    extract_run(tmp_path, qwen35_dir, chat_corpus, shards="2")
    out = capsys.readouterr().out
    assert "[rank 0] shard 2 committed" in out and "[rank0]" not in out  # one rank prefix in every log line
    after = {i: (p.stat().st_mtime_ns, p.stat().st_ino) for i, p in shard_files(cache).items()}
    assert [i for i in after if after[i] != stamp[i]] == [2]
    entry = read_manifest(cache)["shards"][2]
    assert entry["committed_at"] > before["committed_at"] and entry["files"] == before["files"]  # same bytes


def test_a_rerun_counts_the_room_a_dead_writers_temp_file_will_give_back(tmp_path, qwen35_dir, chat_corpus,
                                                                          monkeypatch):
    """After a crash on a tight disk the rerun needs the room the dead writer's half-written shard holds: it counts it
    (the rerun removes it before the first shard) instead of refusing for lack of room it would itself free."""
    from dflash_offline import extract_plan
    from dflash_offline.cache.fsio import TEMP_MARK, boot_tag

    cache = extract_run(tmp_path, qwen35_dir, chat_corpus)
    one = shard_files(cache)[1]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    debris = one.with_name(f".{one.name}{TEMP_MARK}{socket.gethostname()}~{dead.pid}~{boot_tag()}~deadbeef")
    debris.write_bytes(b"\0" * (one.stat().st_size + 4096))
    monkeypatch.setattr(extract_plan, "free_space", lambda p: 1000)  # (less than one shard)
    extract_run(tmp_path, qwen35_dir, chat_corpus, shards="1", min_free_gb=0.0)
    assert not debris.exists()
    debris.write_bytes(b"\0" * 10)  # too small to make room: refused, naming the sizes
    with pytest.raises(ValueError, match="free"):
        extract_run(tmp_path, qwen35_dir, chat_corpus, shards="1", min_free_gb=0.0)


def test_flipped_byte_is_caught_by_verify_and_redo_repairs_it(tmp_path, qwen35_dir, chat_corpus):
    cache = extract_run(tmp_path, qwen35_dir, chat_corpus)
    vcfg = VerifyConfig(cache=str(cache), rows=1, device="cpu").resolve()
    v = verify.verify(cache, vcfg)
    assert v["ok"] and v["max_rel_err"] < 0.02, v
    path = shard_files(cache)[1]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    res = subprocess.run([sys.executable, "-m", "stages.verify", f"--cache={cache}", "--rows=1", "--device=cpu"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 1
    assert "BAD shard 1" in res.stdout and "SHARD=1" in res.stdout
    assert read_manifest(cache)["verified"]["ok"] is False
    extract_run(tmp_path, qwen35_dir, chat_corpus, shards="1")
    assert verify.verify(cache, vcfg)["ok"]


def test_corrupted_values_with_a_valid_checksum_are_caught_by_recompute(tmp_path, qwen35_dir, chat_corpus):
    """A shard whose bytes match the manifest but whose numbers are wrong (e.g. written from the wrong rows)."""
    from dflash_offline.cache.fsio import sha256_file
    from dflash_offline.cache.shards import write_hidden_shard

    cache = extract_run(tmp_path, qwen35_dir, chat_corpus)
    m = read_manifest(cache)
    ids, path = m["config"]["layer_ids"], shard_files(cache)[0]
    x = read_hidden(path, ids)
    swapped = {f"hidden.L{lid}": x[..., j * 64:(j + 1) * 64].flip(0) for j, lid in enumerate(ids)}
    write_hidden_shard(path, swapped, "bf16", ids, {"shard": 0, "key": m["key"]})
    m["shards"][0]["files"][path.name]["sha256"] = sha256_file(path)
    (cache / "manifest.json").write_text(json.dumps(m))
    v = verify.verify(cache, VerifyConfig(cache=str(cache), rows=4, device="cpu").resolve())
    assert not v["ok"] and {b["shard"] for b in v["bad"]} == {0}


def encoded_extraction(tmp_path, target, corpus, quant: str):
    """The same corpus extracted in bf16 and in `quant`: (bf16 cache, `quant` cache, shard 0's states of each in
    float32, the real (non-padding) positions), after checking that the two caches have different keys."""
    bf16 = extract_run(tmp_path / "a", target, corpus)
    enc = extract_run(tmp_path / "b", target, corpus, quant=quant)
    assert read_manifest(enc)["key"] != read_manifest(bf16)["key"]
    ids = read_manifest(bf16)["config"]["layer_ids"]
    a = read_hidden(shard_files(bf16)[0], ids, dtype=torch.float32)
    b = read_hidden(shard_files(enc)[0], ids, dtype=torch.float32)
    return bf16, enc, a, b, a.abs().sum(-1) > 0


def test_fp8_round_trip_error_bound(tmp_path, qwen35_dir, chat_corpus):
    bf16, fp8, a, b, real = encoded_extraction(tmp_path, qwen35_dir, chat_corpus, "fp8")
    err = ((a[real] - b[real]).norm() / a[real].norm()).item()
    per_elem = ((a[real] - b[real]).abs() / a[real].abs().amax(-1, keepdim=True)).max().item()
    print(f"\nFP8 e4m3 round trip: relative L2 error {err:.4f}, max error / token amax {per_elem:.4f}")
    assert err < 0.04 and per_elem <= 1 / 16 + 1e-3  # 3 mantissa bits: half an ulp at the top binade
    assert shard_files(fp8)[0].stat().st_size < 0.6 * shard_files(bf16)[0].stat().st_size
    assert verify.verify(fp8, VerifyConfig(cache=str(fp8), rows=1, device="cpu").resolve())["ok"]


def test_dry_run_and_fail_fast_before_weights_load(tmp_path, qwen35_dir, chat_corpus, monkeypatch, capsys):
    from dflash_offline import target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    assert extract_run(tmp_path, qwen35_dir, chat_corpus, dry_run=True) is None
    out = capsys.readouterr().out
    assert "kernels ok" in out and "estimated" in out and "GB" in out
    last = out.strip().splitlines()[-1]  # the dry run ends with its summary in one line
    assert re.search(r"\[rank 0\] dry run ok: \d+/\d+ shards to do, [\d.]+ GB, ~[\d.]+ min for this process, "
                     r"kernels ok \(\w+\)", last), last
    with pytest.raises(ValueError, match=r"layer_ids \[99\] out of range"):
        extract_run(tmp_path, qwen35_dir, chat_corpus, layer_ids=[1, 99])
    with pytest.raises(ValueError, match="mask_token_id=1988 must be a real embedding row"):
        extract_run(tmp_path, qwen35_dir, chat_corpus, mask_token_id=1988)  # <|im_end|> = eos
    stops = tmp_path / "stops"  # a target whose generation stops on one more token (Qwen3.6 lists two there)
    shutil.copytree(qwen35_dir, stops)
    (stops / "generation_config.json").write_text(json.dumps({"eos_token_id": [1988, 1987]}))
    with pytest.raises(ValueError, match=r"mask_token_id=1987 must be a real embedding row .* not pad/eos "
                                         r"\(\[1986, 1987, 1988\]\)"):
        extract_run(tmp_path, stops, chat_corpus, mask_token_id=1987, dry_run=True)
    assert not list((tmp_path / "cache").glob("tokens-*"))  # taps and mask refused before stage 1a tokenized
    with pytest.raises(ValueError, match="free"):
        extract_run(tmp_path, qwen35_dir, chat_corpus, min_free_gb=1e9)
    assert not list((tmp_path / "cache").glob("hidden-*"))  # nothing was created by the refused runs


def test_cache_with_another_key_is_never_overwritten(tmp_path, qwen35_dir, qwen3_dir, chat_corpus, capsys):
    """CACHE= naming a cache these settings do not make is refused before any disk check or weight load — also by a
    dry run — with what differs and the options that continue it; a new cache beside one that differs only in what a
    run chooses (a recipe now storing fp4 beside the fp8 cache extracted under it before) says how to continue that."""
    out = tmp_path / "pinned"
    extract_run(tmp_path, qwen35_dir, chat_corpus, cache=str(out))
    before = (out / "manifest.json").read_text()
    want = (r"holds another hidden cache .*differs in: quant\); to continue it \(\d+/\d+ shards done\), run with its "
            r"settings: `make extract CACHE=.*` without RECIPE= takes them from its manifest, or add "
            r'ARGS="--quant=bf16"')
    for dry in (True, False):  # (min_free_gb: the disk check would refuse first, were it checked first)
        with pytest.raises(ValueError, match=want):
            extract_run(tmp_path, qwen35_dir, chat_corpus, cache=str(out), quant="fp8", dry_run=dry, min_free_gb=1e9)
    with pytest.raises(ValueError, match=want):  # SHARD= numbers are not judged against another cache's count
        extract_run(tmp_path, qwen35_dir, chat_corpus, cache=str(out), quant="fp8", shards="999", dry_run=True)
    assert (out / "manifest.json").read_text() == before
    taps = ",".join(map(str, read_manifest(out)["producer"]["layer_ids"]))  # (its own: not 0,1,2)
    with pytest.raises(ValueError, match=rf"differs in: layer_ids, quant\).*ARGS=\"--layer_ids={taps} --quant=bf16\""):
        extract_run(tmp_path, qwen35_dir, chat_corpus, cache=str(out), quant="fp8", layer_ids=[0, 1, 2],
                    dry_run=True)
    extract_run(tmp_path, qwen35_dir, chat_corpus)  # under cache_root, bf16
    capsys.readouterr()
    extract_run(tmp_path, qwen35_dir, chat_corpus, quant="fp8", dry_run=True)
    note = capsys.readouterr()
    assert re.search(r"note: .*hidden-\w+ holds this extraction with other settings \(quant; (\d+)/\1 shards done\); "
                     r'this run starts a new cache — to continue that one instead, add ARGS="--quant=bf16"',
                     note.out + note.err), note


SCRIPT = """
import sys
from stages import extract
extract.main(sys.argv[1:])
"""


def cli(tmp_path, target, corpus, *extra):
    return [sys.executable, "-c", SCRIPT, f"--target={target}", f"--corpus={corpus}",
            f"--cache_root={tmp_path / 'cache'}", "--seq_len=128", "--rows_per_shard=2", "--max_docs=60",
            "--num_draft_layers=3", "--device=cpu", "--batch_rows=1", "--workers=1", *extra]


def test_kill_9_then_rerun_completes_without_partial_shards(tmp_path, qwen35_dir, chat_corpus):
    env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cli(tmp_path, qwen35_dir, chat_corpus), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    cache = None
    while time.time() < deadline:
        hits = list((tmp_path / "cache").glob("hidden-*/manifest.json"))
        if hits:
            cache = hits[0].parent
            m = json.loads(hits[0].read_text())
            if 1 <= len(m["shards"]) < m["num_shards"] - 2:
                break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert cache is not None
    m = read_manifest(cache)
    assert len(m["shards"]) < m["num_shards"], "the run finished before it could be killed"
    done = {s["index"] for s in m["shards"]}
    res = subprocess.run(cli(tmp_path, qwen35_dir, chat_corpus), cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    redone = {int(x) for x in __import__("re").findall(r"shard (\d+) committed", res.stdout)}
    assert not redone & done  # committed shards were not computed again
    m2 = read_manifest(cache)
    assert len(m2["shards"]) == m2["num_shards"]
    assert verify.verify(cache, VerifyConfig(cache=str(cache), rows=1, device="cpu").resolve())["ok"]


class LineWatch:
    """Reads a process's stdout on a thread (all of it kept) and says when a line matching a pattern has come."""

    def __init__(self, proc, pattern: str):
        import threading

        self.lines, self.seen, self.pattern = [], threading.Event(), re.compile(pattern)
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)
            if self.pattern.search(line):
                self.seen.set()

    def text(self) -> str:
        self.thread.join(timeout=60)
        return "".join(self.lines)


def test_two_concurrent_extractors_split_the_shards(tmp_path, qwen35_dir, chat_corpus):
    """Both workers commit shards, none twice, none missing. Their overlap is made, not hoped for: on a fast CPU the
    first one started could do every shard before the second had loaded its model, so it is paused (SIGSTOP, its
    claim still live) after its first commit until the second has committed one of its own."""
    env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    # stage 1a first, so both workers start on the same token cache (as machines sharing a filesystem would)
    subprocess.run([sys.executable, "-m", "stages.tokenize", f"--corpus={chat_corpus}", f"--tokenizer={qwen35_dir}",
                    f"--cache_root={tmp_path / 'cache'}", "--seq_len=128", "--rows_per_shard=2", "--max_docs=60",
                    "--workers=1"], cwd=REPO, env=env, check=True, capture_output=True)

    def start(i):  # (stderr to a file: the watcher alone reads the pipe)
        with open(tmp_path / f"worker{i}.err", "w") as err:
            proc = subprocess.Popen(cli(tmp_path, qwen35_dir, chat_corpus, "--wait_claims=1"), cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=err, text=True)
        return proc, LineWatch(proc, r"shard \d+ committed")

    def err(i):
        return (tmp_path / f"worker{i}.err").read_text()[-2000:]

    def first_commit(i, proc, watch):  # (a worker that dies before it fails the test at once)
        deadline = time.monotonic() + 240
        while not watch.seen.wait(timeout=0.2):
            assert proc.poll() is None and time.monotonic() < deadline, f"worker {i} committed no shard: {err(i)}"

    def holds_the_lock(proc) -> bool:  # (the cache's lock: a short read-modify-write of the manifest or a claim)
        return any(lock.read_text().split(":")[1:2] == [str(proc.pid)]
                   for lock in (tmp_path / "cache").glob("*/.lock") if lock.is_file())

    def pause(proc):
        """SIGSTOP, but never inside the lock (the other worker would wait for it, then break it as stale and race
        the paused one's write): a stopped process cannot take the lock, so what is read after the stop holds."""
        def stopped() -> bool:  # (every thread: a signal is delivered, not obeyed, when send_signal returns)
            if not Path("/proc/self/task").is_dir():  # (no procfs: a moment is all it can wait)
                time.sleep(0.05)
                return True
            states = []
            for stat in Path(f"/proc/{proc.pid}/task").glob("*/stat"):
                with contextlib.suppress(OSError):
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            return bool(states) and all(x in "tT" for x in states)

        for _ in range(500):
            proc.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not stopped():
                assert proc.poll() is None and time.monotonic() < deadline, f"worker 0 did not stop: {err(0)}"
                time.sleep(0.001)
            if not holds_the_lock(proc):
                return
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.02)
        raise AssertionError("worker 0 held the cache's lock at each of 500 pauses")

    procs, watches = [], []
    try:
        for i in range(2):
            proc, watch = start(i)
            procs.append(proc)
            watches.append(watch)
            first_commit(i, proc, watch)
            if i == 0:
                pause(proc)
        procs[0].send_signal(signal.SIGCONT)
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err(i) for i in range(2)]
    sets = [{int(x) for x in re.findall(r"shard (\d+) committed", w.text())} for w in watches]
    cache = next((tmp_path / "cache").glob("hidden-*"))
    m = read_manifest(cache)
    assert not sets[0] & sets[1], sets  # never the same shard twice
    assert sets[0] | sets[1] == set(range(m["num_shards"])) and all(sets)  # both worked, nothing missing
    assert len(m["shards"]) == m["num_shards"]


@pytest.mark.parametrize("depth", [1, 3])
def test_background_writes_overlap_up_to_write_queue_and_change_no_byte(tmp_path, qwen35_dir, chat_corpus,
                                                                        monkeypatch, depth):
    """A slow disk: `write_queue` shards go out at once (not more), the compute never waits on more than that,
    and the shards are the same bytes as with one write at a time (the reused host buffers are never
    overwritten while a write still reads them)."""
    import threading

    from dflash_offline.cache import shards

    real, lock, state, full = shards.stage_hidden_shard, threading.Lock(), {"now": 0, "max": 0}, threading.Event()

    def slow_write(*a, **kw):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            if state["now"] >= depth:
                full.set()
        full.wait(timeout=60)  # the first write is held until `depth` are out at once (however slow the compute)
        time.sleep(0.8)  # the write holds its host buffers while the next shards are computed into the others
        try:
            return real(*a, **kw)
        finally:
            with lock:
                state["now"] -= 1

    ref = extract_run(tmp_path / "ref", qwen35_dir, chat_corpus, write_queue=1)
    monkeypatch.setattr(shards, "stage_hidden_shard", slow_write)
    got = extract_run(tmp_path / "got", qwen35_dir, chat_corpus, write_queue=depth)
    want, have = read_manifest(ref), read_manifest(got)
    assert have["num_shards"] == want["num_shards"] >= 2 * depth + 1
    assert state["max"] == depth
    files = [{s["index"]: s["files"] for s in m["shards"]} for m in (want, have)]
    assert files[0] == files[1]  # same bytes, same hashes


def test_corrupt_token_shard_stops_the_run_keeping_finished_shards_and_no_stale_claims(tmp_path, qwen35_dir,
                                                                                       chat_corpus):
    """Shards are claimed and their tokens read one shard ahead (off the thread that feeds the device): a token
    shard failing its checksum stops the run with the file named, the shards before it stay committed, and no claim
    is left behind (neither the bad shard's nor one taken ahead), so a rerun after the fix picks everything up."""
    from dflash_offline import tokenization
    from dflash_offline.cache.shards import ShardError

    ext, tok = configs(tmp_path, qwen35_dir, chat_corpus)
    tokenization.run(tok)  # the token cache first; then shard 2 gets corrupted
    tokens = next((tmp_path / "cache").glob("tokens-*"))
    bad = tokens / token_shard_name(2)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=token_shard_name(2)):
        extract.run(ext, tok)
    cache = next((tmp_path / "cache").glob("hidden-*"))
    assert sorted(read_manifest(cache)["shards"][i]["index"] for i in range(2)) == [0, 1]
    assert not list((cache / "claims").glob("*.json"))


def test_the_heap_leaves_the_gc_after_the_first_shard_and_comes_back_at_the_end(tmp_path, qwen35_dir, chat_corpus,
                                                                                 monkeypatch):
    import gc

    calls = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append(1), real_freeze())[1])
    cache = extract_run(tmp_path, qwen35_dir, chat_corpus)
    assert len(read_manifest(cache)["shards"]) > 1 and calls == [1]  # once, after the first shard
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    # no more than the interpreter keeps frozen itself: nothing before Python 3.12; on 3.12 its static tuples, which
    # every full collection puts back
    assert frozen <= gc.get_freeze_count()


def test_a_failure_mid_shard_keeps_finished_shards_and_releases_both_claims(tmp_path, qwen35_dir, chat_corpus,
                                                                           monkeypatch):
    """The compute of shard 1 fails while shard 2 is already claimed ahead and shard 0 may still be writing: shard 0
    is committed, neither 1 nor 2 stays claimed (a rerun or another worker takes them at once), the error surfaces."""
    calls = {"n": 0}
    real = extraction.pad_rows

    def failing(x, b, fill):
        calls["n"] += 1
        if calls["n"] > 3 * 2:  # shard 0 is 2 batches of 3 arrays; the first batch of shard 1 fails
            raise RuntimeError("device fell over")
        return real(x, b, fill)

    monkeypatch.setattr(extraction, "pad_rows", failing)
    with pytest.raises(RuntimeError, match="device fell over"):
        extract_run(tmp_path, qwen35_dir, chat_corpus)
    cache = next((tmp_path / "cache").glob("hidden-*"))
    assert [s["index"] for s in read_manifest(cache)["shards"]] == [0]
    assert not list((cache / "claims").glob("*.json"))
    monkeypatch.setattr(extraction, "pad_rows", real)
    extract_run(tmp_path, qwen35_dir, chat_corpus)  # the rerun does the rest
    m = read_manifest(cache)
    assert sorted(s["index"] for s in m["shards"]) == list(range(m["num_shards"]))


@pytest.mark.parametrize("quant", ["bf16", "fp4"])
def test_a_shard_whose_states_hold_inf_or_nan_is_refused_naming_row_and_layer(tmp_path, qwen35_dir, chat_corpus,
                                                                              monkeypatch, quant):
    """A target that overflows gives inf/NaN states: the shard is not written (in fp8/fp4 one inf would turn the
    token's every value into NaN, with valid checksums, and training would skip every step that reads it), the error
    names the shard, row and layer, the shards before it stay committed, and a rerun does the rest."""
    from dflash_offline import target
    from dflash_offline.cache.shards import ShardError

    real, calls = target.Target.tapped_layers, {"n": 0}

    def overflowing(self, *batch):
        taps = real(self, *batch)
        calls["n"] += 1
        if calls["n"] == 4:  # shard 1 (2 batches of 2 rows a shard), its second batch: shard row 2 + 1
            taps = [t.clone() for t in taps]
            taps[1][1, 5, 3] = float("inf")
            taps[1][1, 6, 0] = float("nan")
        return taps

    monkeypatch.setattr(target.Target, "tapped_layers", overflowing)
    with pytest.raises(ShardError, match=r"shard 1: the target's tapped states hold inf or NaN \(2 token-layers; "
                                         r"row 3 layer \d+\); the shard was not written"):
        extract_run(tmp_path, qwen35_dir, chat_corpus, quant=quant)
    cache = next((tmp_path / "cache").glob("hidden-*"))
    assert [s["index"] for s in read_manifest(cache)["shards"]] == [0]
    assert not list((cache / "claims").glob("*.json")) and not (cache / hidden_shard_name(1)).exists()
    monkeypatch.setattr(target.Target, "tapped_layers", real)
    extract_run(tmp_path, qwen35_dir, chat_corpus, quant=quant)
    m = read_manifest(cache)
    assert sorted(s["index"] for s in m["shards"]) == list(range(m["num_shards"]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_stops_within_seconds_leaving_no_claim_nor_partial_file(tmp_path, qwen35_dir, chat_corpus,
                                                                                 sig):
    """Preemption (Slurm, Kubernetes and spot machines send SIGTERM) or Ctrl-C once a shard is committed: the run
    stops within seconds with one line and exit status 128 + the signal, the shard in progress leaves no file and no
    claim (another machine may take it at once), its status file says `interrupted`; a rerun completes the cache."""
    env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO))
    args = cli(tmp_path, qwen35_dir, chat_corpus)[3:]
    proc = subprocess.Popen([sys.executable, "-m", "stages.extract", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, cache = time.time() + 120, None
    while time.time() < deadline and proc.poll() is None:
        hits = list((tmp_path / "cache").glob("hidden-*/manifest.json"))
        if hits and json.loads(hits[0].read_text())["shards"]:
            cache = hits[0].parent
            break
        time.sleep(0.02)
    assert cache is not None, proc.communicate()
    t = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    stopped_s = time.time() - t
    m = read_manifest(cache)
    assert len(m["shards"]) < m["num_shards"], "the run finished before it could be stopped"
    assert proc.returncode == 128 + sig and stopped_s < 30, (proc.returncode, stopped_s, err[-2000:])
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"error: stopped by {sig.name}: "), err
    assert not list((cache / "claims").iterdir())  # released, not left live for 900 s
    assert sorted(p.name for p in cache.glob("hidden-*")) == sorted(n for s in m["shards"] for n in s["files"])
    assert not [p for p in cache.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp file
    assert [json.loads(p.read_text())["state"] for p in cache.glob("status-*.json")] == ["interrupted"]
    if sig == signal.SIGTERM:
        assert extract.main(args) == 0
        m = read_manifest(cache)
        assert sorted(s["index"] for s in m["shards"]) == list(range(m["num_shards"]))
