"""Where the GPU waits: idle gaps in a torch.profiler timeline and what the host was doing during each.

    python -m bench.trace_gaps RUN/profile_trace.json [--min_us=20 --top=15]

`make train ARGS=--profile_steps=2` (or `bench.train --profile_steps=2`) writes the timeline next to profile.txt.
Device activity is the union of kernels, copies and memsets over all streams; a gap is a stretch with none of them.
For the largest gaps: the kernels either side and the host operators (CPU ops) running while the device was idle,
outermost first — the host work the device waited for.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_gaps(events: list[dict], min_us: float) -> tuple[list[tuple[float, float, str, str]], float, float]:
    """([(start, length, kernel before, kernel after)], busy µs, span µs) over all device streams."""
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    if not dev:
        return [], 0.0, 0.0
    gaps, busy = [], 0.0
    cur_start, cur_end, last = dev[0]["ts"], dev[0]["ts"] + dev[0]["dur"], dev[0]
    for e in dev[1:]:
        if e["ts"] > cur_end:
            busy += cur_end - cur_start
            if e["ts"] - cur_end >= min_us:
                gaps.append((cur_end, e["ts"] - cur_end, last["name"], e["name"]))
            cur_start = e["ts"]
        if e["ts"] + e["dur"] >= cur_end:
            cur_end, last = e["ts"] + e["dur"], e
    busy += cur_end - cur_start
    return gaps, busy, cur_end - dev[0]["ts"]


def host_ops_during(events: list[dict], t0: float, t1: float, limit: int = 6) -> list[str]:
    """CPU operators overlapping [t0, t1], longest overlap first, with their overlap in µs."""
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "user_annotation", "python_function"):
            continue
        a, b = max(t0, e["ts"]), min(t1, e["ts"] + e.get("dur", 0))
        if b > a:
            out.append((b - a, e["name"]))
    out.sort(key=lambda x: -x[0])
    return [f"{name[:60]} ({ov:.0f})" for ov, name in out[:limit]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--min_us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    events = load(args.trace)
    gaps, busy, span = device_gaps(events, args.min_us)
    idle = sum(g[1] for g in gaps)
    print(f"device span {span / 1000:.1f} ms, busy {busy / 1000:.1f} ms ({100 * busy / max(span, 1e-9):.1f} %), "
          f"{len(gaps)} gaps >= {args.min_us:.0f} µs totalling {idle / 1000:.2f} ms")
    after = Counter()
    for _, length, _, nxt in gaps:
        after[nxt[:70]] += length
    print("\nidle µs by the kernel that ended the gap:")
    for name, us in after.most_common(args.top):
        print(f"  {us:9.0f}  {name}")
    print(f"\nlargest {args.top} gaps (µs): before → after; host ops meanwhile (overlap µs)")
    for t, length, before, nxt in sorted(gaps, key=lambda g: -g[1])[:args.top]:
        print(f"  {length:8.0f}  {before[:45]} → {nxt[:45]}")
        print(f"            {'; '.join(host_ops_during(events, t, t + length))}")


if __name__ == "__main__":
    main()
