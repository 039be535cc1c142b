"""What a message costs in training, measured on the real ranks: the simulator's message terms.

A quiet ping-pong measures the link, not what training sees. In a pipeline's steady state the
neighbouring ranks compute at the same time, issue their sends (gloo copies and enqueues them on
the calling thread) and wait for each other's data; on CPU ranks gloo's own threads then compete
with the computes for the cores. So the measurement works like a pipeline hop, pair by pair:

- **bounce** (always): the pair bounces the message, each side working `think` seconds before it
  answers (busy on the core, as a CPU compute; or sleeping, as a rank whose GPU computes); a round
  trip less the other side's turnaround is two hand-offs, no clocks compared (works across hosts).
  The sender goes idle after its send, so gloo's threads have a free core.
- **lockstep** (besides, when the pair shares a host): both sides work `think`, send to each other
  and wait, as neighbours in a pipeline's steady state do. Each message carries its sender's clock
  at `isend` (one monotonic clock per host), so a receiver that was already waiting when it was
  sent reads its hand-off directly: from the sender calling `isend` until the receiver returns
  from `wait` with the data.

On one host the two regimes' samples are pooled (a step has hops of both kinds; equal weight is
our choice, a bounce's round trip counting as its two hand-offs).

Besides: the time inside `isend` (send overhead), and inside `irecv` plus a `wait` on data that has
already arrived (receive overhead). All three are kept as *means*: a step pays for every message
it sends, and both the thread time in `isend` and the hand-off have heavy tails (on 2 CPU
processes the lockstep's mean `isend` was about 6x its median), so the expected value is the
honest single figure for a deterministic simulator; the hand-off distribution is kept (quantiles)
for the docs and for anyone who wants the tail.

`MessageCosts.apply(costs)` puts them in a `CostModel`: the overheads as they are, and as hand-off
delay the mean measured hand-off beyond what the cost model already charges for it (send overhead,
latency, bytes / bandwidth).

Collective over the process group; a few hundred milliseconds. Nothing here knows Lightning.
"""

from __future__ import annotations

import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..simulation.costs import CostModel

QUANTILES = 20  # the hand-off distribution is kept as its 5% .. 95% quantiles plus min and max


@dataclass(frozen=True)
class MessageCosts:
    send_overhead: float  # s in isend, mean
    recv_overhead: float  # s in irecv + wait on data already there, means
    handoff_mean: float  # s from isend until the waiting receiver runs, mean over all samples
    handoff_quantiles: tuple[float, ...]  # min, 5%, ..., 95%, max
    nbytes: int  # message size measured
    think: float  # s of work between hops
    samples: int
    seconds: float  # what the measurement took
    method: str = "bounce"  # "bounce" (round trips, no clocks compared) or "bounce+lockstep" (one host: both regimes)

    def _charged(self, costs: CostModel) -> float:
        """What `costs` charges a message of this size before it lands: send overhead, latency, bytes / bandwidth."""
        return self.send_overhead + costs.latency + (self.nbytes / costs.bandwidth if costs.bandwidth != float("inf") else 0.0)

    def handoff_delay(self, costs: CostModel) -> float:
        """The mean hand-off beyond what `costs` charges a message of this size already."""
        return max(self.handoff_mean - self._charged(costs), 0.0)

    def handoff_sampler(self, costs: CostModel, rng: random.Random) -> Callable[[], float]:
        """Draws for `simulate(delays=...)`: a hand-off from the measured distribution (linear between
        the stored quantiles), less what `costs` charges a message already (send overhead, link),
        never below 0. Use with ``replace(costs, handoff_delay=0.0)``."""
        q, floor = self.handoff_quantiles, self._charged(costs)
        steps = len(q) - 1

        def draw() -> float:
            x = rng.random() * steps
            i = min(int(x), steps - 1)
            return max(q[i] + (q[i + 1] - q[i]) * (x - i) - floor, 0.0)

        return draw

    def apply(self, costs: CostModel) -> CostModel:
        return replace(costs, send_overhead=self.send_overhead, recv_overhead=self.recv_overhead, handoff_delay=self.handoff_delay(costs))

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "MessageCosts":
        data = dict(data)
        data["handoff_quantiles"] = tuple(data["handoff_quantiles"])
        return MessageCosts(**data)

    def summary(self) -> str:
        q = self.handoff_quantiles
        return (
            f"send {self.send_overhead * 1e6:.0f} us, receive {self.recv_overhead * 1e6:.0f} us per message; hand-off mean "
            f"{self.handoff_mean * 1e6:.0f} us (median {q[len(q) // 2] * 1e6:.0f} us, 95% {q[-2] * 1e6:.0f} us, max "
            f"{q[-1] * 1e6:.0f} us) at {self.nbytes} B, {self.samples} {self.method} samples in {self.seconds:.2f} s"
        )


def _work(seconds: float, sleep: bool) -> None:
    if sleep:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # a compute holds its core; so does this
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL's wait orders the stream; the data is there once it is synchronised
        torch.cuda.synchronize(device)


def _lockstep(peer: int, buf: torch.Tensor, rounds: int, think: float, sleep: bool, group) -> dict:
    """One side of a pair on one host: both sides work, send to each other and wait, `rounds`
    times. `buf` is float64; its first element carries the sender's clock at `isend`."""
    device = buf.device
    inbox = torch.empty_like(buf)
    sends, posts, handoffs = [], [], []
    for k in range(rounds + 1):  # round 0 warms the connection up
        t = time.perf_counter()
        recv = dist.irecv(inbox, peer, group=group)
        posted = time.perf_counter() - t
        _work(think, sleep)
        stamp = torch.tensor([time.perf_counter()], dtype=buf.dtype)
        buf[:1].copy_(stamp)  # on an accelerator this is a host-to-device copy: part of the send, as a stage's output is there already
        t0 = time.perf_counter()
        send = dist.isend(buf, peer, group=group)
        sent = time.perf_counter() - t0
        waiting = time.perf_counter()
        recv.wait()
        _sync(device)
        arrived = time.perf_counter()
        their = float(inbox[0].item())
        send.wait()
        if k == 0:
            continue
        sends.append(sent)
        posts.append(posted)
        if their >= waiting:  # this side was waiting when the peer sent: a hand-off as a stage waiting for its input sees it
            handoffs.append(arrived - their)
    return {"sends": sends, "posts": posts, "handoffs": handoffs}


def _bounce(peer: int, first: bool, buf: torch.Tensor, rounds: int, think: float, sleep: bool, group) -> dict:
    """One side of a pair: `rounds` round trips, each side working `think` s before it answers."""
    device = buf.device
    inbox = torch.empty_like(buf)
    sends, posts, turnarounds, trips = [], [], [], []
    for _ in range(rounds + 1):  # round 0 warms the connection up
        t = time.perf_counter()
        recv = dist.irecv(inbox, peer, group=group)
        posts.append(time.perf_counter() - t)
        if first:
            _work(think, sleep)
            t0 = time.perf_counter()
            send = dist.isend(buf, peer, group=group)
            sends.append(time.perf_counter() - t0)
            recv.wait()
            _sync(device)
            trips.append(time.perf_counter() - t0)
        else:
            recv.wait()
            _sync(device)
            t1 = time.perf_counter()
            _work(think, sleep)
            t2 = time.perf_counter()
            send = dist.isend(buf, peer, group=group)
            sends.append(time.perf_counter() - t2)
            turnarounds.append(t2 - t1)
        send.wait()
    return {"sends": sends[1:], "posts": posts[1:], "turnarounds": turnarounds[1:], "trips": trips[1:]}


def _completions(peer: int, first: bool, buf: torch.Tensor, rounds: int, think: float) -> list[float]:
    """A receive whose data is already there: what completing it costs the receiver's thread
    (measured on the pair's second side)."""
    device = buf.device
    inbox = torch.empty_like(buf)
    waits = []
    for _ in range(max(rounds // 4, 3)):
        if first:
            send = dist.isend(buf, peer)
            send.wait()
        else:
            recv = dist.irecv(inbox, peer)
            _work(max(think, 2e-4) * 2, True)  # sleep: the data lands meanwhile
            t = time.perf_counter()
            recv.wait()
            _sync(device)
            waits.append(time.perf_counter() - t)
    return waits


def measure_messages(
    chain: Sequence[int],
    nbytes: int,
    device: torch.device,
    think: float = 1e-3,
    sleep: bool = False,
    rounds: int = 40,
    group: Optional[dist.ProcessGroup] = None,
) -> Optional[MessageCosts]:
    """Measure on the ranks of `chain` (global ranks in stage order: each bounces with its
    neighbours, first the pairs (0, 1), (2, 3), ..., then (1, 2), (3, 4), ... at once) with
    messages of `nbytes` bytes and `think` s of work per hop (busy, or `sleep` for an emulated or
    GPU-backed rank). Collective over `group` (every rank calls it, in or out of the chain); returns
    the same `MessageCosts` everywhere, or None when the chain has a single rank."""
    if len(chain) < 2:
        return None
    start = time.perf_counter()
    rank = dist.get_rank()
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    one_host = len({hosts[r] for r in chain}) == 1
    # lockstep stamps a float64 clock into the message; the bounce sends what the stages send
    buf = (
        torch.zeros(max(1, nbytes // 8), dtype=torch.float64, device=device)
        if one_host
        else torch.zeros(max(1, nbytes // 4), device=device)
    )
    mine: list[dict] = []
    for phase in (0, 1):
        for i in range(phase, len(chain) - 1, 2):
            a, b = chain[i], chain[i + 1]
            if rank in (a, b):
                peer = b if rank == a else a
                run = {"pair": (a, b), "first": rank == a, **_bounce(peer, rank == a, buf, rounds, think, sleep, None)}
                if one_host:
                    run["lockstep"] = _lockstep(peer, buf, rounds, think, sleep, None)
                mine.append({**run, "waits": _completions(peer, rank == a, buf, rounds, think)})
        # pairs of one phase run at once; the next phase starts when all are done
        dist.barrier(group=group)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    runs = [run for part in gathered for run in part]
    steps = [r["lockstep"] for r in runs if "lockstep" in r]  # one host: both regimes' samples, pooled
    sends = [x for r in runs + steps for x in r["sends"]]
    recvs_post = [x for r in runs + steps for x in r["posts"]]
    waits = [x for r in runs for x in r["waits"]]
    seconds_box = [time.perf_counter() - start]
    turnarounds = {r["pair"]: r["turnarounds"] for r in runs if not r["first"]}
    handoffs = [h for r in steps for h in r["handoffs"]]
    for r in runs:  # a round trip less the other side's turnaround is two hand-offs: no clocks compared
        if r["first"]:
            handoffs += [(trip - turn) / 2 for trip, turn in zip(r["trips"], turnarounds[r["pair"]]) for _ in range(2)]
    handoffs = sorted(max(h, 0.0) for h in handoffs)
    dist.broadcast_object_list(seconds_box, src=chain[0], group=group)
    n = len(handoffs)
    quantiles = tuple(handoffs[min(n - 1, round(k * (n - 1) / QUANTILES))] for k in range(QUANTILES + 1))
    return MessageCosts(
        send_overhead=statistics.fmean(sends),
        recv_overhead=statistics.fmean(recvs_post) + statistics.fmean(waits),
        handoff_mean=statistics.fmean(handoffs),
        handoff_quantiles=quantiles,
        nbytes=int(buf.numel() * buf.element_size()),
        think=think,
        samples=n,
        seconds=seconds_box[0],
        method="bounce+lockstep" if one_host else "bounce",
    )
