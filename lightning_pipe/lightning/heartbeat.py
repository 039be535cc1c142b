"""A heartbeat between the ranks, so a peer that stops answering ends the job within a bounded time.

Gloo and NCCL notice a dead peer only when they talk to it, and a stopped (SIGSTOP), swapped-out or
unreachable peer not even then: its sockets stay open. Each rank's thread bumps a counter in the
job's TCPStore every `interval` seconds; global rank 0 watches every rank's counter and the others
watch rank 0's (whose process hosts the store: when it is gone or frozen their store calls fail or
time out). A counter that has not moved for `timeout` seconds ends the job through `faults.end`
with a line naming the rank. A busy rank (profiling, saving a big checkpoint) keeps beating: its
thread runs beside the work, so only silence counts, not slowness.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .. import faults

_PREFIX = "lightning_pipe/heartbeat/"


class Heartbeat(threading.Thread):
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float, interval: float = 1.0) -> None:
        super().__init__(name=f"lightning-pipe heartbeat (rank {rank})", daemon=True)
        self.rank, self.timeout, self.interval = rank, timeout, min(interval, timeout / 4)
        self.watched = list(range(1, world_size)) if rank == 0 else [0]
        # A client of its own: the process group's store connection stays free for the process group.
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        self._halt = threading.Event()
        self._answered = time.monotonic()  # when the store last answered this thread
        # Where each rank lives, said before training starts: a rank 0 frozen within the first
        # beat would otherwise freeze the store before the others learnt which process to kill.
        self.store.set(f"{_PREFIX}pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
        self._pids: dict[int, str] = {}
        if rank != 0:
            try:
                self._pids = {0: self.store.get(f"{_PREFIX}pid/0").decode()}
            except Exception:  # rank 0 never said (gone already): the loop notices and ends the job
                pass

    def stop(self) -> None:
        self._halt.set()

    def leave(self, wait: bool) -> None:
        """Stop beating and say so. Rank 0 hosts the store: after a finished run it waits (bounded)
        until every rank has left, so a rank still tearing down does not take the closed store for a
        lost rank 0 and end a finished job."""
        self.stop()
        try:
            self.store.set(f"{_PREFIX}left/{self.rank}", "1")
            if wait and self.rank == 0:
                others = [f"{_PREFIX}left/{r}" for r in self.watched]
                self.store.wait(others, timedelta(seconds=self.timeout))
        except Exception:  # a rank that never leaves was lost: its own error ends the job
            pass

    def run(self) -> None:
        seen: dict[int, int] = {}
        changed = {r: time.monotonic() for r in self.watched}
        while not self._halt.wait(self.interval):
            try:
                if len(self._pids) < len(self.watched):  # where the watched ranks live, once they said
                    self._pids = {r: self.store.get(f"{_PREFIX}pid/{r}").decode() for r in self.watched}
                self.store.add(_PREFIX + str(self.rank), 1)
                counts = {r: self.store.add(_PREFIX + str(r), 0) for r in self.watched}
            except Exception:  # the store lives in rank 0's process: it is gone or frozen (or a rank never said where it is)
                if self._halt.is_set():
                    return
                missing = [r for r in self.watched if r not in self._pids]
                if self.rank == 0 and missing:
                    self._lost(missing[0], f"did not start its heartbeat within {self.timeout:g} s")
                else:
                    self._lost(0, "is gone or frozen (its store does not answer)")
                return
            now = self._answered = time.monotonic()
            for r, count in counts.items():
                if seen.get(r) != count:
                    seen[r], changed[r] = count, now
                elif now - changed[r] > self.timeout:
                    self._lost(r, f"has not answered for {now - changed[r]:.0f} s (stopped, hung or unreachable)")
                    return

    def _lost(self, rank: int, what: str) -> None:
        # A silent peer on this host is killed, so whoever started it (Lightning's spawn launcher
        # joins its workers) is not left waiting on a stopped process. When rank 0 is lost, every
        # other rank notices: rank 1 speaks for them.
        host, _, pid = self._pids.get(rank, "").partition(":")
        if host == socket.gethostname() and pid:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        line = f"error: rank {rank} {what}; the job stops (pipeline.timeout={self.timeout:g} s)" if self.rank in (0, 1) else None
        faults.end(1, line)


def _guard(beat: Heartbeat) -> None:
    """A frozen (SIGSTOP) rank 0 freezes its store too, and a store call may then block without
    end instead of failing: watch the heartbeat thread itself."""
    while not beat._halt.wait(beat.interval):
        if time.monotonic() - beat._answered > beat.timeout:
            beat._lost(0, "is frozen (its store has not answered for {:.0f} s)".format(time.monotonic() - beat._answered))


def start_heartbeat(host: str, port: int, rank: int, world_size: int, timeout: float) -> Optional[Heartbeat]:
    if world_size < 2:
        return None
    beat = Heartbeat(host, port, rank, world_size, timeout)
    beat.start()
    if rank != 0:
        threading.Thread(target=_guard, args=(beat,), name="lightning-pipe heartbeat guard", daemon=True).start()
    return beat
