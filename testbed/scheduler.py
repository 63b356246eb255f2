"""The drafters' scheduler (`run_drafters`): `--parallel` jobs at a time, in the order given, beside the untrained
drafter's evaluation and the arms' cache extraction, each job's evaluation beside the next one's training
(`overlap_eval`: `eval_queue` evaluations at most pending when a training starts); the first job compiles alone and opens the gate for the others
after its first step; a job out of GPU memory is tried again after the others. A job's training and evaluation run in
other processes, the stage CLIs (`testbed.commands`: in long-lived workers, one per training at once, or a process
each), its export in this one; a pool thread per job only waits on them and shares the events the jobs wait for (the
gate, the target-alone decodes, a failure), which processes could share only through pickled proxies."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import time
from pathlib import Path

from dflash_offline.cache.fsio import write_json_atomic
from dflash_offline.devices import usable_cpus

from .commands import (
    EVAL_WORKER,
    STARTED,
    TRAIN_WORKERS,
    Background,
    Job,
    baseline_args,
    evaluate,
    evaluations_ahead,
    extract,
    fresh_run,
    job_identity,
    log,
    stage,
    train_export,
)
from .config import TestbedConfig
from .runs import JOB_FILE, SECONDS_FILE, Paths, cache_complete, eval_summary

JOB_GB = 12  # GPU memory one drafter job of the testbed recipe may take (training, then evaluation)
WARM_WAIT_S = 900  # how long the other drafters wait for the first one's compiled first step at most
WARM_POLL_S = 1.0  # how often the leading job's status file is read for its first step
FIRST_DRAFTER_S = 240  # what a drafter is expected to take before one has ended in this invocation (H200, cold: 215 s)
# the same when a stand-in compiled its graphs (`testbed.precompile`): 69–125 s measured (H100 `8c73fd9`, `21931d7`;
# H200 `92f7467`), the workers' start and the untrained evaluation beside it included
FIRST_PRECOMPILED_S = 140
EVAL_GUESS_S = 45  # an evaluation's seconds before one ended here (H100, 300 steps: 3–44 s, an arm's first the longest)
# a further seed's time as a share of its settings' first (which starts the workers, loads or compiles the graphs,
# decodes check_prompts for real): measured 0.18–0.65 on the H100 (`35932d4`: 102 s first beside the untrained
# evaluation, repeats 16–21 s; `21931d7`: a 52 s first, repeats 32–34 s); what it underestimates past stop_after_s
# the call's LIMIT (10 s above it) absorbs
REPEAT_SHARE = 0.6


def drafter_env(parallel: int) -> dict:
    """What the drafters' stages get added to the environment: with `parallel` trainings at once, each compiles with
    its share of the CPUs (TORCHINDUCTOR_COMPILE_THREADS, unless set)."""
    if parallel > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        return {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, usable_cpus() // parallel))}
    return {}


class Ahead:
    """What the drafters will need, started where the extraction starts (`--ahead`), so that it runs beside it: the
    evaluation worker and the first training's worker (their imports and CUDA: ≈ 19 s before a first training's
    first line on an H100 host, `01f126a`), and in the evaluation worker the target-alone decodes every evaluation
    reuses (`commands.baseline_args`: ≈ 24 s of the untrained evaluation there, which the first drafter's evaluation
    waited for). The untrained evaluation waits for them (`wait`); where they failed it makes them itself."""

    def __init__(self, cfg: TestbedConfig, p: Paths, dev: str, parallel: int):
        import threading

        self.cfg, self.p, self.dev, self.env = cfg, p, dev, drafter_env(parallel)
        self.log_file, self.error, self.seconds = p.root / "logs" / "baseline-ahead.log", None, None
        self.started, self.ended, self.proc = time.time(), None, None
        # (the first training's worker has these settings where it leads no others and takes no GPU of several)
        if cfg.train_worker and parallel == 1 and len(gpu_ids(cfg, dev)) <= 1:
            TRAIN_WORKERS.start(self.env)
        args = baseline_args(cfg, p, dev)
        if cfg.eval_worker:
            evaluations_ahead(cfg, self.env)
        else:  # (a process of its own, which `stop` ends)
            self.proc = Background("stages.evaluate", *args, log_file=self.log_file, env=self.env)
        self.thread = threading.Thread(target=self._baseline, args=(args,), daemon=True)
        self.thread.start()

    def _baseline(self, args: list[str]) -> None:
        try:
            self.seconds = self.proc.wait() if self.proc is not None else stage(
                "stages.evaluate", *args, log_file=self.log_file, env=self.env, worker=EVAL_WORKER)
        except Exception as e:  # noqa: BLE001 (the untrained evaluation makes them instead)
            self.error = str(e)
        self.ended = time.time()

    def wait(self) -> str | None:
        """Once the target-alone decodes are made: None, or why they were not."""
        self.thread.join()
        return self.error

    def timeline(self) -> dict:
        """When the target-alone decodes were asked for and made, in wall seconds (`state.json`'s eval phase)."""
        return {"seconds": self.seconds, "start": self.started, "end": self.ended, "error": self.error,
                "log": str(self.log_file)}

    def stop(self) -> None:
        """The target-alone decodes are no longer wanted (the phase beside, or the drafters, failed or were
        interrupted; or the drafters are done): the request still in flight ends, and the workers with it."""
        if self.thread.is_alive():
            if self.proc is not None:
                self.proc.stop()
            else:
                EVAL_WORKER.terminate()
            self.thread.join(timeout=60)
        TRAIN_WORKERS.close()


class Deferred(Exception):
    """A drafter not started: this invocation's `stop_after_s` would end before it (a rerun starts it)."""


def graph_key(j: Job) -> str:
    """What a drafter compiles and trains on: its settings but the number of steps, which compiles nothing new, and its
    cache (an arm's seeds; the null arm's, the recipe's and the known-bad arm's) — what its time depends on past its
    steps (the known-bad arm, a quarter of the recipe's steps, loads the recipe's graphs: 29 s against 39–53 s)."""
    return json.dumps({k: v for k, v in j.settings.items() if k != "steps"}, sort_keys=True) + str(j.cache)


class Drafters:
    """What `run_drafters` shares between its threads: the settings, the events (the untrained evaluation done or
    failed, each arm cache made), and per run its seconds per phase or its error."""

    def __init__(self, cfg: TestbedConfig, p: Paths, dev: str, jobs: list[Job], parallel: int, base: Path | None,
                 stream: bool, caches: dict | None, precompile=None, ahead: Ahead | None = None):
        import threading

        self.cfg, self.p, self.dev, self.base, self.stream, self.caches = cfg, p, dev, base, stream, caches or {}
        self.ahead = ahead  # (the target-alone decodes being made beside the extraction, or None)
        self.precompile = precompile  # (testbed.precompile.Precompile, or None)
        self.env = drafter_env(parallel)
        # the GPUs the trainings are spread over (`gpu_ids`): each training takes a free one, its worker sees only it
        # (CUDA_VISIBLE_DEVICES: a worker's environment is fixed at its start, so one worker per GPU); one GPU: none
        ids = gpu_ids(cfg, dev)
        self.spread, self.gpus = len(ids) > 1, queue.Queue()
        for i in range(parallel if len(ids) > 1 else 0):
            self.gpus.put(ids[i % len(ids)])
        self.ready, self.failed, self.warm = threading.Event(), threading.Event(), threading.Event()
        # the first job compiles alone (all the CPUs), the others start once its first step ran: the same graphs then
        # load from the compile caches it filled instead of 8 processes compiling them at once
        firsts = {}
        # the first drafter of each graph setting (`graph_key`) also decodes for real: each arm's first, not the null
        # arm's nor the known-bad arm's (the recipe's settings on its cache but seeds or steps: its code, whose
        # replay its first checks; the known-bad arm's τ ≈ 1.15 made its 8 real decodes 29 s on an H100, `01f126a`)
        for j in jobs:
            firsts.setdefault(graph_key(j), j.run)
        self.checked = set(firsts.values())
        self.leader = jobs[0].run if parallel > 1 and len(jobs) > 1 else None
        if self.leader is None:
            self.warm.set()
        self.times, self.errors, self.retry = {job.run: {} for job in jobs}, {}, []
        self.untrained_log = base / "logs" / "eval-untrained.log" if base else None
        self.made, self.broken = {c: threading.Event() for c in self.caches}, {}
        self.deadline = STARTED + cfg.stop_after_s if cfg.stop_after_s > 0 else None
        self.took, self.deferred, self.stopped = [], [], threading.Event()
        self.trained = set()  # (the `graph_key`s of the drafters whose training ended: a further one is a repeat)
        # with `overlap_eval` a job's evaluation goes to a pool of its own (`eval_pool`, set by run_drafters) and its
        # place among the `parallel` trainings to the next job meanwhile; `aborted`: the sweep was interrupted
        self.eval_pool, self.evals, self.parallel, self.aborted = None, [], parallel, threading.Event()
        # the evaluation worker serves one request at a time: taking turns here first, an evaluation's seconds are its
        # own, not those it waited behind another (`longest_eval_s`)
        self.eval_turn = threading.Lock() if cfg.eval_worker else contextlib.nullcontext()

    def expected_s(self, j: Job) -> float:
        """What `j` is expected to take: as long as the longest drafter of this invocation (before one ended,
        `FIRST_PRECOMPILED_S` where a stand-in compiled `j`'s graphs, else `FIRST_DRAFTER_S`) — the first of a setting
        loads or compiles its graphs and starts the workers (H200: 75–212 s);
        once a drafter of its settings (`graph_key`: other steps count as the same) ended here, as long as the longest
        repeat of its settings, or before one, the longer of the longest repeat of any (37–76 s) and `REPEAT_SHARE`
        of its settings' first (a costlier arm's repeat is; with no repeat ended yet, that share of its first)."""
        key = graph_key(j)
        own = [s for k, s, repeat in self.took if k == key and repeat]
        if own:
            return max(own)
        firsts = [s for k, s, repeat in self.took if k == key and not repeat]
        repeats = [s for _, s, repeat in self.took if repeat]
        if firsts:
            return max(max(repeats, default=0.0), REPEAT_SHARE * max(firsts))
        compiled = self.precompile is not None and self.precompile.compiled(j.run)
        return max((s for _, s, _ in self.took), default=FIRST_PRECOMPILED_S if compiled else FIRST_DRAFTER_S)

    def defer(self, j: Job) -> None:
        """Raise `Deferred` when `j` (`expected_s`) would end past the deadline; the base run's deferral also stops
        the untrained evaluation and, while the target-alone decodes it makes do not exist, every later drafter."""
        expect = self.expected_s(j)
        if self.eval_pool is not None and self.cfg.eval_queue > 1 and (waiting := self.pending()):
            expect = max(expect, (waiting + 1) * self.longest_eval_s())  # (its evaluation waits behind the pending)
        if self.deadline is not None and time.monotonic() + expect > self.deadline and self.pending():
            self.settle(0)  # (what the evaluations still running take, and their seconds, are known after them)
            expect = self.expected_s(j)
        # (once the base run is deferred before the target-alone decodes exist, so is every later drafter)
        orphan = self.stopped.is_set() and not self.p.baseline(self.cfg.eval_tokens).is_file()
        if self.deadline is None or time.monotonic() + expect <= self.deadline and not orphan:
            return
        self.deferred.append(j.run)
        if j.run == self.base:
            self.stopped.set()
        if orphan and j.run != self.base:
            raise Deferred("not started: the base drafter, whose untrained evaluation decodes the target alone for "
                           "every evaluation, was not; a rerun starts both")
        raise Deferred(f"not started: it takes ≈ {expect:.0f}s and {max(0.0, self.deadline - time.monotonic()):.0f}s "
                       f"of --stop_after_s={self.cfg.stop_after_s:g} are left; a rerun starts it")

    def each(self, n: int, fn, jobs: list[Job]) -> None:
        """`fn` on every job, `n` at a time; interrupted (Ctrl-C), no further job starts and the running ones are
        waited for, not the queued."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(n)
        try:
            list(pool.map(fn, jobs))
        except BaseException:
            self.aborted.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def longest_eval_s(self) -> float:
        """The longest evaluation of this invocation (before one ended, the untrained drafter's or `EVAL_GUESS_S`,
        whichever is longer): with `eval_queue` above 1 a job's evaluation may wait behind every pending one (they run
        one at a time)."""
        evals = [t["eval"] for t in list(self.times.values()) if "eval" in t and "reused" not in t]
        untrained = self.times.get(self.base, {}).get("untrained") if self.base is not None else None
        return max(evals, default=max(untrained or 0.0, EVAL_GUESS_S))

    def pending(self) -> int:
        """Evaluations submitted (`overlap_eval`) and not ended."""
        return sum(not f.done() for f in self.evals)

    def settle(self, most: int) -> None:
        """Wait until at most `most` evaluations are pending (their failures are `guarded`'s to report)."""
        for f in list(self.evals):
            if self.pending() <= most:
                return
            f.exception()  # (waits; never raises for a failure: `guarded` caught it)

    def untrained(self) -> None:
        """The base run's untrained drafter, evaluated as soon as that run's config.json exists (it makes the
        target-alone decodes every trained evaluation waits for)."""
        base = self.base
        try:
            if base is None or (base / "eval-untrained.json").is_file() and self.p.baseline(
                    self.cfg.eval_tokens).is_file():
                return
            while not (base / "config.json").is_file():  # written when the base run's training starts
                if self.failed.is_set() or self.stopped.is_set():
                    return
                time.sleep(1)
            if self.ahead is not None:
                why = self.ahead.wait()
                if self.failed.is_set() or self.stopped.is_set() or self.aborted.is_set():
                    return  # (ended meanwhile: no evaluation is wanted, nor a worker started again for one)
                if why:
                    log(f"the target-alone decodes made ahead failed ({why}): the untrained evaluation makes them")
                self.times[base]["baseline_ahead"] = self.ahead.seconds or 0.0
            log(f"untrained drafter: evaluating (log: {self.untrained_log})")
            with self.eval_turn:
                self.times[base]["untrained"] = evaluate(self.cfg, self.p, base, self.dev, True, self.untrained_log,
                                                         self.env)
            log(f"untrained drafter: τ {eval_summary(base / 'eval-untrained.json')['tau_mean']:.3f} "
                f"({self.times[base]['untrained']:.0f}s)")
        except BaseException:
            self.failed.set()
            raise
        finally:
            self.ready.set()

    def extract_caches(self) -> None:
        """The arms' caches, one after another; a cache that cannot be made is recorded for its jobs."""
        for c, settings in self.caches.items():
            try:
                if not cache_complete(c):
                    logf = self.p.root / "logs" / f"extract-{c.name}.log"
                    log(f"extracting the cache {c.name} ({' '.join(f'{k}={v}' for k, v in settings.items())}; "
                        f"log: {logf})")
                    secs = extract(self.cfg, self.p, settings, c.name.removeprefix("hidden-"), self.dev, logf)
                    log(f"cache {c.name} extracted ({secs:.0f}s)")
            except Exception as e:  # noqa: BLE001
                self.broken[c] = f"its cache {c} could not be extracted: {e}"
            finally:
                self.made[c].set()

    def job(self, j: Job, last: bool = False, evaluation: tuple | None = None) -> None:
        """`run_job` (or, given `evaluation`, the rest of one after its training: `evaluate_job`'s arguments); the
        leading job opens the gate for the others however it ends; the base run failing at any point (its cache not
        extracted, before its training writes the config.json the untrained evaluation waits for) fails the drafters,
        so that nothing waits on it."""
        try:
            if evaluation is None:
                self.run_job(j, last)
            else:
                self.evaluate_job(j, *evaluation)
        except Deferred:
            raise
        except BaseException:
            # (the base run's evaluation out of GPU memory beside another training is tried again like any other:
            # the target-alone decodes every evaluation waits for exist by then)
            retried = evaluation is not None and not last and out_of_memory(j.run / "logs")
            if j.run == self.base and not retried:
                self.failed.set()
            raise
        finally:
            if j.run == self.leader:
                self.warm.set()

    def run_job(self, j: Job, last: bool = False) -> None:
        """One drafter: wait for its cache, train and export it, wait for the target-alone decodes, evaluate it —
        unless its run already holds an evaluated drafter made from the same settings, cache, prompts and code."""
        if self.aborted.is_set():
            raise RuntimeError("not started: the drafters were interrupted")
        if j.cache in self.made:
            self.made[j.cache].wait()
            if j.cache in self.broken:
                raise RuntimeError(self.broken[j.cache])
        fresh_run(self.cfg, self.p, j)
        if (j.run / "eval.json").is_file():
            self.times[j.run]["reused"] = 1.0
            return
        if j.run != self.leader and not self.warm.is_set():
            t0 = time.perf_counter()
            while not self.warm.wait(1) and not self.failed.is_set() and time.perf_counter() - t0 < WARM_WAIT_S:
                pass
            self.warm.set()  # (after a time-out, the others do not wait again)
            self.times[j.run]["wait_warm"] = time.perf_counter() - t0
        if self.eval_pool is not None:  # (`eval_queue` evaluations at most beside each training: no queue builds up)
            self.settle(self.parallel * self.cfg.eval_queue)  # (eval_queue >= 1: checked)
        if self.failed.is_set():
            raise RuntimeError("not started: the base drafter or the untrained evaluation failed")
        self.defer(j)
        if self.precompile is not None and (waited := self.precompile.before(j.run)) >= 1:
            self.times[j.run]["wait_precompile"] = waited
        if self.aborted.is_set():  # (interrupted while this job waited: for evaluations, the gate, its graphs)
            raise RuntimeError("not started: the drafters were interrupted")
        t_job, repeat = time.monotonic(), graph_key(j) in self.trained
        when = {"train_start": time.time()}  # (the timeline, RUN/testbed-seconds.json: what overlapped what)
        j.run.mkdir(parents=True, exist_ok=True)
        write_json_atomic(j.run / JOB_FILE, job_identity(self.cfg, self.p, j))
        logs = None if self.stream and j.run == self.base else j.run / "logs"
        log(f"{j.arm or '(recipe)'} seed {j.seed}: training on {j.cache.name}" + (f" (logs: {logs})" if logs else ""))
        env = self.env
        if j.run == self.leader:
            (j.run / "status-rank0.json").unlink(missing_ok=True)  # (a killed run's says it stepped already)
            self.watch_warm_up(j.run)
            env = {**env, **({} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else
                             {"TORCHINDUCTOR_COMPILE_THREADS": str(usable_cpus())})}
        gpu = self.gpus.get() if self.spread else None  # (waits for a free one: `parallel` above the GPUs shares)
        if gpu is not None:  # (given back in the `finally` right below, however the training ends)
            env, when["gpu"] = {**env, "CUDA_VISIBLE_DEVICES": gpu}, gpu
        try:
            self.times[j.run].update(train_export(self.cfg, j.run, j.cache, j.seed, j.settings, env, logs))
        finally:
            if gpu is not None:
                self.gpus.put(gpu)
            if j.run == self.leader:
                self.warm.set()  # (the first step never ran, or the training is over)
                TRAIN_WORKERS.discard(env)  # (its environment, all the CPUs for compiling, is no other job's)
        when["train_end"] = time.time()
        self.trained.add(graph_key(j))
        if self.eval_pool is not None:  # (overlap_eval: this thread goes on to the next job's training)
            self.evals.append(self.eval_pool.submit(self.guarded, j, last, (t_job, repeat, logs, when)))
            return
        self.evaluate_job(j, t_job, repeat, logs, when)

    def evaluate_job(self, j: Job, t_job: float, repeat: bool, logs: Path | None, when: dict) -> None:
        """`j`'s evaluation once its drafter is exported (after waiting for the target-alone decodes), its seconds
        recorded (RUN/testbed-seconds.json) and logged."""
        if self.aborted.is_set():
            raise RuntimeError("not evaluated: the drafters were interrupted")
        t0 = time.perf_counter()
        self.ready.wait()
        baseline_wait = time.perf_counter() - t0  # (the untrained evaluation's target-alone decodes: once a sweep)
        if self.failed.is_set():
            raise RuntimeError(f"not evaluated: the base drafter or the untrained evaluation (log: "
                               f"{self.untrained_log}) failed")
        t = self.times[j.run]
        with self.eval_turn:
            t["eval"] = evaluate(self.cfg, self.p, j.run, self.dev, False, (logs or j.run / "logs") / "eval.log",
                                 self.env, self.cfg.check_prompts if j.run in self.checked else 0)
        t["eval_wall"] = time.perf_counter() - t0  # waiting for the baseline included
        self.took.append((graph_key(j), time.monotonic() - t_job - baseline_wait, repeat))
        write_json_atomic(j.run / SECONDS_FILE, {**{k: round(v, 2) for k, v in t.items()}, **when,
                                                 "eval_end": time.time(), "repeat": repeat})
        log(f"{j.arm or '(recipe)'} seed {j.seed}: τ {eval_summary(j.run / 'eval.json')['tau_mean']:.3f} ("
            + ", ".join(f"{k} {v:.0f}s" for k, v in t.items()) + ")")

    def watch_warm_up(self, run: Path) -> None:
        """Set `warm` once the leading job's training has taken its first step (its status file says so)."""
        import threading

        t0 = time.time()

        def watch():
            while not self.warm.is_set():
                try:
                    st = json.loads((run / "status-rank0.json").read_text())
                    if st.get("done", 0) >= 1 and st.get("updated_at", 0) >= t0:
                        log(f"{run}: first step compiled; the other drafters start")
                        self.warm.set()
                except (OSError, ValueError):
                    pass
                time.sleep(WARM_POLL_S)

        threading.Thread(target=watch, daemon=True).start()

    def guarded(self, j: Job, last: bool = False, evaluation: tuple | None = None) -> None:
        """`job`, its failure reported while the others go on (one out of GPU memory queued for `retry`)."""
        try:
            self.job(j, last, evaluation)
            if evaluation is not None or self.eval_pool is None:  # (not before its evaluation, which may have failed)
                self.errors.pop(j.run, None)
        except Deferred as e:
            log(f"{j.arm or '(recipe)'} seed {j.seed}: {e}")
        except Exception as e:  # noqa: BLE001
            self.errors[j.run] = str(e)
            oom = not last and not self.failed.is_set() and out_of_memory(j.run / "logs")
            if oom:
                self.retry.append(j)
            log(f"{j.arm or '(recipe)'} seed {j.seed}: {'out of GPU memory, tried again later' if oom else 'FAILED'}: {e}")


def run_drafters(cfg: TestbedConfig, p: Paths, dev: str, jobs: list[Job], parallel: int, base: Path | None,
                 stream: bool = False, caches: dict | None = None, precompile=None, ahead: Ahead | None = None) -> dict:
    """Train, export and evaluate `jobs` (each skipped when its eval.json exists), `parallel` at a time, while the
    untrained drafter of run `base` (one of them, or None) is evaluated alongside: it waits only for that run's
    config.json, and its decodes of the target alone (DIR/baseline-<tokens>.json) are reused by every trained
    drafter's evaluation, which waits for them. `stream`: the first job's training prints here (else every stage logs
    into RUN/logs/). On a GPU shared by several jobs, each compiles with its share of the CPUs
    (TORCHINDUCTOR_COMPILE_THREADS, unless set). `caches` ({path: [extract] settings}) are extracted one after
    another beside the drafters, each job on one of them waiting for it. A drafter that fails (or whose cache does)
    is logged and recorded (`error`) while the others go on, except that one which ran out of GPU memory is tried
    once more after the others, half as many at a time; when the base run or the untrained evaluation fails, no
    further job starts and that failure raises. `precompile` (`testbed.precompile.Precompile`): a job waits for its
    graphs' stand-in while it compiles, and drops it while still queued. `ahead` (`Ahead`): the target-alone decodes
    made beside the extraction, which the untrained evaluation waits for.
    Returns {run: seconds per phase (train, export, eval, and untrained for `base`), or its error}."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    for j in jobs:  # runs made from other settings or code go before anything reads them (the untrained evaluation
        if j.run == base or cache_complete(j.cache):  # reads the base run's): the others' caches may come later
            fresh_run(cfg, p, j)
    d = Drafters(cfg, p, dev, jobs, parallel, base, stream, caches, precompile, ahead)
    if any(not (j.run / "eval.json").is_file() for j in jobs):
        evaluations_ahead(cfg, d.env)  # (the evaluation worker's imports beside the first training, not after it)
    side = threading.Thread(target=d.untrained, daemon=True)
    side.start()
    threading.Thread(target=d.extract_caches, daemon=True).start()
    evals = ThreadPoolExecutor(parallel) if cfg.overlap_eval else None  # (one worker process serves them anyway)
    d.eval_pool = evals
    try:
        d.each(parallel, d.guarded, jobs)
        wait_all(d.evals)
        if d.retry and not d.failed.is_set():
            TRAIN_WORKERS.close()  # (their GPU memory is what the jobs tried again need)
            log(f"trying again {len(d.retry)} drafter(s) that ran out of GPU memory, {max(1, parallel // 2)} at a "
                f"time")
            d.each(max(1, parallel // 2), lambda j: d.guarded(j, last=True), d.retry)
            wait_all(d.evals)
        side.join()
    except BaseException:
        d.aborted.set()  # (Ctrl-C: the evaluations not started are not waited for)
        if ahead is not None:
            ahead.stop()  # (the target-alone decodes still being made are not waited for either)
        raise
    finally:
        if evals is not None:
            evals.shutdown(wait=True, cancel_futures=True)
        TRAIN_WORKERS.close()
        EVAL_WORKER.close()
    if d.failed.is_set() or base in d.errors:
        raise RuntimeError(d.errors.get(base) or f"the untrained drafter's evaluation failed (log: {d.untrained_log})")
    for run, e in d.errors.items():
        d.times[run]["error"] = e
    for run in d.deferred:
        d.times[run]["deferred"] = 1.0
    return d.times


def wait_all(futures: list) -> None:
    """Wait for every future in `futures`, one added meanwhile included (`guarded` reports their failures)."""
    while futures:
        futures.pop(0).result()


def out_of_memory(logs: Path) -> bool:
    """Whether a stage's log in `logs` ends in a GPU out-of-memory error."""
    return any("out of memory" in f.read_text(errors="replace")[-20000:].lower() for f in logs.glob("*.log"))


GPU_JOBS = 1  # drafter jobs sharing one GPU (see default_parallel)


def gpu_ids(cfg: TestbedConfig, dev: str) -> list[str]:
    """The GPUs the drafters' trainings are spread over, as CUDA_VISIBLE_DEVICES names them (within this process's own
    CUDA_VISIBLE_DEVICES, if set): `cfg.gpus` of them, every visible one for 0; [] off CUDA."""
    if dev != "cuda":
        return []
    import torch

    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    count = torch.cuda.device_count()
    names = visible[:count] if visible else [str(i) for i in range(count)]
    if cfg.gpus > len(names):
        from dflash_offline.config import ConfigError

        raise ConfigError(f"testbed.gpus={cfg.gpus}: this machine shows {len(names)} GPU(s) (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give at most {len(names)}, or 0 for all")
    return names[: cfg.gpus or len(names)]


def default_parallel(device, gpus: int = 1) -> int:
    """Drafter jobs at once on this machine: `GPU_JOBS` per GPU of the `gpus` the trainings are spread over, fewer where
    CPUs (two per job) or GPU memory (`JOB_GB` per job on each) are short. Processes on one GPU take turns on it (time slices), they do not run side by side, and the
    turns cost: on an H200 (commit 7fd43ec) two drafters training at once ran at ≈ 30K context tok/s each (60K together,
    one alone ≈ 150K; 8 at once: 7.5K each), while one job at a time took ≈ 100 s per drafter from start to its
    evaluation (train, export, replayed evaluation). The arms' cache extraction and the untrained evaluation still run
    beside the first drafter."""
    if device.type != "cuda":
        return 1
    import torch

    return max(1, min(GPU_JOBS * gpus, usable_cpus() // 2,
                      gpus * int(torch.cuda.get_device_properties(device).total_memory / 2**30 // JOB_GB)))
