"""How the examples time a call: warm-up calls first, then each call timed on its own;
they print the median and the range, since one timing on a busy machine can be off
by 100x."""

from __future__ import annotations

import statistics
import time

import torch


def call_ms(fn, repeats: int, device: torch.device, warmup: int = 3) -> list[float]:
    """``fn()`` called ``warmup`` times untimed, then ``repeats`` times: the ms of each."""
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    return times_ms


def summary(values: list[float], unit: str) -> str:
    """``"  12.34 <unit> (median of N, range 11.90-15.02)"``."""
    return (f"{statistics.median(values):8.2f} {unit} (median of {len(values)}, range "
            f"{min(values):.2f}-{max(values):.2f})")
