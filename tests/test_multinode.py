"""Several machines, played on one (docs/multi-node.md): two `accelerate launch` "nodes" (one process each, gloo, a
localhost rendezvous) train like one process accumulating the same global batch, only rank 0 writing the run, and
refuse to resume apart; two extractors with different host names fill one cache on the shared filesystem, every
shard once, byte for byte what one process wrote. Not covered here: real machines, NCCL between hosts."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from test_train import TINY, cli_args, final_weights, free_port, grad_norms, losses, run_on_one_thread

from dflash_offline.cache.manifest import committed, read_manifest
from dflash_offline.checkpoint import list_checkpoints
from dflash_offline.trainsetup import TrainConfig
from stages import status

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
ENV = dict(os.environ, DFLASH_NO_BAR="1", OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))


def launch_nodes(runs, cache, timeout=240, **kw):
    """One `accelerate launch` per entry of `runs` (its RUN=), each a machine of one process training on `cache`
    with test_train's tiny settings + `kw`; (returncode, output) of each once all are done."""
    args = [a for a in cli_args(cache, "", **kw) if not a.startswith("--run=")]
    port = str(free_port())
    procs = [subprocess.Popen([str(ACCELERATE), "launch", "--multi_gpu", "--num_machines", str(len(runs)),
                               "--machine_rank", str(node), "--main_process_ip", "127.0.0.1", "--main_process_port",
                               port, "--num_processes", str(len(runs)), "--mixed_precision", "no",
                               "--dynamo_backend", "no", "-m", "stages.train", *args, f"--run={run}"],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for node, run in enumerate(runs)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:  # a launcher that timed out, with the worker it started
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def test_two_nodes_train_like_one_process_and_only_rank_0_writes_the_run(tmp_path, hidden_cache):
    """Each "machine" has its own RUN= (not shared): rank 0's holds the whole run, the other's only its status file,
    and the run equals one process accumulating the same global batch, bit for bit (each micro-batch the same
    2-row computation on one thread either way, the mean of two gradients rounding as their sum: see
    tests/test_train.py's test_two_processes_equal_one_with_accumulation). A resume then finds a checkpoint on one
    machine and none on the other: refused on both, saying which rank would start where, instead of training the
    two apart."""
    tokens_per_step = 2 * 2 * 128  # 2 rows × 128 tokens, twice: one micro-batch per node, or two in one process
    one = tmp_path / "one"
    run_on_one_thread(TrainConfig.of(cache=str(hidden_cache), run=str(one),
                                  **{**TINY, "steps": 4, "ckpt_every": 4, "global_batch_tokens": tokens_per_step}
                                  ).resolve())
    runs = [tmp_path / "node0", tmp_path / "node1"]
    outs = launch_nodes(runs, hidden_cache, global_batch_tokens=tokens_per_step)
    assert all(rc == 0 for rc, _ in outs), [out[-3000:] for _, out in outs]
    derived = json.loads((runs[0] / "config.json").read_text())["derived"]
    assert derived["world_size"] == 2 and derived["grad_accum"] == 1
    assert losses(one) == losses(runs[0]) and grad_norms(one) == grad_norms(runs[0])
    w1, w2 = final_weights(one, 4), final_weights(runs[0], 4)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert sorted(p.name for p in runs[0].iterdir()) == ["checkpoints", "config.json", "metrics.jsonl",
                                                          "status-rank0.json"]
    assert [p.name for p in runs[1].iterdir()] == ["status-rank1.json"]
    assert "not written" not in outs[1][1]  # the status file had a directory to go to

    outs = launch_nodes(runs, hidden_cache, steps=6, global_batch_tokens=tokens_per_step, resume=1)
    assert all(rc != 0 for rc, _ in outs)
    said = "the processes would start from different steps (step 4 on rank(s) 0; step 0 on rank(s) 1)"
    assert all(said in out for _, out in outs), [out[-3000:] for _, out in outs]
    assert [s for _, s, _ in list_checkpoints(runs[0])] == [4]
    assert len(losses(runs[0])) == 4  # nothing trained apart


EXTRACT_AS = """
import os, runpy, socket
socket.gethostname = lambda: os.environ["NODE"]  # this process plays a machine of that name
runpy.run_module("stages.extract", run_name="__main__", alter_sys=True)
"""


def test_two_machines_extract_into_one_shared_cache_each_shard_once_same_bytes(tmp_path, hidden_cache, qwen35_dir,
                                                                              chat_corpus):
    """Two `make extract CACHE=` on two "machines" (host names node-a, node-b: to each, the other's claims, lock and
    temp files belong to another host, known only by their lease) at once on one cache: every shard computed and
    committed once, both machines did some, both appear in `make status`, and the shards are the bytes one process
    wrote (the `hidden_cache` fixture). A third machine's claim, whose pid means nothing here, is honoured until its
    lease ends, then taken over."""
    m0 = read_manifest(hidden_cache)
    tokens = (hidden_cache / m0["config"]["tokens_dir"]).resolve()
    cache = tmp_path / "shared" / "hidden"
    # the fixture's settings, on its token cache (one stage 1a for both machines: docs/multi-node.md)
    args = [f"--target={qwen35_dir}", f"--corpus={chat_corpus}", f"--tokens={tokens}", f"--cache={cache}",
            "--num_draft_layers=3", "--device=cpu", "--batch_rows=4", "--wait_claims=1", "--lease_s=12"]
    # node-c holds the last shard: its pid is no process here (another machine's), its lease ends in 10 s
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (cache / "claims").mkdir(parents=True)
    held, until = m0["num_shards"] - 1, time.time() + 10
    (cache / "claims" / f"shard-{held:05d}.json").write_text(json.dumps(
        {"worker": f"node-c:{gone.pid}", "host": "node-c", "pid": gone.pid, "rank": 0, "world": 1, "job": "",
         "index": held, "expires": until, "lease_s": 10, "renewed_at": time.time()}))
    procs = {node: subprocess.Popen([sys.executable, "-c", EXTRACT_AS, *args], cwd=REPO, env=dict(ENV, NODE=node),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in ("node-a", "node-b")}
    outs = {node: p.communicate(timeout=240)[0] for node, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), {n: o[-3000:] for n, o in outs.items()}

    done = {node: [int(x) for x in re.findall(r"shard (\d+) committed", out)] for node, out in outs.items()}
    n = m0["num_shards"]
    assert sorted(done["node-a"] + done["node-b"]) == list(range(n)), done  # each shard once, none missing
    assert done["node-a"] and done["node-b"], done  # both machines worked
    m = read_manifest(cache)
    assert m["key"] == m0["key"] and len(m["shards"]) == n
    assert committed(m)[held]["committed_at"] > until  # not taken over before node-c's lease ended
    assert {i: s["files"] for i, s in committed(m).items()} == {i: s["files"] for i, s in committed(m0).items()}
    for name in (name for s in m0["shards"] for name in s["files"]):
        assert (cache / name).read_bytes() == (hidden_cache / name).read_bytes(), name

    r = status.report(cache)
    assert r["complete"] and r["claims"] == []
    live = {st["host"]: st for st in r["live"]}
    assert sorted(live) == ["node-a", "node-b"] and {st["liveness"] for st in live.values()} == {"done"}
    rows = {node: sum(s["rows"] for s in m["shards"] if s["index"] in done[node]) for node in done}
    assert {node: live[node]["done"] for node in live} == rows
    assert not [p.name for p in cache.rglob(".*tmp~*")]  # no temp file left behind
