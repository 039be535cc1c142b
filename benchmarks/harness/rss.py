"""Peak resident memory of a command's whole process tree, per process, sampled from /proc (Linux).

`ru_maxrss` only sees a process from inside and a waited-for child; the memory benchmark needs every
rank of a launched job, the helper processes it starts, and which is which. A sampler thread walks
the tree every `interval` seconds and keeps each process's highest VmRSS and RssAnon (anonymous
memory: what the process itself allocated, not file pages the kernel may drop, such as a
memory-mapped checkpoint) with its command line and LOCAL_RANK / RANK from its environment.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class ProcessPeak:
    pid: int
    command: str
    parent: int
    rank: Optional[int]  # RANK (else LOCAL_RANK) from the process's environment (a fork inherits it)
    rss: int = 0  # bytes
    anon: int = 0  # bytes
    first_seen: float = field(default_factory=time.perf_counter)
    last_seen: float = 0.0


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _rank(pid: int) -> Optional[int]:
    try:
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    except OSError:
        return None
    for key in ("RANK", "LOCAL_RANK"):
        if key in env and env[key].isdigit():
            return int(env[key])
    return None


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread or process ended while the tree was walked
            pass
    return kids


def tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    return seen


class TreeSampler:
    """Samples the process tree under `root` until stopped; `peaks` by pid."""

    def __init__(self, root: int, interval: float = 0.2):
        self.root, self.interval, self.peaks = root, interval, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)

    def _sample(self) -> None:
        now = time.perf_counter()
        for pid in tree(self.root):
            try:
                status = _status(pid)
                if pid not in self.peaks:
                    command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
                    self.peaks[pid] = ProcessPeak(pid, command, _parent(pid), _rank(pid))
            except OSError:  # ended between listing and reading
                continue
            peak = self.peaks[pid]
            peak.rss, peak.anon = max(peak.rss, status.get("VmRSS", 0)), max(peak.anon, status.get("RssAnon", 0))
            peak.last_seen = now

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_sampled(
    command: list[str], env: Optional[dict] = None, cwd: Optional[str] = None, timeout: float = 1800, interval: float = 0.2
) -> tuple[int, list[ProcessPeak], str]:
    """Run `command`, sampling its tree: (return code, every process's peak, the output's tail)."""
    proc = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    with TreeSampler(proc.pid, interval) as sampler:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    return proc.returncode, sorted(sampler.peaks.values(), key=lambda p: p.first_seen), out[-4000:]
