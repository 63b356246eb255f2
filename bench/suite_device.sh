#!/usr/bin/env bash
# The test suite on the lent GPU machine, which cannot reach the package registries and takes at most 64 MiB of
# carried files: the CPU suite (`pytest -m "not gpu"`) on its host's CPU and torch (another x86 model, 16 cores,
# torch 2.11), or with MARK=gpu the GPU tests (`pytest -m gpu`, one process; name files to run a part of them).
#   bash bench/suite_device.sh --pack     # here, after `make fixtures`: build/fixtures.tar.xz (the fixtures with
#                                         # their downloaded packages) and build/wheels-cpu/ (the test-only packages
#                                         # the GPU image lacks)
#   bash bench/suite_device.sh [PYTEST ARGS]            # there, with carry .whl build/fixtures.tar.xz build/wheels-cpu
#   MARK=gpu bash bench/suite_device.sh tests/test_drafter_gpu.py ...   # there: GPU tests (the same carry)
# There the suite runs with the image's interpreter (the CPU suite with no GPU visible); JUnit XML, the log and the
# machine's CPU (and GPU) go into one tarball in $OUT: cpu-suite.tgz or gpu-suite.tgz. The GPU tests pin fla's autotuner
# choices from bench/autotune/ and record theirs: gpu-suite/autotune.json, to fold in here with
#   .venv/bin/python -m dflash_offline.autotune merge --first_wins=1 --out=bench/autotune/T.json bench/autotune/T.json \
#     build/gpu-suite/autotune.json      (T: the table of that GPU, Triton and fla)
# SUITE_LIMIT=S interrupts it after S seconds (SIGINT: pytest still reports the tests that ran; SIGKILL 30 s later):
# give the call a timeout of at least S + 90 (set-up ≈ 20 s, the 30 s grace, the tarball), or only the live log
# ($OUT/MARK-suite.log, written as the tests run: the GPU tests one line each) comes back. WORKERS=N processes (CPU
# suite: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--pack" ]; then
  test -f build/fixtures/READY.json || { echo "no build/fixtures: run make fixtures first" >&2; exit 2; }
  tar cJf build/fixtures.tar.xz.tmp -C build fixtures
  mv build/fixtures.tar.xz.tmp build/fixtures.tar.xz
  # transformers[serving]'s packages (the regen tests' `transformers serve`), same versions as the venv here, with
  # those of their requirements the image lacks: fastapi's opentelemetry-api (itself needing typing-extensions, there),
  # openai's httpx2 and its httpcore2 and truststore (h11, anyio, idna: there)
  mkdir -p build/wheels-cpu
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d build/wheels-cpu $(.venv/bin/python -m pip list --format=freeze 2>/dev/null \
      | grep -i -E "^(openai|pydantic|pydantic.core|annotated.types|typing.inspection|uvicorn|fastapi|starlette|distro|jiter|sniffio|annotated.doc|opentelemetry.api|httpx2|httpcore2|truststore)==")
  du -ch build/fixtures.tar.xz build/wheels-cpu .whl | tail -1
  exit 0
fi
OUT=${OUT:-build/out}
MARK=${MARK:-cpu}
case "$MARK" in
  cpu) export CUDA_VISIBLE_DEVICES=  # the CPU suite: a test must not find (nor take memory on) the GPU
       select="not gpu" workers=${WORKERS:-$(nproc)} verbose=-q ;;
  gpu) select="gpu" workers=${WORKERS:-0} verbose=-v  # (one process: the GPU tests size their work to 1 GPU)
       # fla's autotuner choices recorded on earlier calls pinned (a cold machine otherwise times every candidate
       # config of every shape: ≈ 160 s for an exact-mode evaluation's float32 kernels), this call's recorded
       export DFLASH_AUTOTUNE_PIN=${DFLASH_AUTOTUNE_PIN-$PWD/bench/autotune} DFLASH_AUTOTUNE_RECORD=$PWD/build/autotune ;;
  *) echo "MARK=cpu or MARK=gpu, got $MARK" >&2; exit 2 ;;
esac
res=build/$MARK-suite
mkdir -p "$OUT" "$res"
test -f build/fixtures/READY.json || tar xJf build/fixtures.tar.xz -C build
# the carried wheels into the image's interpreter (itself a venv: a venv made from it would not see its packages),
# the repository on its path as `pip install -e .` puts it (the tests' subprocesses inherit both); their bytecode
# compiled here, once, not by each of the suite's processes that first imports them, all at once
py=python3
$py -m pip install -q --no-index --no-deps --no-cache-dir --upgrade .whl/*.whl $(ls build/wheels-cpu/*.whl 2>/dev/null)
echo "$PWD" > "$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dflash-repo.pth"
{ lscpu | grep -E "Model name|^CPU\(s\)" || true; for f in avx2 avx512f amx_tile; do
    grep -qw "$f" /proc/cpuinfo && echo "flag $f: yes" || echo "flag $f: no"; done
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)"
  [ "$MARK" = gpu ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
} | tee "$res/machine.txt"
rc=0
rm -rf build/autotune "$res/autotune.json"  # (a warm machine's earlier call: not this call's choices)
# SUITE_LIMIT=S: interrupted after S seconds (SIGINT: pytest still writes the report of the tests that ran)
args=("$@")  # pytest arguments; the whole tests/ where they name no file or folder of it
[[ " $* " == *" tests"* ]] || args=(tests "${args[@]}")
# (the log also goes to $OUT as it is written: a call killed before the tarball still tells what ran)
${SUITE_LIMIT:+timeout -s INT -k 30 "$SUITE_LIMIT"} env PYTHONUNBUFFERED=1 \
  $py -m pytest "$verbose" -m "$select" -n "$workers" --dist loadfile -p no:cacheprovider -rfEs \
  --junitxml="$res/junit.xml" --durations=15 "${args[@]}" 2>&1 \
  | tee "$OUT/$MARK-suite.log" >"$res/pytest.log" || rc=$?
tail -40 "$res/pytest.log"
# the choices this call's autotuners made, as one table (merge it into bench/autotune/'s with --first_wins=1: the
# file's header says how) — the next cold machine then pins the tests' shapes too
if compgen -G "build/autotune/*.json" >/dev/null; then
  $py -m dflash_offline.autotune merge --first_wins=1 --out="$res/autotune.json" \
    $(ls build/autotune/*.json | sort -t/ -k3 -n) || true  # (two processes choosing apart: the first's kept)
fi
tar czf "$OUT/$MARK-suite.tgz" -C build "$MARK-suite"
exit $rc
