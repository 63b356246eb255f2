"""Hidden-state stream: exact epoch coverage across ranks, 1-vs-W equivalence, layer subsets, FP8, refusals naming
the field, resume by equality, and a start-up that reads the manifest only."""

import itertools
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from dflash_offline import dataset as ds
from dflash_offline.cache import encodings
from dflash_offline.cache.manifest import ManifestError, update_manifest
from dflash_offline.cache.shards import (
    ShardError,
    hidden_shard_name,
    read_hidden,
    read_token_shard,
    token_shard_name,
)
from fixtures import fake_cache

ROWS = [7, 5, 8, 6, 4]  # 30 rows in 5 shards of unequal size
S, H, LAYERS = 16, 8, [0, 2, 4]


@pytest.fixture(scope="module")
def bf16_cache(tmp_path_factory):
    return fake_cache.make_fake_cache(tmp_path_factory.mktemp("c") / "bf16", len(ROWS), ROWS, S, H, LAYERS, "bf16", seed=3)


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory):
    return fake_cache.make_fake_cache(tmp_path_factory.mktemp("c") / "fp8", len(ROWS), ROWS, S, H, LAYERS, "fp8", seed=3)


def stream(cache, batch_rows, rank=0, world_size=1, seed=0, layers=LAYERS, **kw):
    return ds.HiddenStream(ds.open_hidden_cache(cache, layers), batch_rows, rank, world_size, seed, **kw)


def take(s, n):
    return [next(s) for _ in range(n)]


def ids(batches):
    return [int(i) for b in batches for i in b["input_ids"][:, 0]]


@pytest.mark.parametrize("world_size,batch_rows", [(1, 3), (2, 3), (3, 2), (2, 4)])
def test_every_row_once_per_epoch_across_ranks(bf16_cache, world_size, batch_rows):
    g = world_size * batch_rows
    per_epoch = sum(ROWS) // g  # (2, 4): 3 global batches, a tail of 6 rows dropped
    seen = {0: [], 1: []}
    for rank in range(world_size):
        with stream(bf16_cache, batch_rows, rank, world_size, seed=5) as s:
            assert s.batches_per_epoch == per_epoch
            for epoch in (0, 1):
                seen[epoch] += ids(take(s, per_epoch))
    for epoch in (0, 1):
        assert len(seen[epoch]) == len(set(seen[epoch])) == per_epoch * g  # none twice, none missing
        assert set(seen[epoch]) <= set(range(sum(ROWS)))
    if sum(ROWS) % g == 0:
        assert set(seen[0]) == set(seen[1]) == set(range(sum(ROWS)))


def test_rows_carry_their_own_tokens_and_states(bf16_cache):
    with stream(bf16_cache, 4, layers=[4, 0]) as s:
        for batch in take(s, 3):
            for slot, gid in enumerate(batch["input_ids"][:, 0].tolist()):
                shard = next(i for i in range(len(ROWS)) if gid < sum(ROWS[: i + 1]))
                row = gid - sum(ROWS[:shard])
                tok = read_token_shard(bf16_cache / "tokens" / token_shard_name(shard))
                assert torch.equal(batch["input_ids"][slot], torch.tensor(tok["input_ids"][row]).long())
                assert torch.equal(batch["loss_mask"][slot], torch.tensor(tok["loss_mask"][row]).bool())
                assert torch.equal(batch["doc_ids"][slot], torch.tensor(tok["doc_ids"][row]).long())
                want = read_hidden(bf16_cache / hidden_shard_name(shard), [4, 0], rows=slice(row, row + 1))[0]
                assert torch.equal(batch["hidden"][slot], want)


def test_order_is_deterministic_and_differs_between_epochs_and_seeds(bf16_cache):
    n = sum(ROWS)  # B = 2: 15 batches, 30 rows per epoch
    a, b, c = (ids(take(stream(bf16_cache, 2, seed=seed), n)) for seed in (1, 1, 2))
    assert a == b
    assert a[:n] != a[n:] and sorted(a[:n]) == sorted(a[n:]) == list(range(n))
    assert a[:n] != c[:n] and a[n:] != c[n:]
    shard_of = [i for i, r in enumerate(ROWS) for _ in range(r)]
    assert [shard_of[i] for i in a[:n]] != sorted(shard_of[i] for i in a[:n])  # shards are not read in order
    within = [[i for i in a[:n] if shard_of[i] == sh] for sh in range(len(ROWS))]
    assert any(w != sorted(w) for w in within)  # nor the rows of a shard



def test_one_process_equals_concatenation_of_ranks(bf16_cache):
    single = take(stream(bf16_cache, 6, seed=7), 12)  # 2 epochs of 5 batches, and then some
    ranks = [take(stream(bf16_cache, 2, r, 3, seed=7), 12) for r in range(3)]
    for j, batch in enumerate(single):
        for key, value in batch.items():
            assert torch.equal(value, torch.cat([ranks[r][j][key] for r in range(3)])), (j, key)


def test_layer_subset_equals_slicing_the_superset(bf16_cache):
    full = take(stream(bf16_cache, 3, seed=2), 4)
    sub = take(stream(bf16_cache, 3, seed=2, layers=[4, 0]), 4)
    for f, s in zip(full, sub, strict=True):
        assert s["hidden"].shape == (3, S, 2 * H)
        assert torch.equal(s["hidden"], torch.cat([f["hidden"][..., 2 * H:], f["hidden"][..., :H]], dim=-1))


def test_fp8_cache_decodes_within_fp8_tolerance(bf16_cache, fp8_cache):
    for b, q in zip(take(stream(bf16_cache, 3), 5), take(stream(fp8_cache, 3), 5), strict=True):
        assert torch.equal(b["input_ids"], q["input_ids"]) and q["hidden"].dtype == torch.bfloat16
        ref, dec = b["hidden"].float().view(3, S, 3, H), q["hidden"].float().view(3, S, 3, H)
        scale = ref.abs().amax(-1, keepdim=True) / 448
        assert ((dec - ref).abs() <= ref.abs() * 0.07 + scale * 2**-8).all()  # e4m3: 3 mantissa bits
        assert (dec - ref).abs().max() > 0  # it really went through FP8
    first = next(stream(fp8_cache, 1, layers=[2]))
    shard, row = stream(fp8_cache, 1).rows_of(0, 0)[0]
    assert torch.equal(first["hidden"][0], read_hidden(fp8_cache / hidden_shard_name(shard), [2],
                                                       rows=slice(row, row + 1))[0])


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    return fake_cache.make_fake_cache(tmp_path / "h", 4, 2, S, H, [1, 3])


def test_refusals_name_the_field(small):
    with pytest.raises(ManifestError, match=r"tokens is a token cache \(stage 1a: token rows, no hidden states\); "
                                            r"pass the hidden-state cache extracted from it .*: .*/h\b"):
        ds.open_hidden_cache(small / "tokens", [1])
    with pytest.raises(ManifestError, match=r"producer.layer_ids \[1, 3\] lacks \[2\]"):
        ds.open_hidden_cache(small, [1, 2])
    with pytest.raises(ManifestError, match="producer.target.hidden_size is 8 but the drafter expects 16"):
        ds.open_hidden_cache(small, [1], hidden_size=16)
    with pytest.raises(ManifestError, match="producer.tokens.producer.seq_len is 16 but the drafter expects 32"):
        ds.open_hidden_cache(small, [1], seq_len=32)
    with pytest.raises(ManifestError, match="never verified.*make verify"):
        ds.open_hidden_cache(small, [1], require_verified=True)
    assert ds.open_hidden_cache(small, [3, 1], hidden_size=H, seq_len=S).layer_ids == (3, 1)


def test_incomplete_cache_is_refused(small):
    m = json.loads((small / "manifest.json").read_text())
    update_manifest(small, shards=[s for s in m["shards"] if s["index"] not in (1, 2)])
    with pytest.raises(ManifestError, match=r"shards 1-2 of 4 are not committed.*make extract CACHE="):
        ds.open_hidden_cache(small, [1])


def test_failed_or_missing_verdict(small):
    update_manifest(small, verified={"ok": True, "bad": []})
    ds.open_hidden_cache(small, [1], require_verified=True)
    update_manifest(small, verified={"ok": False, "bad": [{"shard": 3, "reason": "checksum"},
                                                          {"shard": 0, "reason": "rel err"}]})
    with pytest.raises(ManifestError, match=r"verified.ok is false.*shard 3: checksum.*SHARD=0,3"):
        ds.open_hidden_cache(small, [1])


def test_misplaced_shard_file_is_refused(small):
    shutil.copy(small / hidden_shard_name(0), small / hidden_shard_name(1))
    with pytest.raises(ShardError, match=r"hidden-00001.*header that does not match.*SHARD=1`"):
        take(stream(small, 8, layers=[1], prefetch=1), 1)  # the whole cache in one batch
    # even with its manifest record edited to match, the file says it is another shard
    m = json.loads((small / "manifest.json").read_text())
    m["shards"][1]["files"] = {hidden_shard_name(1): m["shards"][0]["files"][hidden_shard_name(0)]}
    update_manifest(small, shards=m["shards"])
    with pytest.raises(ShardError, match=r"hidden-00001.*\(key, shard, quant, rows, layer_ids\)"):
        take(stream(small, 8, layers=[1], prefetch=1), 1)


# --- integrity on read: every byte used is checked against the manifest --------------------------------------


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def data_offset(path, name, row=0):
    """Byte offset of row `row` of tensor `name` in a safetensors file."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    info = json.loads(raw[8:8 + n])[name]
    begin, end = info["data_offsets"]
    return 8 + n + begin + row * (end - begin) // info["shape"][0]


def whole_epoch(cache, layers=LAYERS, **kw):
    with stream(cache, 1, layers=layers, **kw) as s:
        return take(s, s.batches_per_epoch)


@pytest.mark.parametrize("quant,name", [("bf16", "hidden.L2"), ("fp8", "hidden.L4"), ("fp8", "scale.L0")])
def test_a_flipped_byte_in_any_row_stops_the_stream_naming_the_shard_and_the_fix(tmp_path, quant, name):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 3, 4, S, H, LAYERS, quant, seed=1)
    whole_epoch(cache)  # intact: reads cleanly
    path = cache / hidden_shard_name(2)
    flip_byte(path, data_offset(path, name, row=3) + 5)
    with pytest.raises(ShardError, match=rf"hidden-00002.safetensors has row 3 of {name} that does not match its "
                                         rf"checksum.*`make extract CACHE={cache} SHARD=2`"):
        whole_epoch(cache, prefetch=2)
    # a reader of other layers only does not read (nor need) the damaged bytes
    other = [lid for lid in LAYERS if f"L{lid}" not in name]
    assert len(whole_epoch(cache, layers=other)) == 12


def test_a_row_read_into_a_contiguous_or_a_strided_tensor_is_the_files_row_and_a_damaged_one_is_refused(tmp_path):
    """`read_row` reads into a contiguous host tensor directly and into any other through a scratch buffer: both give
    the row safetensors itself loads, and both check it (a contiguous destination is written before the check)."""
    from safetensors.torch import load_file

    cache = fake_cache.make_fake_cache(tmp_path / "c", 1, 4, S, H, LAYERS, "bf16", seed=2)
    info = ds.open_hidden_cache(cache, LAYERS, H, S)
    path = cache / hidden_shard_name(0)
    want = load_file(str(path))
    f = ds.open_shard(info, 0)
    try:
        flat, strided = torch.empty(S, H, dtype=torch.bfloat16), torch.empty(H, S, dtype=torch.bfloat16).t()
        for row in range(4):
            for out in (flat, strided):
                f.read_row("hidden.L2", row, out)
                assert torch.equal(out, want["hidden.L2"][row])
    finally:
        f.close()
    flip_byte(path, data_offset(path, "hidden.L2", row=1) + 7)
    f = ds.open_shard(info, 0)
    try:
        for out in (flat, strided):
            with pytest.raises(ShardError, match=r"has row 1 of hidden.L2 that does not match its checksum"):
                f.read_row("hidden.L2", 1, out)
    finally:
        f.close()


def test_a_flipped_byte_in_the_header_or_a_token_shard_is_refused(tmp_path):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 2, 4, S, H, LAYERS, seed=1)
    hidden = cache / hidden_shard_name(1)
    flip_byte(hidden, 20)  # inside the header JSON
    with pytest.raises(ShardError, match=r"hidden-00001.*header that does not match its checksum"):
        whole_epoch(cache)
    flip_byte(hidden, 20)  # back as it was
    tokens = cache / "tokens" / token_shard_name(0)
    flip_byte(tokens, tokens.stat().st_size // 2)
    with pytest.raises(ShardError, match=r"tokens-00000.arrow does not match its manifest checksum"):
        whole_epoch(cache)


def test_a_hand_edited_manifest_that_contradicts_its_shards_is_refused_at_start(tmp_path):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 3, 4, S, H, LAYERS, seed=1)
    m = json.loads((cache / "manifest.json").read_text())
    m["shards"][2]["rows"] = 3
    update_manifest(cache, shards=m["shards"])
    with pytest.raises(ShardError, match=r"hidden-00002.*rows, layer_ids\) = .*, 4, .* but the manifest says .*, 3,"):
        ds.open_hidden_cache(cache, LAYERS)


def test_missing_or_resized_shards_are_refused_at_start(tmp_path):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 4, 4, S, H, LAYERS, seed=1)
    (cache / hidden_shard_name(1)).unlink()
    with open(cache / hidden_shard_name(3), "ab") as f:
        f.write(b"x")
    t = time.perf_counter()
    with pytest.raises(ManifestError, match=r"2 committed shard\(s\) are damaged on disk \(hidden-00001.safetensors "
                                            rf"is missing …\); redo them with `make extract CACHE={cache} SHARD=1,3`"):
        ds.open_hidden_cache(cache, LAYERS)
    assert time.perf_counter() - t < 1.0  # stats only


def test_shards_written_before_row_digests_are_checked_whole(tmp_path):
    """A format-1 shard (no row digests, no header checksum in the manifest) is hashed whole when opened."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dflash_offline.cache.fsio import sha256_file

    cache = fake_cache.make_fake_cache(tmp_path / "c", 2, 4, S, H, LAYERS, seed=1)
    m = json.loads((cache / "manifest.json").read_text())
    for i in range(2):
        path = cache / hidden_shard_name(i)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["dflash"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        del meta["row_digests"], meta["row_hash"]
        save_file(tensors, str(path), metadata={"dflash": json.dumps(dict(meta, format_version="1"), sort_keys=True)})
        m["shards"][i]["files"] = {path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}}
    update_manifest(cache, shards=m["shards"])
    assert len(whole_epoch(cache)) == 8
    path = cache / hidden_shard_name(0)
    flip_byte(path, path.stat().st_size - 3)
    with pytest.raises(ShardError, match=r"hidden-00000.safetensors does not match its checksum.*SHARD=0`"):
        whole_epoch(cache)


# --- resume --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 13])  # 13 + 5 crosses the epoch boundary at 15 batches
def test_resume_continues_exactly(bf16_cache, n):
    full = take(stream(bf16_cache, 2, seed=9), n + 5)
    s = stream(bf16_cache, 2, seed=9)
    take(s, n)  # the reader has prefetched past n: the state must not count that
    state = json.loads(json.dumps(s.state_dict()))
    s.close()
    assert state["samples"] == 2 * n and state["epoch"] == n // 15
    fresh = stream(bf16_cache, 2, seed=9)
    fresh.load_state_dict(state)
    for a, b in zip(full[n:], take(fresh, 5), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_several_reader_threads_hand_out_the_batches_one_reader_does_and_close_every_file(
        bf16_cache, fp8_cache, tmp_path, monkeypatch, quant):
    """`reader_threads=3` (bench.train --reader_threads): three batches read at once (made to overlap), even with
    prefetch=1, each thread with its own open shard files (a file's read buffer is its own: no file read by two
    threads), handed out in order — the same batches as one reader over two and a
    half epochs, a resume from the same position the same; `close` closes every thread's files (no descriptor left);
    a damaged row still stops the stream naming its shard."""
    cache = bf16_cache if quant == "bf16" else fp8_cache
    n = 40  # 15 batches of 2 an epoch
    with stream(cache, 2, seed=5) as ref:  # (closed: its reader must not read on once the reads are watched)
        one = take(ref, n)
    # the first three reading threads each wait at their first row until all three are there: reads overlap, always
    # (three at once with prefetch=1: every reader is given a batch, not only prefetch + 1 of them)
    real_read, barrier, lock, first, used = ds.HiddenShardFile.read_row, threading.Barrier(3, timeout=10), \
        threading.Lock(), set(), []

    def overlapping(f, name, row, out):
        t = threading.get_ident()
        with lock:
            wait = t not in first and len(first) < 3
            first.add(t)
            used.append((t, f))  # (the file objects kept: no id reused)
        if wait:
            barrier.wait()
        return real_read(f, name, row, out)

    monkeypatch.setattr(ds.HiddenShardFile, "read_row", overlapping)
    fds = len(os.listdir("/proc/self/fd"))
    s = stream(cache, 2, seed=5, prefetch=1, reader_threads=3)
    many = take(s, 25)
    readers: dict[int, set] = {}
    for t, f in used:
        readers.setdefault(id(f), set()).add(t)
    assert len({t for t, _ in used}) == 3 and all(len(ts) == 1 for ts in readers.values())  # no file shared
    state = json.loads(json.dumps(s.state_dict()))
    s.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    again = stream(cache, 2, seed=5, prefetch=4, reader_threads=3)
    again.load_state_dict(state)
    many += take(again, n - 25)
    again.close()
    for a, b in zip(one, many, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="reader_threads >= 1"):
        stream(cache, 2, reader_threads=0)
    damaged = fake_cache.make_fake_cache(tmp_path / "c", 3, 4, S, H, LAYERS, quant, seed=1)
    path = damaged / hidden_shard_name(1)
    flip_byte(path, data_offset(path, "hidden.L2", row=2) + 3)
    with pytest.raises(ShardError, match=r"hidden-00001.safetensors has row 2 of hidden.L2"):
        whole_epoch(damaged, prefetch=4, reader_threads=3)


def test_a_failed_read_is_raised_again_not_skipped(bf16_cache, monkeypatch):
    """A read that fails (a transient I/O error) raises from `next`; called again, `next` gives that batch — never the
    one after it — and the position counts only the batches handed out."""
    full = take(stream(bf16_cache, 2, seed=3), 4)
    read, failed = ds.HiddenStream._read, []

    def flaky(self, epoch, batch):
        if batch == 1 and not failed:
            failed.append(batch)
            raise OSError("the disk hiccupped")
        return read(self, epoch, batch)

    monkeypatch.setattr(ds.HiddenStream, "_read", flaky)
    s = stream(bf16_cache, 2, seed=3)
    assert torch.equal(next(s)["hidden"], full[0]["hidden"])
    with pytest.raises(OSError, match="hiccupped"):
        next(s)
    with pytest.raises(OSError, match="hiccupped"):  # the same read, still first: the stream does not move past it
        next(s)
    assert s.state_dict()["batch"] == 1
    s.close()
    s = stream(bf16_cache, 2, seed=3)
    s.load_state_dict({**stream(bf16_cache, 2, seed=3).state_dict(), "batch": 1})
    assert torch.equal(next(s)["hidden"], full[1]["hidden"]) and torch.equal(next(s)["hidden"], full[2]["hidden"])


def test_resume_across_layouts(bf16_cache):
    s = stream(bf16_cache, 6, seed=4)
    take(s, 3)
    state, nxt = s.state_dict(), next(s)
    parts = []
    for r in range(2):  # the same global batch split over 2 ranks: equivalent, allowed
        t = stream(bf16_cache, 3, r, 2, seed=4)
        t.load_state_dict(state)
        parts.append(next(t))
    assert torch.equal(torch.cat([p["hidden"] for p in parts]), nxt["hidden"])
    with pytest.raises(ValueError, match="world_size × batch_rows = 6"):
        stream(bf16_cache, 4, 0, 2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=4"):
        stream(bf16_cache, 6, seed=5).load_state_dict(state)


# --- start-up ------------------------------------------------------------------------------------------------


def test_startup_reads_the_manifest_and_the_shard_headers_only(tmp_path, monkeypatch):
    n, rows, seed, batch_rows = 500, 8, 11, 4
    first = {shard for shard, _ in ds.locate((rows,) * n, seed, 0, 0, batch_rows)}
    cache = fake_cache.make_fake_cache(tmp_path / "h", n, rows, S, H, [0, 1])
    opened, reads = [], []
    real_read, real_tokens = ds.HiddenShardFile.read_row, ds.read_token_shard
    monkeypatch.setattr(ds.HiddenShardFile, "read_row", lambda f, *a: reads.append(f.path) or real_read(f, *a))
    monkeypatch.setattr(ds, "read_token_shard", lambda p, **kw: reads.append(p) or real_tokens(p, **kw))
    real_open = ds.open_shard
    monkeypatch.setattr(ds, "open_shard", lambda info, i: opened.append(i) or real_open(info, i))
    t0 = time.perf_counter()
    s = ds.HiddenStream(ds.open_hidden_cache(cache, [1], H, S), batch_rows, seed=seed, prefetch=0)
    startup = time.perf_counter() - t0
    assert reads == [] and sorted(opened) == list(range(n)) and s.batches_per_epoch == n * rows // batch_rows
    batch = next(s)
    first_batch = time.perf_counter() - t0
    print(f"{n}-shard manifest: start-up {startup * 1e3:.1f} ms, first batch after {first_batch * 1e3:.1f} ms")
    assert len({p.name for p in reads}) == 2 * len(first) and batch["hidden"].shape == (batch_rows, S, H)
    assert startup < 1.0 and s.last_wait_s > 0 and s.total_wait_s == s.last_wait_s


def test_prefetch_hides_read_time(bf16_cache, monkeypatch):
    read = ds.HiddenStream._read
    monkeypatch.setattr(ds.HiddenStream, "_read", lambda self, e, b: time.sleep(0.1) or read(self, e, b))
    waits = {}
    for prefetch in (0, 2):
        s = stream(bf16_cache, 2, prefetch=prefetch)
        waits[prefetch] = []
        for _ in range(5):
            next(s)
            waits[prefetch].append(s.last_wait_s)
            time.sleep(0.15)  # the step's compute
        s.close()
    assert min(waits[0]) >= 0.1 and max(waits[2][1:]) < 0.05, waits


def test_locate_matches_a_literal_concatenation():
    shard_rows = (3, 1, 4, 2)
    order, _ = ds.epoch_plan(shard_rows, 6, 2)
    literal = [(int(sh), int(r)) for sh in order for r in ds.row_order(shard_rows[sh], 6, 2, int(sh))]
    assert ds.locate(shard_rows, 6, 2, 0, 10) == literal
    assert sorted(literal) == [(sh, r) for sh, n in enumerate(shard_rows) for r in range(n)]
    assert list(itertools.chain(*(ds.locate(shard_rows, 6, 2, a, a + 2) for a in range(0, 10, 2)))) == literal


# --- CUDA (make test-gpu) ------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp4"])
def test_a_resident_stream_gives_the_streamed_batches(tmp_path, quant):
    """resident=True (the cache read once onto the device) hands out exactly the batches of the streaming reader —
    across epochs, with a layer subset in another order, for every encoding — and holds what resident_bytes says."""
    cache = fake_cache.make_fake_cache(tmp_path / quant, len(ROWS), ROWS, S, 32, LAYERS, quant, seed=5)
    layers = [4, 0]
    streamed = take(stream(cache, 4, seed=2, layers=layers), 20)  # 7 batches an epoch: three epochs
    with stream(cache, 4, seed=2, layers=layers, resident=True) as s:
        held = take(s, 20)
        assert sum(t.numel() * t.element_size() for t in s._held.values()) == ds.resident_bytes(s.info)
    for a, b in zip(streamed, held, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_a_resident_stream_resumes_exactly_and_checks_every_row_once(bf16_cache, monkeypatch):
    with stream(bf16_cache, 2, seed=9) as s:
        full = take(s, 18)
    reads = []
    real = ds.HiddenShardFile.read_row
    monkeypatch.setattr(ds.HiddenShardFile, "read_row", lambda f, *a: reads.append((f.path.name, *a[:2])) or real(f, *a))
    s = stream(bf16_cache, 2, seed=9, resident=True)
    take(s, 13)  # (13 + 5 crosses the epoch boundary at 15 batches)
    assert len(reads) == len(LAYERS) * sum(ROWS) == len(set(reads))  # every row of every layer, once
    state = s.state_dict()
    s.load_state_dict(json.loads(json.dumps(state)))  # (as a resume in the same stream)
    fresh = stream(bf16_cache, 2, seed=9, resident=True)
    fresh.load_state_dict(state)
    for a, b, c in zip(full[13:], take(s, 5), take(fresh, 5), strict=True):
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_kept_resident_rows_serve_the_next_stream_on_the_same_cache_without_reading(bf16_cache, tmp_path,
                                                                                     monkeypatch):
    """`keep_resident_rows` (the testbed's training worker): a second resident stream on the same cache and layers
    reads no row and hands out what a stream that read them hands out; another layer subset, another cache or a
    process that keeps none reads its own (and replaces the kept rows); `keep_resident_rows(False)` gives them back."""
    reads = []
    real = ds.HiddenShardFile.read_row
    monkeypatch.setattr(ds.HiddenShardFile, "read_row", lambda f, *a: reads.append(f.path) or real(f, *a))
    other = fake_cache.make_fake_cache(tmp_path / "other", len(ROWS), ROWS, S, H, LAYERS, "bf16", seed=4)
    expected = {(c, seed, tuple(layers)): take(stream(c, 2, seed=seed, layers=layers, resident=True), 9)
                for c, seed, layers in [(bf16_cache, 3, LAYERS), (bf16_cache, 5, LAYERS), (bf16_cache, 5, [4, 0]),
                                        (other, 5, LAYERS)]}
    reads.clear()
    ds.keep_resident_rows()
    try:
        for c, seed, layers, kept in [(bf16_cache, 3, LAYERS, False), (bf16_cache, 5, LAYERS, True),
                                      (bf16_cache, 5, [4, 0], False), (other, 5, LAYERS, False),
                                      (other, 5, LAYERS, True)]:
            n = len(reads)
            s = stream(c, 2, seed=seed, layers=layers, resident=True)
            got = take(s, 9)
            assert s.rows_kept == kept and (len(reads) == n) == kept, (c, seed, layers)
            for a, b in zip(expected[(c, seed, tuple(layers))], got, strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a)
            del s
        assert ds._KEPT["held"] is not None
        ds.keep_resident_rows(False)
        assert ds._KEPT["held"] is None and not stream(other, 2, resident=True).rows_kept
    finally:
        ds.keep_resident_rows(False)


def test_a_resident_read_spreads_its_shards_over_threads_and_holds_what_one_thread_holds(bf16_cache, monkeypatch):
    """The resident read takes a shard a thread (`hold_threads` of them), each through its own buffer of whole rows:
    the same batches as one thread reading one row at a time, its rows read on several threads, each once."""
    def held(threads, chunk_bytes):
        monkeypatch.setattr(ds, "hold_threads", lambda shards: min(threads, shards))
        monkeypatch.setattr(ds, "HOLD_CHUNK_BYTES", chunk_bytes)
        meet[0] = threading.Barrier(threads, timeout=20)  # (each thread's first read waits for the others': all busy)
        reads.clear()
        s = stream(bf16_cache, 2, seed=4, resident=True)
        got = take(s, 16)  # (15 batches an epoch)
        assert s.held_read["threads"] == min(threads, len(ROWS))
        return got, {name for name, *_ in reads}, [tuple(r) for _, *r in reads if r[0] is not None]

    reads, meet = [], [None]
    real = ds.HiddenShardFile.read_row

    def read_row(f, *a):
        name = threading.current_thread().name
        if name not in {r[0] for r in reads}:
            reads.append((name, None, None, None))
            meet[0].wait()
        reads.append((name, f.path.name, *a[:2]))
        return real(f, *a)

    monkeypatch.setattr(ds.HiddenShardFile, "read_row", read_row)
    one_row = ds.row_bytes(stream(bf16_cache, 2).info)
    alone, names1, rows1 = held(1, 1)  # (one row a read: a chunk is at least a row)
    spread, names3, rows3 = held(3, 2 * one_row + 1)  # (two rows a read: shards of 7, 5 … rows end mid-chunk)
    assert len(names1) == 1 and len(names3) == 3
    assert sorted(rows1) == sorted(rows3) and len(rows3) == len(set(rows3)) == len(LAYERS) * sum(ROWS)
    for a, b in zip(alone, spread, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_shard_stops_the_resident_reads_not_begun(tmp_path, monkeypatch):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 4, 3, S, H, LAYERS, "bf16", seed=1)
    path = cache / hidden_shard_name(0)
    flip_byte(path, data_offset(path, "hidden.L0", row=1) + 3)
    s = stream(cache, 2, resident=True)  # (its start-up opens every shard to check its header)
    opened, real, read = [], ds.open_shard, ds.HiddenShardFile.read_row
    monkeypatch.setattr(ds, "open_shard", lambda info, shard: opened.append(shard) or real(info, shard))
    monkeypatch.setattr(ds.HiddenShardFile, "read_row",  # (a shard after the damaged one takes a while)
                        lambda f, *a: time.sleep(0.05 * (f.path.name != path.name)) or read(f, *a))
    monkeypatch.setattr(ds, "hold_threads", lambda shards: 1)
    with pytest.raises(ShardError, match=r"hidden-00000.safetensors has row 1 of hidden.L0 .*SHARD=0"):
        next(s)
    assert opened in ([0], [0, 1])  # (the thread may have begun shard 1; shards 2 and 3 were never opened)


def test_a_damaged_shard_stops_the_resident_reads_of_the_other_threads(tmp_path, monkeypatch):
    """A shard failing while another thread still reads an earlier one: the error comes at once (not after the earlier
    shard), the other threads stop before their next chunk and the shards not begun are never opened."""
    cache = fake_cache.make_fake_cache(tmp_path / "c", 6, 4, S, H, LAYERS, "bf16", seed=1)
    path = cache / hidden_shard_name(1)
    flip_byte(path, data_offset(path, "hidden.L0", row=0) + 3)
    s = stream(cache, 2, resident=True)
    opened, reads, real, read = [], [], ds.open_shard, ds.HiddenShardFile.read_row
    monkeypatch.setattr(ds, "open_shard", lambda info, shard: opened.append(shard) or real(info, shard))

    def slow_read(f, *a):  # (every shard but the damaged one takes a while: 0.1 s a row and layer)
        reads.append(f.path.name)
        time.sleep(0.1 * (f.path.name != path.name))
        return read(f, *a)

    monkeypatch.setattr(ds.HiddenShardFile, "read_row", slow_read)
    monkeypatch.setattr(ds, "hold_threads", lambda shards: 2)
    monkeypatch.setattr(ds, "HOLD_CHUNK_BYTES", 1)  # (a row a chunk)
    t0 = time.perf_counter()
    with pytest.raises(ShardError, match=r"hidden-00001.safetensors has row 0 of hidden.L0"):
        next(s)
    assert time.perf_counter() - t0 < 0.1 * len(LAYERS) * 4  # (shard 0 alone takes 1.2 s)
    assert reads.count(hidden_shard_name(0)) < len(LAYERS) * 4 and set(opened) <= {0, 1, 2}, (reads, opened)


def test_a_resident_stream_refuses_a_damaged_row_when_it_reads_the_cache(tmp_path):
    cache = fake_cache.make_fake_cache(tmp_path / "c", 3, 4, S, H, LAYERS, "bf16", seed=1)
    path = cache / hidden_shard_name(1)
    flip_byte(path, data_offset(path, "hidden.L0", row=2) + 3)
    with pytest.raises(ShardError, match=r"hidden-00001.safetensors has row 2 of hidden.L0 .*SHARD=1"):
        next(stream(cache, 2, resident=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("resident", [False, True])
def test_cuda_stream_equals_cpu_stream(request, quant, resident):
    """Streamed to the GPU, or held there (`resident`): the CPU stream's batches, on the device."""
    cache = request.getfixturevalue(f"{quant}_cache")
    cpu = take(stream(cache, 3, seed=1, layers=[4, 0]), 12)
    with stream(cache, 3, seed=1, layers=[4, 0], device="cuda", resident=resident) as s:
        gpu = take(s, 12)
        assert not resident or all(t.is_cuda for t in s._held.values())
    for a, b in zip(cpu, gpu, strict=True):
        for key in a:
            assert b[key].is_cuda and b[key].dtype == a[key].dtype and torch.equal(a[key], b[key].cpu()), key


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp4"])
def test_cuda_feed_rate_at_27b_width(tmp_path, quant):
    """Rows of Qwen3.5-27B width (S 4096, 5 layers × 5120) through the prefetching reader while the GPU 'trains'
    150 ms a step; prints read rate and data-wait fraction (files are in the page cache right after writing)."""
    cache = fake_cache.make_fake_cache(tmp_path / "h", 4, 4, 4096, 5120, [1, 16, 31, 46, 61], quant)
    info = ds.open_hidden_cache(cache, [1, 16, 31, 46, 61])
    with ds.HiddenStream(info, 1, device="cuda", prefetch=0) as s:
        next(s)
        t0 = time.perf_counter()
        for _ in range(6):
            next(s)
        torch.cuda.synchronize()
        read_s = (time.perf_counter() - t0) / 6
    row_gb = 4096 * encodings.bytes_per_token(quant, 5, 5120) / 1e9
    with ds.HiddenStream(info, 1, device="cuda", prefetch=2) as s:
        next(s)
        t0, waits = time.perf_counter(), []
        for _ in range(12):
            next(s)
            waits.append(s.last_wait_s)
            torch.cuda._sleep(int(0.15 * 1.98e9))  # ~150 ms of GPU work at 1.98 GHz
            torch.cuda.synchronize()  # the trainer's loss.item()
        total = time.perf_counter() - t0
    print(f"\n{quant}: {row_gb:.3f} GB/row read+H2D+decode {read_s * 1e3:.0f} ms ({row_gb / read_s:.1f} GB/s); "
          f"with prefetch, data wait {sum(waits) / total:.1%} of {total:.2f}s for 12 steps")
    assert sum(waits) / total < 0.25


def test_fake_cache_takes_other_token_rows_and_refuses_a_wrong_count(tmp_path):
    """make_fake_cache(token_rows=...) writes those rows (with their documents as sources); a function that
    returns another number of rows than asked is refused (the manifest would list rows the shard does not hold)."""
    def rows_of(extra):
        def token_rows(first_id, n, seq_len, gen):
            a = fake_cache.fake_token_rows(first_id, n + extra, seq_len, gen)
            a["loss_mask"][:] = 1  # one supervised document per row, no padding tail
            a["doc_ids"][:] = 0
            a["position_ids"][:] = np.arange(seq_len)
            return a
        return token_rows

    cache = fake_cache.make_fake_cache(tmp_path / "ok", 2, 3, S, H, [1], token_rows=rows_of(0))
    info = ds.open_hidden_cache(cache, [1])
    stream = ds.HiddenStream(info, 2, device=torch.device("cpu"))
    batch = next(stream)
    stream.close()
    assert batch["loss_mask"].bool().all() and info.num_rows == 6
    with pytest.raises(ValueError, match="expected"):
        fake_cache.make_fake_cache(tmp_path / "bad", 2, 3, S, H, [1], token_rows=rows_of(1))
