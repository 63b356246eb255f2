#!/usr/bin/env bash
# One call on a lent GPU machine (docs/testbed.md, "On a lent GPU"): install the carried wheels (.whl/: fla, torchao)
# into /tmp/site, run the command given for at most LIMIT seconds in its own process group (then the whole group is
# stopped: a rerun of the testbed resumes), pin fla's autotuner choices recorded before (bench/autotune/) and record
# the new ones, and copy what the testbed left into $OUT.
#   LIMIT=540 bash bench/device_call.sh python3 -m testbed --sweep=encodings,fp8 --results=...
set -uo pipefail
LIMIT=${LIMIT:-540}
DIR=${TESTBED_DIR:-build/testbed}
OUT=${OUT:-build/out}
mkdir -p "$OUT" build
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 DFLASH_AUTOTUNE_RECORD=$PWD/build/autotune
# fla's autotuner choices recorded on earlier calls (bench/autotune/: the table of this Triton, fla and GPU, if any):
# a cold machine then compiles one config per kernel for the shapes recorded there instead of timing every candidate
# (other shapes autotune, and are recorded for the table); DFLASH_AUTOTUNE_PIN= turns it off
export DFLASH_AUTOTUNE_PIN=${DFLASH_AUTOTUNE_PIN-$PWD/bench/autotune}
[ -n "${DFLASH_COMMIT:-}" ] || echo "[device_call] DFLASH_COMMIT not given: the results record this copy's git" \
  "commit ($(git rev-parse --short HEAD 2>/dev/null || echo none)), which may not be the tree's: give DFLASH_COMMIT=<sha>"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv,noheader
log=build/call-$(date +%s).log
since=$(mktemp)  # (the results files written after it are this call's: only those go to $OUT, which holds 8 files)
setsid "$@" >"$log" 2>&1 &
pid=$!
t0=$SECONDS
while kill -0 "$pid" 2>/dev/null && ((SECONDS - t0 < LIMIT)); do sleep 2; done
if kill -0 "$pid" 2>/dev/null; then
  echo "[device_call] stopping the run after ${LIMIT}s (a rerun resumes)"
  kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
  rc=124
else
  wait "$pid"; rc=$?
fi
echo "[device_call] exit status $rc after $((SECONDS - t0))s"
cp "$log" "$OUT/call.log"
for f in testbed.json state.json wall.json; do [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/"; done
# what the drafters left (finished or not): evaluations, metrics, status files, logs; the arm caches' logs
[ -d "$DIR/runs" ] && tar czf "$OUT/runs.tgz" -C "$DIR" $(cd "$DIR" && ls -d ab baseline-*.json logs runs/*/seed*/eval*.json \
  runs/*/seed*/metrics.jsonl runs/*/seed*/status-rank0.json runs/*/seed*/testbed-*.json runs/*/seed*/logs \
  target/*.json 2>/dev/null)  # (the target's tokenizer and config: --summarize=1 measures the baseline's looping share)
compgen -G "build/autotune/*.json" >/dev/null && tar czf "$OUT/autotune.tgz" build/autotune
find bench/results -maxdepth 1 -name "testbed-*.json" -newer "$since" -exec cp {} "$OUT/" \;
grep -E "^\[testbed|phase|FAILED|τ|error|Error" "$log" | tail -60
exit $rc
