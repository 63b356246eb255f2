"""Faults injected into stage 1b and the cache around it, as a user meets them: a deleted or resized committed shard,
a full disk mid-run, a lock and claims left by a killed process, a concurrent extractor that dies or outlives this
one, the repair command as printed, and `make status` telling live from dead."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_offline.cache.fsio import sha256_file
from dflash_offline.cache.manifest import committed, read_manifest
from dflash_offline.cache.shards import hidden_shard_name

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO))

# a stage's real front door (run_cli: one-line errors, exit 2), optionally with a fault patched in first
SCRIPT = """
import sys
{patch}
from dflash_offline.cli import run_cli
from stages import extract
sys.argv = ["extract"] + sys.argv[1:]
run_cli(extract.main)
"""

FULL_DISK_AT_SHARD_2 = """
import errno
from dflash_offline.cache import shards
_fsync = shards.fsync_path
def fsync_path(path):  # the disk fills while shard 2's file is written out
    if "hidden-00002.safetensors" in path.name:
        raise OSError(errno.ENOSPC, "No space left on device")
    _fsync(path)
shards.fsync_path = fsync_path
"""


def extract_cli(target, corpus, cache_root, *extra, patch=""):
    return [sys.executable, "-c", SCRIPT.format(patch=patch), f"--target={target}", f"--corpus={corpus}",
            f"--cache_root={cache_root}", "--seq_len=128", "--rows_per_shard=2", "--max_docs=40",
            "--num_draft_layers=3", "--device=cpu", "--batch_rows=2", "--workers=1", "--write_queue=1", *extra]


def run(args, **kw):
    return subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, **kw)


def hidden_cache_of(root: Path) -> Path:
    return next(root.glob("hidden-*"))


def debris(cache: Path) -> list[str]:
    """Anything a crashed or failed writer could leave: temp files, claims, the lock."""
    left = [p for p in cache.rglob(".*") if "tmp" in p.name] + list((cache / "claims").glob("*"))
    left += [cache / ".lock"] if (cache / ".lock").exists() else []
    return sorted(str(p.relative_to(cache)) for p in left)


def shard_hashes(cache: Path) -> dict:
    return {i: s["files"] for i, s in committed(read_manifest(cache)).items()}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, qwen35_dir, chat_corpus) -> Path:
    """The reference: the same extraction, never interrupted."""
    root = tmp_path_factory.mktemp("clean")
    res = run(extract_cli(os.path.relpath(qwen35_dir, REPO), chat_corpus, root))  # (a relative target, as users type)
    assert res.returncode == 0, res.stderr[-2000:]
    return hidden_cache_of(root)


def test_a_full_disk_ends_in_one_line_leaves_no_debris_and_a_rerun_completes_identical(tmp_path, qwen35_dir,
                                                                                       chat_corpus, clean):
    res = run(extract_cli(qwen35_dir, chat_corpus, tmp_path, patch=FULL_DISK_AT_SHARD_2))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: writing ") and "hidden-00002.safetensors failed: No space left on device" in last
    cache = hidden_cache_of(tmp_path)
    assert debris(cache) == []
    kept = shard_hashes(cache)
    assert {0, 1} <= set(kept) and 2 not in kept
    assert all(kept[i] == shard_hashes(clean)[i] for i in kept)  # what was committed is intact
    # a lock left by a killed process (a dead pid on this host) does not make the rerun wait
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (cache / ".lock").write_text(f"{socket.gethostname()}:{dead.pid}:x")
    t = time.time()
    res = run(extract_cli(qwen35_dir, chat_corpus, tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "breaking the stale lock" in res.stdout and time.time() - t < 60
    assert shard_hashes(cache) == shard_hashes(clean) and debris(cache) == []


def test_a_deleted_shard_is_seen_by_status_and_redone_by_extract_alone(tmp_path, clean, copy_cache):
    cache = copy_cache(clean, tmp_path / "c")
    (cache / hidden_shard_name(3)).unlink()
    with open(cache / hidden_shard_name(5), "ab") as f:
        f.write(b"\0")
    status = run([sys.executable, "-m", "stages.status", f"--cache={cache}"])
    assert "2 committed shard(s) damaged on disk: 3,5" in status.stdout, status.stdout
    # the printed repair command: make extract CACHE=<cache> (no recipe, corpus or target needed)
    res = run([sys.executable, "-m", "stages.extract", f"--cache={cache}", "--target=", "--corpus=",
               "--shards=", "--dry_run="])
    assert res.returncode == 0, res.stderr[-2000:]
    redone = sorted(int(x) for x in __import__("re").findall(r"shard (\d+) committed", res.stdout))
    assert redone == [3, 5] and shard_hashes(cache) == shard_hashes(clean)


def test_the_repair_command_redoes_one_shard_as_printed(tmp_path, clean, copy_cache):
    """`make extract CACHE=<dir> SHARD=k`, as verify and the trainer print it, with the Makefile's empty settings."""
    cache = copy_cache(clean, tmp_path / "c")
    path = cache / hidden_shard_name(4)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # altered in place: same size, caught only by reading
    path.write_bytes(bytes(raw))
    # (-o: the stage, not the install, is under test: make test set the venv up first; a suite run with another
    # interpreter has no .venv to bring up to date)
    res = run(["make", "-s", "-o", ".venv/.installed", "extract", f"CACHE={cache}", "SHARD=4", f"PYTHON={sys.executable}",
               "VENV=.venv"])
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "rerunning it with the inputs its manifest records" in res.stdout
    assert __import__("re").findall(r"shard (\d+) committed", res.stdout) == ["4"]
    assert shard_hashes(cache) == shard_hashes(clean)


def test_shards_held_by_a_live_process_fail_the_run_unless_waiting_and_a_dead_ones_are_taken_over(
        tmp_path, qwen35_dir, chat_corpus, clean):
    from dflash_offline.cache import claims

    res = run([sys.executable, "-m", "stages.tokenize", f"--corpus={chat_corpus}", f"--tokenizer={qwen35_dir}",
               f"--cache_root={tmp_path}", "--seq_len=128", "--rows_per_shard=2", "--max_docs=40", "--workers=1"])
    assert res.returncode == 0, res.stderr[-2000:]
    cache = tmp_path / clean.name  # the same inputs: the same content-addressed directory
    # another live process (this test's) holds shard 6; a killed one held shard 2
    (cache / "claims").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    for index, pid in ((6, sleeper.pid), (2, dead.pid)):
        (cache / "claims" / f"shard-{index:05d}.json").write_text(json.dumps(
            {"worker": f"{host}:{pid}", "host": host, "pid": pid, "rank": 0, "index": index, "job": "",
             "expires": time.time() + 900}))
    try:
        res = run(extract_cli(qwen35_dir, chat_corpus, tmp_path))
        assert res.returncode == 2, res.stderr[-2000:]
        last = res.stderr.strip().splitlines()[-1]
        assert f"6 are still claimed by {host}:{sleeper.pid} (rank 0)" in last and "--wait_claims=1" in last
        done = committed(read_manifest(cache))
        assert 2 in done and 6 not in done  # the dead one's shard was taken over
        # waiting: the holder dies while we wait, and its shard is taken over
        waiter = subprocess.Popen(extract_cli(qwen35_dir, chat_corpus, tmp_path, "--wait_claims=1", "--lease_s=4"),
                                  cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in waiter.stdout:  # until it waits for the live holder (however slow its start-up is)
            seen.append(line)
            if "waiting for shards [6]" in line:
                break
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()  # (reaped: a zombie still has its pid)
        out = "".join(seen) + waiter.communicate(timeout=120)[0]
        assert waiter.returncode == 0, out[-2000:]
        assert "waiting for shards [6]" in out and shard_hashes(cache) == shard_hashes(clean)
        assert not list((cache / "claims").glob("*")) and claims.holders(cache, range(20)) == {}
    finally:
        sleeper.kill()


def test_status_tells_dead_writers_from_live_ones(tmp_path, clean):
    import shutil

    cache = tmp_path / "c"
    shutil.copytree(clean, cache)
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    for pid, name in ((dead.pid, "dead"), (os.getpid(), "live")):
        (cache / f"status-{host}-{pid}.json").write_text(json.dumps(
            {"stage": f"extract[{name}]", "state": "running", "pid": pid, "host": host, "rank": 0, "done": 3,
             "total": 10, "tokens_per_s": 5.0, "eta_s": 7, "updated_at": now, "lease_s": 900}))
    (cache / "claims" / "shard-00001.json").write_text(json.dumps(
        {"worker": f"{host}:{dead.pid}", "host": host, "pid": dead.pid, "rank": 1, "index": 1,
         "expires": now + 855}))
    out = run([sys.executable, "-m", "stages.status", f"--cache={cache}"]).stdout
    lines = out.splitlines()
    assert any(f"{host}:{dead.pid}" in x and "dead" in x and "extract[dead]" in x for x in lines), out
    assert any(f"{host}:{os.getpid()}" in x and "running" in x for x in lines), out
    assert any("shard 1" in x and "dead" in x and "rank 1" in x for x in lines), out
    assert "855s more" not in out


def test_a_deleted_token_shard_is_redone_identically_by_the_next_run(tmp_path, clean):
    """A complete token cache with a committed file gone is not 'complete': the next run redoes that shard (tokenizing
    is deterministic), and the hidden cache extracted from it stays valid."""
    import shutil

    from dflash_offline import tokenization
    from dflash_offline.config import TokenizeConfig

    src = (clean / read_manifest(clean)["config"]["tokens_dir"]).resolve()
    tokens = tmp_path / src.name
    shutil.copytree(src, tokens)
    before = shard_hashes(tokens)
    cfg = TokenizeConfig(**{**read_manifest(tokens)["config"], "tokens": str(tokens)}).resolve()
    (tokens / "tokens-00002.arrow").unlink()
    tokenization.run(cfg)
    assert shard_hashes(tokens) == before and read_manifest(tokens)["complete"]
    assert sha256_file(tokens / "tokens-00002.arrow") == before[2]["tokens-00002.arrow"]["sha256"]


def test_status_of_a_hidden_cache_shows_times_verdict_and_summary(tmp_path, clean):
    import shutil

    from dflash_offline.cache.manifest import update_manifest

    cache = tmp_path / "c"
    shutil.copytree(clean, cache)
    (cache / "status-elsewhere-1.json").write_text(json.dumps(
        {"stage": "tokenize", "state": "done", "host": "elsewhere", "pid": 1, "rank": 0, "done": 40, "total": None,
         "tokens_per_s": 9.0, "updated_at": (t0 := time.time()) - 30}))
    out = run([sys.executable, "-m", "stages.status", f"--cache={cache}"]).stdout
    waited = time.time() - t0  # (the status command's own start: seconds on a loaded machine)
    table = [x.split() for x in out.splitlines() if x.split()[:2][1:] == ["committed"]]
    assert table and all(float(row[5]) > 0 for row in table), out  # each hidden shard's compute time
    assert "verified: never verified" in out and "bytes_per_token" in out and "compute_tokens_per_s" in out
    ended = re.search(r"tokenize elsewhere:1 rank 0: 40 .*\(ended (\d+)s ago\)", out)
    assert "/None" not in out and ended and 30 <= int(ended[1]) <= 30 + waited + 1, out
    update_manifest(cache, verified={"ok": False, "bad": [{"shard": 3, "reason": "x"}, {"shard": 4, "reason": "y"}],
                                     "at": time.time()})
    failed = run([sys.executable, "-m", "stages.status", f"--cache={cache}"]).stdout
    assert "verified: FAILED at" in failed and "complete, verify FAILED]" in failed.splitlines()[0], failed


def test_training_names_a_field_missing_from_the_manifest(tmp_path, hidden_cache, copy_cache):
    """A hand-edited hidden manifest without a field training reads is one line naming it, not a KeyError."""
    from dflash_offline.cache.manifest import ManifestError
    from dflash_offline.trainsetup import TrainConfig, cache_defaults

    cache = copy_cache(hidden_cache, tmp_path / "cache")
    m = json.loads((cache / "manifest.json").read_text())
    del m["config"]["mask_token_id"]
    (cache / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"manifest.json: config.mask_token_id is missing \(expected "):
        cache_defaults(TrainConfig.of(cache=str(cache), run=str(tmp_path / "run")))


def test_extraction_refuses_a_token_manifest_naming_another_file(tmp_path, clean, qwen35_dir, chat_corpus):
    """A token shard whose manifest entry names another (well-formed) file is refused in one line naming both, before
    anything is computed: the reader opens tokens-NNNNN.arrow, whatever the entry says."""
    import shutil

    src = (clean / read_manifest(clean)["config"]["tokens_dir"]).resolve()
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(src, root / src.name)
    m = json.loads((root / src.name / "manifest.json").read_text())
    entry = m["shards"][0] if isinstance(m["shards"], list) else m["shards"]["0"]
    entry["files"] = {"tokens-00009.arrow": entry["files"]["tokens-00000.arrow"]}
    (root / src.name / "manifest.json").write_text(json.dumps(m))
    res = run(extract_cli(qwen35_dir, chat_corpus, root))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "shard 0 lists ['tokens-00009.arrow'], not tokens-00000.arrow" in res.stderr, res.stderr[-2000:]


def test_the_manifest_records_a_relative_target_by_its_absolute_path(clean, qwen35_dir):
    """Training, verify and the repair command read the target from the manifest, from any directory: the clean
    cache was extracted with a target path relative to the working directory."""
    assert read_manifest(clean)["config"]["extract"]["target"] == str(Path(qwen35_dir).resolve())


def test_status_of_a_directory_reports_every_cache_around_a_broken_one(tmp_path, clean):
    """`make status CACHE=<directory of caches>`: one cache whose manifest cannot be read is one line in its place;
    the others are still reported, and the status says something failed (2)."""
    import shutil

    root = tmp_path / "caches"
    for name in ("a-good", "b-broken", "c-good"):
        shutil.copytree(clean, root / name)
    (root / "b-broken" / "manifest.json").write_text("{ not json")
    res = subprocess.run([sys.executable, "-m", "stages.status", f"--cache={root}"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stdout.splitlines()
    broken = [x for x in lines if x.startswith(f"{root / 'b-broken'}: error: ")]
    assert len(broken) == 1 and sum(str(root / n) in res.stdout for n in ("a-good", "c-good")) == 2, res.stdout


def test_a_hidden_cache_without_its_token_cache_says_which_one_and_where(tmp_path, hidden_cache):
    """A hidden cache reads its token rows from the token cache it was extracted from. Moved alone, it is refused
    naming that cache's key and where it was looked for (not "X is not a cache: run make tokenize"); with another
    token cache there, refused naming both keys (not "the manifest was edited or damaged", and not at the first read
    of a training run); put back, it reads."""
    import shutil

    from dflash_offline.cache.manifest import ManifestError, read_manifest
    from dflash_offline.dataset import open_hidden_cache

    m = read_manifest(hidden_cache)
    tokens = (hidden_cache / m["config"]["tokens_dir"]).resolve()
    taps = m["config"]["layer_ids"]
    alone = tmp_path / "moved" / "hidden"
    shutil.copytree(hidden_cache, alone)
    want = m["producer"]["tokens"]["key"][:12]
    with pytest.raises(ManifestError, match=rf"{alone}'s token cache \(key {want}\), which it reads its token rows "
                                            rf"from, is not at .*move together; put it back there"):
        open_hidden_cache(alone, taps)
    other = tmp_path / "moved" / tokens.name
    shutil.copytree(tokens, other)
    om = json.loads((other / "manifest.json").read_text())
    om["key"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(om))
    with pytest.raises(ManifestError, match=rf"is not at {other}: that holds another tokens cache \(key ffffffffffff\)"):
        open_hidden_cache(alone, taps)
    shutil.rmtree(other)
    shutil.copytree(tokens, other)
    assert open_hidden_cache(alone, taps).num_rows > 0


def test_a_hidden_cache_moved_alone_reruns_from_the_token_cache_it_was_given(tmp_path, hidden_cache):
    """Extracted with an absolute --tokens, a hidden cache moved alone still finds its token cache there (training
    and verify did); `make extract CACHE=<moved> SHARD=k` — the command verify prints — read the recorded settings
    with the relative tokens_dir alone, which no longer exists."""
    import shutil

    from dflash_offline.cache.manifest import read_manifest
    from dflash_offline.extract_plan import recorded_config

    m = read_manifest(hidden_cache)
    tokens = (hidden_cache / m["config"]["tokens_dir"]).resolve()
    alone = tmp_path / "moved" / "hidden"
    shutil.copytree(hidden_cache, alone)
    mm = json.loads((alone / "manifest.json").read_text())
    mm["config"]["extract"]["tokens"] = str(tokens)  # as extraction records an absolute --tokens (TOKENS=)
    (alone / "manifest.json").write_text(json.dumps(mm))
    cfg = recorded_config([f"--cache={alone}", "--shards=0"])
    assert cfg is not None and cfg.tokens == str(tokens) and cfg.cache == str(alone)
