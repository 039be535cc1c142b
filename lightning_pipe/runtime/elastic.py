"""AvgPipe's elastic averaging (Chen et al., PPoPP'23, §3.2), a pipeline's side of it.

Per stage k there is one reference process (`lightning_pipe.runtime.reference`) and N workers,
stage k of each parallel pipeline. They form a gloo process group of their own (members 0..N-1 the
workers by pipeline index, member N the reference), rendezvousing through the job's TCPStore, so
the design holds across nodes. After pipeline n's optimizer step at iteration t (0-based):

    Δ_n(t)     = W_n after the user's optimizer step - W_n(t)             (the local update)
    W_n(t + 1) = (1 - α) · W_n(t) + α · W_ref(max(t - s, 0)) + Δ_n(t)      (the pull, on the weights *before* Δ)
    W_ref(t + 1) = W_ref(t) + (Δ_0(t) + ... + Δ_{N-1}(t)) / N             (in the reference process)

W_ref(j) is the reference after the updates of iterations 0..j-1; s is the staleness bound. With
s = 0 and equal starts the mean of the parallel models stays W_ref exactly (up to rounding): the
pull keeps the mean where it is and the Δ's move both alike. Messages: Δ(t) goes out right after
the step (an isend the pipeline never waits for); the receive of W_ref(t + 1) is posted at once and
waited for only at the pull that needs it, one iteration later when s = 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from datetime import timedelta
from typing import Any, Iterable, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import faults

TAG_INIT, TAG_DELTA, TAG_REF = 11, 12, 13
UPDATE, STOP = 0.0, 1.0  # the first element of a Δ message
STARTED = "started"  # the store key a reference process sets under its prefix once it runs


# The reference process needs torch only: its module runs without the package's __init__, which
# imports Lightning (4-5 s of CPU per process on a 2-core machine, against 1.5 s for torch alone).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOT = (
    "import runpy, sys, types; package = types.ModuleType('lightning_pipe'); package.__path__ = [sys.argv.pop(1)]; "
    "sys.modules['lightning_pipe'] = package; runpy.run_module('lightning_pipe.runtime.reference', run_name='__main__', alter_sys=True)"
)


class ReferenceLost(RuntimeError):
    """The reference process of a stage died, stopped answering or was never reached.
    `first_hand`: seen by the worker that started it (its exit code), not through a connection."""

    def __init__(self, message: str, first_hand: bool = False):
        super().__init__(message)
        self.first_hand = first_hand


def flat_size(params: Iterable[nn.Parameter]) -> int:
    """Elements of the flat vector: at least 1, so a stage without trained parameters still
    exchanges (a zero) with its reference."""
    return max(sum(p.numel() for p in params), 1)


@torch.no_grad()
def flat_into(params: Iterable[nn.Parameter], out: Tensor) -> Tensor:
    """The parameters, one after the other, copied into `out` (kept across steps: a new buffer
    every step costs fresh pages from the OS, measured at ~30 ms per 8 MB stage)."""
    offset = 0
    for p in params:
        n = p.numel()
        out[offset : offset + n].copy_(p.reshape(-1))
        offset += n
    return out


@torch.no_grad()
def write_flat(params: Iterable[nn.Parameter], values: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(values[offset : offset + n].view_as(p))
        offset += n


@torch.no_grad()
def elastic_pull_(params: list[nn.Parameter], before: Tensor, reference: Tensor, alpha: float) -> None:
    """Parameters holding `after` (the optimizer's result) become (1 - α) · before + α · reference +
    (after - before), computed as after + α · (reference - before): the same value, and with α = 0
    exactly the optimizer's weights. Overwrites `before` (with -α · (before - reference))."""
    before.sub_(reference).mul_(-alpha)
    offset = 0
    for p in params:
        n = p.numel()
        p.add_(before[offset : offset + n].view_as(p))
        offset += n


class ReferenceLink:
    """Pipeline `index`'s end of stage `stage`'s reference process; pipeline 0 starts the process."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        stage: int,
        index: int,
        pipelines: int,
        numel: int,
        dtype: torch.dtype,
        timeout: float,
    ):
        self.stage, self.index, self.pipelines, self.numel, self.dtype = stage, index, pipelines, numel, dtype
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None
        if index == 0:
            env = dict(os.environ, OMP_NUM_THREADS="1")  # it only adds vectors
            cmd = [sys.executable, "-c", _BOOT, _PACKAGE, host, str(port), prefix, str(pipelines), str(numel)]
            self.proc = subprocess.Popen([*cmd, str(dtype).removeprefix("torch."), str(timeout)], env=env)
            proc = self.proc
            faults.on_end(lambda: proc.poll() is None and proc.kill())  # a job ending on an error takes it along
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        if self.proc is not None:
            self._await_start(store, prefix)
        try:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), index, pipelines + 1, timedelta(seconds=timeout))
        except Exception as err:
            self.close(kill=True)
            raise ReferenceLost(f"{self._who()} could not be reached within {timeout:g} s ({_first_line(err)})") from None
        self._sends: deque[tuple[dist.Work, Tensor]] = deque()
        self.max_sends = 2  # outstanding updates kept; the mode sets staleness + 2
        self._free_messages: list[Tensor] = []  # buffers reused across steps (see flat_into)
        self._free_references: list[Tensor] = []
        self.pending: deque[tuple[dist.Work, Tensor]] = deque()  # posted receives of W_ref(j), in order

    def _await_start(self, store: dist.Store, prefix: str) -> None:
        """Until the process we started says it is up: one that exits at once (e.g. cannot import) is
        reported with its exit code now, not after the group's timeout."""
        deadline = time.monotonic() + self.timeout
        while not store.check([prefix + STARTED]):
            code = self.proc.poll()
            if code is not None:
                raise ReferenceLost(f"{self._who()} exited with code {code} while starting (its stderr is above)")
            if time.monotonic() > deadline:
                self.close(kill=True)
                raise ReferenceLost(f"{self._who()} did not start within {self.timeout:g} s")
            time.sleep(0.05)

    def _who(self) -> str:
        pid = f" (pid {self.proc.pid})" if self.proc is not None else ""
        return f"the AvgPipe reference process of stage {self.stage}{pid}"

    def _post(self, op: Any, tensor: Tensor, tag: int, what: str) -> dist.Work:
        """Start a send or receive; gloo refuses at once when the peer's connection is already closed."""
        try:
            return op([tensor], self.pipelines, tag)
        except Exception as err:
            self._lost(err, what)

    def _lost(self, err: Exception, what: str) -> NoReturn:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.returncode is not None:
                raise ReferenceLost(f"{self._who()} exited with code {self.proc.returncode} ({what})", first_hand=True) from None
        raise ReferenceLost(f"{self._who()} is gone or did not answer within {self.timeout:g} s ({what}: {_first_line(err)})") from None

    def _wait(self, work: dist.Work, what: str) -> None:
        # Gloo's p2p work completes only in wait(); a dead peer fails it at once (its socket closes),
        # a silent one after the timeout.
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as err:
            self._lost(err, what)

    def send_init(self, reference: Tensor) -> None:
        """Pipeline 0: the reference's starting weights W_ref(t) (the initial model, or a checkpoint's)."""
        start = reference.detach().to("cpu", self.dtype).clone()
        self._wait(self._post(self.group.send, start, TAG_INIT, "sending the start"), "sending the start")

    def send_delta(self, delta: Tensor) -> None:
        """Δ_n(t), asynchronously; only sends older than the pulls since are waited for (already done)."""
        message = self._free_messages.pop() if self._free_messages else torch.empty(self.numel + 1, dtype=self.dtype)
        message[0] = UPDATE
        message[1:].copy_(delta.detach())
        self._sends.append((self._post(self.group.send, message, TAG_DELTA, "sending an update"), message))
        while len(self._sends) > self.max_sends:  # done long ago: the reference took them before the pulls since
            work, done = self._sends.popleft()
            self._wait(work, "sending an update")
            self._free_messages.append(done)

    def post_reference(self) -> None:
        """Post the receive of the next W_ref (its index is one more than the last posted)."""
        buffer = self._free_references.pop() if self._free_references else torch.empty(self.numel, dtype=self.dtype)
        self.pending.append((self._post(self.group.recv, buffer, TAG_REF, "receiving the reference weights"), buffer))

    def take_reference(self) -> Tensor:
        """The oldest posted W_ref, waited for."""
        work, buffer = self.pending.popleft()
        self._wait(work, "receiving the reference weights")
        return buffer

    def release(self, buffer: Tensor) -> None:
        """A reference buffer the caller is done with, for a later receive."""
        if buffer.device.type == "cpu" and buffer.numel() == self.numel and buffer.dtype == self.dtype:
            self._free_references.append(buffer)

    def stop(self) -> None:
        """End of training: every pipeline says stop; pipeline 0 waits for the process to exit."""
        try:
            while self._sends:
                self._wait(self._sends.popleft()[0], "sending an update")
            while self.pending:
                self.take_reference()
            stop = torch.zeros(self.numel + 1, dtype=self.dtype)
            stop[0] = STOP
            self._wait(self._post(self.group.send, stop, TAG_DELTA, "stopping it"), "stopping it")
            if self.proc is not None:
                self.proc.wait(timeout=self.timeout)
        finally:
            self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None and kill:
            self.proc.kill()
            self.proc.wait()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
