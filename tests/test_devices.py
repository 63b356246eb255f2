"""Device choice has one owner and one behaviour: `auto` takes CUDA where there is one, `cuda` without CUDA is refused
naming the setting and the fix (in every stage, before anything is read or loaded), a CUDA device carries its index
(the local rank under a launcher); a CPU run uses one thread unless told otherwise."""

import inspect
import os
from pathlib import Path

import pytest
import torch

from dflash_offline import devices
from dflash_offline.devices import check_setting, cpu_threads, pick_device


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two (pretend) GPUs; records set_device calls."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_naming_the_setting(no_cuda):
    assert pick_device("auto", "x.device") == torch.device("cpu")
    assert pick_device("cpu", "x.device", local_rank=3) == torch.device("cpu")
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"^extract.device={setting} but CUDA is not available: pass "
                                             r"--device=cpu \(or auto\)"):
            pick_device(setting, "extract.device")


def test_cuda_devices_carry_their_index_the_local_rank_under_a_launcher(two_gpus):
    assert pick_device("auto", "x.device") == torch.device("cuda", 0)
    assert pick_device("cuda", "x.device", local_rank=1) == torch.device("cuda", 1)
    assert pick_device("cuda:1", "x.device", local_rank=0) == torch.device("cuda", 1)  # an explicit index wins
    assert two_gpus == [0, 1, 1]  # each made the current device
    with pytest.raises(ValueError, match=r"x.device=cuda:2 needs GPU 2 but 2 are visible"):
        pick_device("cuda:2", "x.device")


@pytest.mark.parametrize("setting", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_unknown_settings_are_refused_with_the_choices(setting):
    with pytest.raises(ValueError, match=r"regen.device=.*: expected auto, cpu, cuda or cuda:N"):
        check_setting(setting, "regen.device")


def test_a_cpu_run_takes_one_thread_unless_told_otherwise(monkeypatch):
    calls, logged = [], []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu_threads(torch.device("cpu"), log=logged.append)
    assert calls == [1] and "OMP_NUM_THREADS" in logged[0]
    cpu_threads(torch.device("cuda", 0), log=logged.append)  # a GPU run keeps torch's choice
    cpu_threads(torch.device("cpu"), threads=3, log=logged.append)  # an explicit count wins
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    cpu_threads(torch.device("cpu"), log=logged.append)  # so does the environment
    assert calls == [1, 3] and len(logged) == 1


def _cgroups(root: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup tree under `root` (relative path -> content) and a /proc/self/cgroup saying `proc`."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "self-cgroup").write_text(proc)
    return root / "fs", root / "self-cgroup"


def test_cpu_counts_honour_the_cgroup_quota_the_tightest_of_a_cgroup_and_its_parents(tmp_path, monkeypatch):
    """A container limited to a few CPUs on a big host: the quota (v2 `cpu.max`, v1 `cfs_quota_us`) caps the CPUs,
    rounded down, a parent's binding its children, nothing above the mounted tree counting; no quota (max, -1), no
    files, or files not understood leave the affinity — never an exception."""
    q = devices.cgroup_cpu_quota
    v2 = _cgroups(tmp_path / "v2", "0::/pod/ctr\n", {"fs/pod/ctr/cpu.max": "250000 100000\n",
                                                    "fs/pod/cpu.max": "max 100000\n", "fs/cpu.max": "max 100000\n",
                                                    "cpu.max": "100000 100000\n"})  # (above the mount: ignored)
    assert q(*v2) == 2.5
    tight = _cgroups(tmp_path / "tight", "0::/pod/ctr\n", {"fs/pod/ctr/cpu.max": "max 100000\n",
                                                          "fs/pod/cpu.max": "150000 100000\n"})
    assert q(*tight) == 1.5  # (the pod's quota binds the container in it)
    assert q(*_cgroups(tmp_path / "none", "0::/\n", {"fs/cpu.max": "max 100000\n"})) is None
    # inside a container the path /proc names is the host's; the mounted tree is the container's own: its root counts
    ns = _cgroups(tmp_path / "ns", "0::/docker/abc\n", {"fs/cpu.max": "400000 100000\n"})
    assert q(*ns) == 4.0
    # a cgroup outside this namespace's root (/proc says ..): not in the mounted tree, and the walk does not leave it
    out = _cgroups(tmp_path / "out", "0::/../sibling\n", {"cpu.max": "100000 100000\n", "fs/cpu.max": "200000 100000\n",
                                                         "fs/cpuset.cpus.effective": "0-3\n"})
    assert q(*out) is None and devices.cgroup_cpuset(*out) is None  # (not the namespace root's limits either)
    v1 = _cgroups(tmp_path / "v1", "12:memory:/x\n4:cpu,cpuacct:/x/y\n",
                  {"fs/cpu,cpuacct/x/y/cpu.cfs_quota_us": "-1\n", "fs/cpu,cpuacct/x/y/cpu.cfs_period_us": "100000\n",
                   "fs/cpu,cpuacct/x/cpu.cfs_quota_us": "300000\n", "fs/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    assert q(*v1) == 3.0  # (the parent's)
    v1cpu = _cgroups(tmp_path / "v1cpu", "4:cpu:/x\n",  # (the controller mounted as cpu alone)
                     {"fs/cpu/x/cpu.cfs_quota_us": "200000\n", "fs/cpu/x/cpu.cfs_period_us": "100000\n"})
    assert q(*v1cpu) == 2.0
    hybrid = _cgroups(tmp_path / "hybrid", "4:cpu,cpuacct:/x\n0::/x\n",
                      {"fs/cpu,cpuacct/x/cpu.cfs_quota_us": "600000\n", "fs/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
                       "fs/x/cpu.max": "500000 100000\n"})
    assert q(*hybrid) == 5.0
    off = _cgroups(tmp_path / "off", "4:cpu,cpuacct:/x\n",
                   {"fs/cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n", "fs/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    assert q(*off) is None
    for n, junk in enumerate(("abc 100000\n", "100000\n", "100000 0\n", "0 100000\n", "")):
        assert q(*_cgroups(tmp_path / f"junk{n}", "0::/\n", {"fs/cpu.max": junk})) is None, junk
    odd = _cgroups(tmp_path / "odd", "", {"fs/cpu.max": "200000 100000\n"})
    odd[1].write_bytes(b"0::/caf\xe9\nnot a line\n")
    assert q(*odd) == 2.0  # (a name not UTF-8 and a line not understood: no exception; the walk reaches the root)
    assert q(tmp_path / "missing", tmp_path / "missing-cgroup") is None
    monkeypatch.setattr(os.path, "isdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert q(*v1) is None  # (a stat refused: no cap, no exception)
    monkeypatch.undo()
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    u = devices.usable_cpus
    assert u(1, *v2) == 2 and u(1, *tight) == 1 and u(1, *ns) == 4
    assert u(1, *off) == 16  # no quota: the affinity
    assert u(1, *_cgroups(tmp_path / "half", "0::/\n", {"fs/cpu.max": "50000 100000\n"})) == 1  # (half a CPU: one)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert u(1, *ns) == 2  # the affinity, where it is the tighter


def test_a_containers_cpuset_is_read_from_its_cgroup_or_the_nearest_parent(tmp_path, monkeypatch):
    """The CPUs of a container (its cgroup's cpuset, v2 or v1, lists like 0-3,8-11), where os.cpu_count() says the
    host's; a cgroup whose file is empty or not understood takes its parent's; no file, or junk: None, never an
    exception. 8 ranks in a 16-CPU container on a 128-CPU host read on 2 threads each."""
    c = devices.cgroup_cpuset
    assert c(*_cgroups(tmp_path / "v2", "0::/pod/ctr\n", {"fs/pod/ctr/cpuset.cpus.effective": "0-3,8-11\n",
                                                          "fs/cpuset.cpus.effective": "0-127\n"})) == 8
    assert c(*_cgroups(tmp_path / "up", "0::/pod/ctr\n", {"fs/pod/ctr/cpuset.cpus.effective": "\n",
                                                          "fs/pod/cpuset.cpus.effective": "5\n"})) == 1
    assert c(*_cgroups(tmp_path / "v1", "3:cpuset:/x\n", {"fs/cpuset/x/cpuset.effective_cpus": "0-7,9\n"})) == 9
    assert c(*_cgroups(tmp_path / "v1cpus", "3:cpuset:/x\n", {"fs/cpuset/x/cpuset.cpus": "2-5\n"})) == 4
    for n, junk in enumerate(("a-b\n", "7-3\n", "0-3,\n", "-1\n")):
        assert c(*_cgroups(tmp_path / f"junk{n}", "0::/\n", {"fs/cpuset.cpus.effective": junk})) is None, junk
    assert c(*_cgroups(tmp_path / "child", "0::/ctr\n", {"fs/ctr/cpuset.cpus.effective": "0-3,\n",
                                                        "fs/cpuset.cpus.effective": "0-15\n"})) == 16
    assert c(tmp_path / "missing", tmp_path / "missing-cgroup") is None
    tree = _cgroups(tmp_path / "ctr16", "0::/\n", {"fs/cpuset.cpus.effective": "0-15\n", "fs/cpu.max": "max 100000\n"})
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert devices.usable_cpus(8, *tree) == 2 and devices.usable_cpus(1, *tree) == 16


def test_ranks_share_the_host_and_its_quota_but_not_cpus_they_are_pinned_to(monkeypatch):
    """8 ranks on a 16-CPU host share it (2 each), or a container's CPUs on a bigger host, and a container's quota
    (16 CPUs of quota for 4 ranks: 4 each); a rank a launcher pinned to CPUs of its own keeps them all; ranks given
    one set of CPUs together (taskset, a NUMA node) take no more than their share of the container."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root, proc: None)
    monkeypatch.setattr(devices, "cgroup_cpuset", lambda root, proc: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [devices.usable_cpus(r) for r in (1, 4, 8, 32)] == [16, 4, 2, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)  # (pinned: 4 of 16)
    assert devices.usable_cpus(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)  # (8 ranks on taskset 0-7)
    assert devices.usable_cpus(8) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 128)  # (a container of 16 CPUs on a 128-CPU host: shared)
    monkeypatch.setattr(devices, "cgroup_cpuset", lambda root, proc: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert devices.usable_cpus(8) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)  # (pinned in it)
    assert devices.usable_cpus(4) == 4 and devices.usable_cpus(8) == 2
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root, proc: 16.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert devices.usable_cpus(4) == 4 and devices.usable_cpus(1) == 16
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root, proc: 6.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)
    assert devices.usable_cpus(4) == 1  # (the quota, 6 CPUs for 4 ranks, binds a pinned rank too)


def test_the_readers_and_tokenizers_take_their_share_of_the_usable_cpus(monkeypatch):
    """The resident read's threads and the tokenizer processes count the CPUs a process may use, the read's split
    over the ranks on this host (LOCAL_WORLD_SIZE): 8 ranks on a 16-CPU host read on 2 threads each."""
    from dflash_offline import dataset, tokenization
    from dflash_offline.config import TokenizeConfig

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root, proc: None)
    monkeypatch.setattr(devices, "cgroup_cpuset", lambda root, proc: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert dataset.hold_threads(9) == dataset.HOLD_THREADS == 8 and dataset.hold_threads(3) == 3
    for ranks, threads in (("8", 2), ("32", 1), ("", 8), ("x", 8)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert dataset.hold_threads(9) == threads, ranks
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root, proc: 3.0)
    cfg = TokenizeConfig(corpus=["c.jsonl"], tokenizer="t")
    assert tokenization.workers_for(cfg) == 3 and tokenization.workers_for(TokenizeConfig(["c"], "t", workers=5)) == 5


def test_every_stage_that_picks_a_device_asks_the_owner():
    from dflash_offline import evalrun, regenrun
    from stages import extract, verify

    for stage in (extract, regenrun, verify, evalrun):
        src = inspect.getsource(stage)
        assert "pick_device(" in src and "cuda.is_available" not in src and "def pick_device" not in src, stage
    assert inspect.getsource(devices).count("cuda.is_available()") == 2  # auto, and the refusal


def test_stages_refuse_cuda_without_cuda_before_any_work(no_cuda, tmp_path, qwen35_dir, chat_corpus, monkeypatch):
    from dflash_offline import evalrun, regenrun
    from dflash_offline.config import ExtractConfig, TokenizeConfig
    from stages import extract

    tok = TokenizeConfig(corpus=[str(chat_corpus)], tokenizer=str(qwen35_dir), cache_root=str(tmp_path),
                         seq_len=128, workers=1, max_docs=10).resolve()
    ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(tmp_path), device="cuda").resolve()
    with pytest.raises(ValueError, match="extract.device=cuda but CUDA is not available"):
        extract.run(ext, tok)
    assert list(tmp_path.iterdir()) == []  # refused before stage 1a ran
    monkeypatch.setattr(regenrun, "load_model", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="regen --device=cuda but CUDA is not available"):
        regenrun.run(regenrun.RegenConfig(target=str(qwen35_dir), corpus=[str(chat_corpus)],
                                          out=str(tmp_path / "r.jsonl"), device="cuda"))
    assert not (tmp_path / "r.jsonl").exists()
    with pytest.raises(ValueError, match="eval.device='gpu': expected"):
        evalrun.EvalConfig(run=str(tmp_path), device="gpu").resolve()


def test_a_cpu_device_turns_transformers_install_fla_notes_into_one_accurate_line(capsys):
    """On the CPU transformers says, once per kernel, to install flash-linear-attention (installed: its kernels need a
    GPU); after a CPU device is picked the user sees one line saying what really happens, and other warnings pass."""
    import logging

    from dflash_offline import devices

    logger = logging.getLogger("transformers.integrations.hub_kernels")
    # as in a fresh process: an earlier test's CPU run in this one installed the filter and said its line already
    before, logger.filters = logger.filters, []
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        devices.pick_device("cpu", "x.device")
        devices.pick_device("cpu", "x.device")  # (one filter per process)
        for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            logger.warning(f"`{name}` is falling back to its reference PyTorch implementation because "
                           f"`flash-linear-attention` is not installed.")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
        logger.filters = before
    assert seen == ["something else"]
    out = capsys.readouterr().out
    assert out.count("reference PyTorch kernels") == 1 and "need a GPU" in out


def test_the_gpu_suite_refuses_a_cuda_machine_without_fla_unless_told():
    """`make test-gpu` on an H100 without fla's wheels installed ran the short testbed on transformers' pure-torch
    Gated DeltaNet: its GPU tests now fail at once, saying what to install."""
    from conftest import gpu_suite_problem

    assert gpu_suite_problem(cuda=False, fla=False, env={}) is None  # (a CPU: the GPU tests skip themselves)
    assert gpu_suite_problem(cuda=True, fla=True, env={}) is None
    msg = gpu_suite_problem(cuda=True, fla=False, env={})
    assert "flash-linear-attention" in msg and "PYTHONPATH=/tmp/site" in msg and "DFLASH_GPU_TESTS_WITHOUT_FLA=1" in msg
    assert gpu_suite_problem(cuda=True, fla=False, env={"DFLASH_GPU_TESTS_WITHOUT_FLA": "1"}) is None


def test_the_gpu_tests_fail_at_once_on_cuda_without_fla(tmp_path):
    """The hook itself: in a process that sees CUDA (stubbed) and cannot import fla, a GPU test fails before its body
    (an error at its setup) with the message, also under pytest -n; a CPU test collected beside it still runs."""
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys, torch\ntorch.cuda.is_available = lambda: True\n"
                                           "sys.modules['fla'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}
    env.pop("DFLASH_GPU_TESTS_WITHOUT_FLA", None)
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "tests/test_testbed_gpu.py",
           "tests/test_devices.py::test_the_gpu_suite_refuses_a_cuda_machine_without_fla_unless_told"]
    for extra in ([], ["-n", "1"]):
        r = subprocess.run(cmd + extra, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "1 passed, 1 error" in out and "need flash-linear-attention" in out, out[-3000:]
