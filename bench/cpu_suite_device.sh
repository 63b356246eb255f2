#!/usr/bin/env bash
# The CPU suite (`pytest -m "not gpu"`) on another machine's CPU and torch: the lent GPU machine's host (another x86
# model, 16 cores, torch 2.11), which cannot reach the package registries and takes at most 64 MiB of carried files.
#   bash bench/cpu_suite_device.sh --pack     # here, after `make fixtures`: build/fixtures.tar.xz (≈ 34 MB) and
#                                             # build/wheels-cpu/ (the test-only packages the GPU image lacks)
#   bash bench/cpu_suite_device.sh [PYTEST ARGS]   # there, with carry .whl build/fixtures.tar.xz build/wheels-cpu
# The run writes JUnit XML and the log into $OUT (default build/out): which tests failed, how long each took.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--pack" ]; then
  test -f build/fixtures/READY.json || { echo "no build/fixtures: run make fixtures first" >&2; exit 2; }
  tar cJf build/fixtures.tar.xz.tmp -C build --exclude=fixtures/downloads fixtures
  mv build/fixtures.tar.xz.tmp build/fixtures.tar.xz
  # transformers[serving]'s packages (the regen tests' `transformers serve`), same versions as the venv here
  mkdir -p build/wheels-cpu
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d build/wheels-cpu $(.venv/bin/python -m pip list --format=freeze 2>/dev/null \
      | grep -i -E "^(openai|pydantic|pydantic.core|annotated.types|typing.inspection|uvicorn|fastapi|starlette|distro|jiter|sniffio|annotated.doc)==")
  ls -la build/fixtures.tar.xz build/wheels-cpu
  exit 0
fi
OUT=${OUT:-build/out}
mkdir -p "$OUT"
test -f build/fixtures/READY.json || tar xJf build/fixtures.tar.xz -C build
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  build/wheels-cpu/*.whl
export PYTHONPATH=/tmp/site:$PWD
{ lscpu | grep -E "Model name|^CPU\(s\)"; for f in avx2 avx512f amx_tile; do
    grep -qw "$f" /proc/cpuinfo && echo "flag $f: yes" || echo "flag $f: no"; done; } | tee "$OUT/cpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/cpu.txt"
python3 -m pytest -q -m "not gpu" -n "${WORKERS:-$(nproc)}" --dist loadfile -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" --durations=15 tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
