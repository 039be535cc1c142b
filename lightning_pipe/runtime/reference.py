"""An AvgPipe reference process (§3.2): stage k of the reference model, apart from the pipelines.

    python -m lightning_pipe.runtime.reference HOST PORT PREFIX PIPELINES NUMEL DTYPE TIMEOUT

(the worker runs this module without the package's `__init__`, which would import Lightning: it needs
torch only.) Started by pipeline 0's stage-k worker (`elastic.ReferenceLink`). It joins the stage's gloo group
as its last member, receives its starting weights W_ref from pipeline 0, then per iteration
receives the N local updates Δ_n, sums them in pipeline order (deterministic), normalises (÷ N),
applies them, and sends the new W_ref to every pipeline. A stop message from the pipelines ends it;
so does any pipeline going away (its connection fails), so it never outlives the job.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import faults
from .elastic import STARTED, STOP, TAG_DELTA, TAG_INIT, TAG_REF


def serve(group: dist.ProcessGroup, pipelines: int, numel: int, dtype: torch.dtype) -> int:
    """The loop; returns the number of iterations applied."""
    reference = torch.empty(numel, dtype=dtype)
    group.recv([reference], 0, TAG_INIT).wait()
    messages = [torch.empty(numel + 1, dtype=dtype) for _ in range(pipelines)]
    total, out = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)  # reused: no fresh pages per step
    sends: list[dist.Work] = []
    iterations = 0
    while True:
        for work in [group.recv([messages[n]], n, TAG_DELTA) for n in range(pipelines)]:
            work.wait()
        if any(m[0].item() == STOP for m in messages):
            return iterations
        total.copy_(messages[0][1:])
        for m in messages[1:]:
            total += m[1:]
        reference += total.div_(pipelines)
        for work in sends:  # the previous W_ref went out before `out` is written again
            work.wait()
        out.copy_(reference)
        sends = [group.send([out], n, TAG_REF) for n in range(pipelines)]
        iterations += 1


def main(argv: list[str]) -> int:
    host, port, prefix, pipelines, numel, dtype, timeout = argv
    seconds = timedelta(seconds=float(timeout))
    torch.set_num_threads(1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=seconds, wait_for_workers=False)
    store.set(prefix + STARTED, str(os.getpid()))  # the worker that started us waits for this, not for the timeout
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), int(pipelines), int(pipelines) + 1, seconds)
    try:
        serve(group, int(pipelines), int(numel), getattr(torch, dtype))
    except Exception as err:  # a pipeline went away: the job is ending (its own error says why)
        if faults.debug():
            raise
        print(f"lightning-pipe reference process ({prefix}): {type(err).__name__}: {err}", file=sys.stderr) if _verbose(err) else None
        return 1
    return 0


def _verbose(err: Exception) -> bool:
    """Lost connections are the pipelines ending; anything else is worth a line."""
    return "Connection closed" not in str(err) and "Connection reset" not in str(err)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
