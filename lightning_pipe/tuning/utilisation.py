"""Utilisation over time, phi(t), of the device a rank computes on.

On a GPU the paper reads the device's utilisation. On a CPU we define it as what it honestly is:
the busy fraction of the cores the process computes with — process CPU time over wall time in
each sampling interval, divided by torch's intra-op threads, capped at 1. It counts every thread
of the process (gloo's communication threads too), so a rank that only moves bytes is not idle.
A rank whose compute saturates its core(s) reads 1 while computing: the tuner's profile must then
be taken where that is not the whole step (large M, small N: bubbles and waits show as < 1).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch


class UtilisationSampler:
    def __init__(self, interval: float = 0.005, threads: Optional[int] = None):
        self.interval = interval
        self.threads = max(1, threads or torch.get_num_threads())
        self.samples: list[tuple[float, float]] = []  # (wall, process cpu) seconds
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "UtilisationSampler":
        self.samples.append((time.perf_counter(), time.process_time()))
        self._thread = threading.Thread(target=self._loop, name="lightning-pipe-utilisation", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.perf_counter(), time.process_time()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append((time.perf_counter(), time.process_time()))

    def curve(self, start: float, end: float) -> list[tuple[float, float]]:
        """(duration, phi) of each sampling interval inside [start, end] (perf_counter seconds)."""
        out = []
        s = self.samples
        for (w0, c0), (w1, c1) in zip(s, s[1:]):
            lo, hi = max(w0, start), min(w1, end)
            if hi <= lo or w1 <= w0:
                continue
            phi = min(1.0, max(0.0, (c1 - c0) / ((w1 - w0) * self.threads)))
            out.append((hi - lo, phi))
        return out
