"""Device choice, one owner: every stage turns its `device` setting into a torch device here, the same way.

- `auto`: the CUDA device where there is one, else the CPU;
- `cuda` / `cuda:N`: that GPU, refused without CUDA (or without GPU N) with a ValueError naming the setting and the
  fix, before anything is read or loaded: no stage falls back to the CPU on its own;
- `cpu`: the CPU.

A CUDA device always carries its index (the process's local rank under a launcher, else the current device) and is
made the current one, so allocations without an explicit device land on it too.

CPU counts: `usable_cpus` is what a process may really run on — its CPU affinity, capped by the CPU quota of its
cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`, the tightest of its cgroup and their parents) and, for one of several
ranks on a host, by its share of the host's or container's CPUs (its cgroup's cpuset) and of that quota: a container
limited to 8 CPUs on a 128-core host gets 8 tokenizer processes, not 128; 8 ranks in it read a resident cache on 1
thread each. The cgroup files are found under /sys/fs/cgroup by the paths /proc/self/cgroup gives (the container's
own tree, or the host's walked up to its root); mounts elsewhere (mountinfo) are not looked for: no cap there.

CPU threads: the CPU path exists for the tiny targets (tests, `make demo`), whose small matmuls run fastest on one
thread; more threads mostly wait on each other, and oversubscribe a small machine shared by several processes.
`cpu_threads` sets that (unless `OMP_NUM_THREADS` or an explicit thread count says otherwise) and says so.

On the CPU, transformers runs its reference PyTorch kernels for the Gated DeltaNet layers (fla's are Triton kernels
for GPUs) and warns, once per kernel, to install flash-linear-attention — which is installed. `quiet_cpu_kernel_notes`
replaces those notes with one accurate line, and drops fla's own note where Triton is installed but finds no GPU.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is picked: `--help` and config errors stay instant
    import torch

SETTINGS = "auto, cpu, cuda or cuda:N"


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from accelerate/torchrun's environment; (0, 1, 0) when run alone. The local
    rank is the process's GPU: one process per GPU."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process's cgroup quota allows (quota / period: 2.5 for `250000 100000`), the tightest of its cgroup
    and every parent up to `root`, v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`); None without a
    quota (`max`, -1), or where the files are missing, unreadable or not understood: it never raises."""
    limits = []
    try:
        for d, v2 in _cgroup_dirs(root, proc, "cpu"):
            try:
                if v2:
                    quota, period = (d / "cpu.max").read_text().split()[:2]
                else:
                    quota, period = ((d / f).read_text().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
                if quota not in ("max", "-1") and float(quota) > 0 and float(period) > 0:
                    limits.append(float(quota) / float(period))
            except (OSError, ValueError):
                pass
    except (OSError, ValueError):  # (a CPU count must not stop a stage: no cap is the safe answer)
        return None
    return min(limits) if limits else None


def cgroup_cpuset(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """How many CPUs this process's cgroup cpuset holds (v2 `cpuset.cpus.effective`; v1 `cpuset.effective_cpus`, else
    `cpuset.cpus`), from the nearest of its cgroup and its parents whose file says (an empty file, or one not
    understood, is passed over for its parent's): a container's CPUs, where `os.cpu_count()` says the host's. None
    where no file says; it never raises."""
    try:
        for d, v2 in _cgroup_dirs(root, proc, "cpuset"):
            for name in ("cpuset.cpus.effective",) if v2 else ("cpuset.effective_cpus", "cpuset.cpus"):
                try:
                    n = _cpu_list_size((d / name).read_text())
                except (OSError, ValueError):
                    continue
                if n:
                    return n
    except (OSError, ValueError):
        return None
    return None


def _cpu_list_size(text: str) -> int:
    """CPUs in a kernel CPU list such as `0-3,8-11` (0 for an empty one); ValueError for anything else."""
    n = 0
    for r in text.strip().split(",") if text.strip() else ():
        a, _, b = r.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or lo < 0:
            raise ValueError(f"not a CPU range: {r!r}")
        n += hi - lo + 1
    return n


def _cgroup_dirs(root: Path, proc: Path, controller: str):
    """(directory, is v2) of this process's cgroups that hold `controller`'s files, each from the process's own up
    to the mounted tree's root (a parent's limits bind its children); a cgroup /proc places outside this namespace's
    root (`..`) is skipped. Under a container's own tree the host's path is not there: the walk reaches its root."""
    for line in proc.read_text(errors="replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            base, v2 = root, True
        elif controller in controllers.split(","):  # v1: the controller's own hierarchy (cpu,cpuacct or cpu)
            base, v2 = root / controllers, False
            if not os.path.isdir(base):
                base = root / controller
        else:
            continue
        if ".." in path.strip().split("/"):  # (outside this namespace's root: not in the mounted tree)
            continue
        rel = posixpath.normpath("/" + path.strip()).lstrip("/")
        d = base / rel if rel not in ("", ".") else base
        while True:
            yield d, v2
            if d == base:
                break
            d = d.parent


def usable_cpus(ranks: int = 1, root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs one of `ranks` processes on this host may use (at least one, rounded down): its affinity, capped by its
    share of the host's or container's CPUs (`cgroup_cpuset`) and of its cgroup's CPU quota, which the ranks share.
    A rank a launcher pinned to CPUs of its own keeps them (they are at most its share); ranks given one set of CPUs
    (taskset, a NUMA node) split what the container holds, never more. Ranks each in a cgroup of their own would be
    split again: no launcher here does that."""
    ranks, host = max(1, ranks), os.cpu_count() or 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host
    whole = min(host, cgroup_cpuset(root, proc) or host)
    share = min(cpus, whole / ranks)
    quota = cgroup_cpu_quota(root, proc)
    if quota is not None:
        share = min(share, quota / ranks)
    return max(1, int(share))


def check_setting(setting: str, field: str) -> None:
    """Refuse a device setting that is none of `SETTINGS` (what a config's `resolve` calls)."""
    index = setting.removeprefix("cuda:")
    if not (setting in ("auto", "cpu", "cuda") or (setting.startswith("cuda:") and index.isdigit())):
        raise ValueError(f"{field}={setting!r}: expected {SETTINGS}")


def pick_device(setting: str, field: str, local_rank: int | None = None) -> torch.device:
    """The device `setting` names; `field` (e.g. "extract.device") is how the refusal names the setting.
    `local_rank`: this process's GPU under a launcher (one process per GPU); None: the current CUDA device."""
    import torch

    check_setting(setting, field)
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        quiet_cpu_kernel_notes()
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}={setting} but CUDA is not available: pass --device=cpu (or auto), or run on a "
                         f"GPU machine")
    if setting.startswith("cuda:"):
        index = int(setting.removeprefix("cuda:"))
    else:  # auto or cuda
        index = local_rank if local_rank is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"{field}={setting} needs GPU {index} but {torch.cuda.device_count()} are visible: pass "
                         f"--device=cuda (or a visible index), or check CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cpu_threads(device: torch.device, threads: int = 0, log: Callable[[str], None] = print) -> int:
    """Set torch's CPU threads: `threads` when > 0; else one thread on a CPU run when OMP_NUM_THREADS is unset (what
    `make demo` sets); otherwise torch's own choice. Returns the count in use."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        log("device cpu: torch uses 1 thread (fastest for the tiny CPU targets); set OMP_NUM_THREADS=N to choose")
    return torch.get_num_threads()


FALLBACK_NOTE = "is falling back to its reference PyTorch implementation"


class _CpuKernelNotes:
    """A logging filter: transformers' 'install flash-linear-attention' notes become one line of ours."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.said = log, False

    def filter(self, record) -> bool:
        if FALLBACK_NOTE not in record.getMessage():
            return True
        if not self.said:
            self.said = True
            self.log("device cpu: transformers runs its reference PyTorch kernels for the Gated DeltaNet layers "
                     "(flash-linear-attention's kernels need a GPU); correct, and fast enough for the tiny targets")
        return False


# fla's note when it is imported where Triton finds no GPU (Triton installed on a CPU-only machine, or the GPU
# hidden): CPU tensors take transformers' torch functions there (target.route_gated_deltanet_by_device)
FLA_CPU_NOTE = "Triton is not supported on current platform, roll back to CPU"


def quiet_cpu_kernel_notes(log: Callable[[str], None] = print) -> None:
    """Install `_CpuKernelNotes` on transformers' kernel logger (once per process), and drop fla's `FLA_CPU_NOTE`."""
    import logging
    import warnings

    logger = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _CpuKernelNotes) for f in logger.filters):
        logger.addFilter(_CpuKernelNotes(log))
    warnings.filterwarnings("ignore", message=FLA_CPU_NOTE, category=UserWarning)
