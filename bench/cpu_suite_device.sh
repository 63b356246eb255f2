#!/usr/bin/env bash
# The CPU suite (`pytest -m "not gpu"`) on another machine's CPU and torch: the lent GPU machine's host (another x86
# model, 16 cores, torch 2.11), which cannot reach the package registries and takes at most 64 MiB of carried files.
#   bash bench/cpu_suite_device.sh --pack     # here, after `make fixtures`: build/fixtures.tar.xz (the fixtures with
#                                             # their downloaded packages) and build/wheels-cpu/ (the test-only
#                                             # packages the GPU image lacks)
#   bash bench/cpu_suite_device.sh [PYTEST ARGS]   # there, with carry .whl build/fixtures.tar.xz build/wheels-cpu
# There the suite runs with the image's interpreter, no GPU visible; JUnit XML, the log and the CPU's model and flags
# go into one tarball in $OUT.
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
res=build/cpu-suite
mkdir -p "$OUT" "$res"
export CUDA_VISIBLE_DEVICES=  # the CPU suite: a test must not find (nor take memory on) the GPU
test -f build/fixtures/READY.json || tar xJf build/fixtures.tar.xz -C build
# the carried wheels into the image's interpreter (itself a venv: a venv made from it would not see its packages),
# the repository on its path as `pip install -e .` puts it (the tests' subprocesses inherit both); their bytecode
# compiled here, once, not by each of the suite's processes that first imports them, all at once
py=python3
$py -m pip install -q --no-index --no-deps --no-cache-dir --upgrade .whl/*.whl build/wheels-cpu/*.whl
echo "$PWD" > "$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dflash-repo.pth"
{ lscpu | grep -E "Model name|^CPU\(s\)" || true; for f in avx2 avx512f amx_tile; do
    grep -qw "$f" /proc/cpuinfo && echo "flag $f: yes" || echo "flag $f: no"; done
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)"; } | tee "$res/cpu.txt"
rc=0
# SUITE_LIMIT=S: interrupted after S seconds (SIGINT: pytest still writes the report of the tests that ran)
${SUITE_LIMIT:+timeout -s INT -k 30 "$SUITE_LIMIT"} $py -m pytest -q -m "not gpu" -n "${WORKERS:-$(nproc)}" --dist loadfile -p no:cacheprovider \
  --junitxml="$res/junit.xml" --durations=15 tests "$@" >"$res/pytest.log" 2>&1 || rc=$?
tail -40 "$res/pytest.log"
tar czf "$OUT/cpu-suite.tgz" -C build cpu-suite
exit $rc
