"""Timing for the demo and the benchmark script: ratios measured in one run, not tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def best_times(
    calls: Sequence[Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Best (min) time in seconds of each callable over ``repeats`` interleaved rounds.

    Each callable runs once first (numba compiles or loads its kernels then); the rounds
    interleave the callables so that machine noise hits them alike, which is what makes their
    ratios meaningful on a busy machine. ``clock`` is wall time by default;
    ``time.thread_time`` leaves out other processes on a busy machine (it sees only the calling
    thread, so only for calls that run on it).

    Examples
    --------
    >>> import numpy as np
    >>> from softorder._timing import best_times
    >>> x = np.arange(1000.0)
    >>> t_sort, t_sum = best_times([lambda: np.sort(x), lambda: x.sum()], repeats=3)
    >>> t_sort > 0 and t_sum > 0
    True
    """
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for j, call in enumerate(calls):
            start = clock()
            call()
            best[j] = min(best[j], clock() - start)
    return best
