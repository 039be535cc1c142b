"""Utilisation over time, phi(t), of the device a rank computes on.

On a GPU the paper reads the device's utilisation. On a CPU we define it as what it honestly is:
the busy fraction of the cores the process computes with — process CPU time over wall time in
each sampling interval, divided by torch's intra-op threads, capped at 1. It counts every thread
of the process (gloo's communication threads too), so a rank that only moves bytes is not idle.
A rank whose compute saturates its core(s) reads 1 while computing: the tuner's profile must then
be taken where that is not the whole step (large M, small N: bubbles and waits show as < 1).
On a CUDA device it reads the device's own utilisation (`torch.cuda.utilization`, NVML: the
fraction of time a kernel ran over its last sampling period), as the paper does; without NVML
(pynvml) it falls back to the host's fraction and says so in `source`.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch


class UtilisationSampler:
    def __init__(self, interval: float = 0.005, threads: Optional[int] = None, device: Optional[torch.device] = None):
        self.interval = interval
        self.threads = max(1, threads or torch.get_num_threads())
        self.samples: list[tuple[float, float]] = []  # (wall, process cpu seconds) or, on a GPU, (wall, utilisation)
        self.device = device if device is not None and device.type == "cuda" and _nvml(device) else None
        self.source = "cuda" if self.device is not None else "cpu"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _read(self) -> tuple[float, float]:
        if self.device is not None:
            return time.perf_counter(), torch.cuda.utilization(self.device) / 100.0
        return time.perf_counter(), time.process_time()

    def start(self) -> "UtilisationSampler":
        self.samples.append(self._read())
        self._thread = threading.Thread(target=self._loop, name="lightning-pipe-utilisation", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._read())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(self._read())

    def curve(self, start: float, end: float) -> list[tuple[float, float]]:
        """(duration, phi) of each sampling interval inside [start, end] (perf_counter seconds)."""
        out = []
        s = self.samples
        for (w0, c0), (w1, c1) in zip(s, s[1:]):
            lo, hi = max(w0, start), min(w1, end)
            if hi <= lo or w1 <= w0:
                continue
            if self.device is not None:  # the device's reading at the end of the interval
                phi = min(1.0, max(0.0, c1))
            else:
                phi = min(1.0, max(0.0, (c1 - c0) / ((w1 - w0) * self.threads)))
            out.append((hi - lo, phi))
        return out


def _nvml(device: torch.device) -> bool:
    try:
        torch.cuda.utilization(device)
        return True
    except Exception:  # no pynvml / NVML: the host's busy fraction instead
        return False
