"""What the GPU was doing while a benchmark ran."""

from __future__ import annotations

import time

import torch


class GpuSampler:
    """SM clock (MHz) and board power (W) of the current GPU every `every` seconds on a thread, through NVML
    (`torch.cuda.clock_rate`/`power_draw`; without CUDA or NVML it samples nothing and `between` is {}). A ratio between two runs is
    only as good as their clocks: a power-capped GPU runs the same kernels slower."""

    def __init__(self, every: float = 0.25):
        import threading

        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self.ok = False
        try:
            if not torch.cuda.is_available():
                return
            torch.cuda.clock_rate(), torch.cuda.power_draw()
            self.ok = True
        except Exception:  # noqa: BLE001 - no NVML (pynvml) here: no samples
            return
        self._t = threading.Thread(target=self._run, args=(every,), daemon=True, name="gpu-sampler")
        self._t.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.samples.append((time.time(), float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1000))
            except Exception:  # noqa: BLE001
                return

    def stop(self) -> None:
        self._stop.set()

    def between(self, t0: float, t1: float) -> dict:
        got = [(c, w) for t, c, w in self.samples if t0 <= t <= t1]
        if not got:
            return {}
        return {"sm_mhz": sum(c for c, _ in got) / len(got), "sm_mhz_min": min(c for c, _ in got),
                "power_w": sum(w for _, w in got) / len(got)}
