"""What a message costs in training, measured on the real ranks: the simulator's message terms.

A quiet ping-pong measures the link, not what training sees. In a pipeline a rank computes, then
issues its sends (gloo copies and enqueues them on the calling thread), while its neighbour has
been waiting for a while and must be woken when the data lands. So the measurement works like a
pipeline hop: each pair of neighbouring ranks bounces a message of the boundary's size, and each
side *works* for `think` seconds before answering (busy on its core, as a CPU compute; or
sleeping, as a rank whose GPU computes). From each round trip, clock-free (each side subtracts
its own turnaround), one hand-off sample: from the sender calling `isend` until the receiver
returns from `wait` with the data. Besides: the time inside `isend` (send overhead), and inside
`irecv` plus a `wait` on data that has already arrived (receive overhead).

`MessageCosts.apply(costs)` puts them in a `CostModel`: the overheads as they are, and as hand-off
delay the mean measured hand-off beyond what the cost model already charges for it (send overhead,
latency, bytes / bandwidth). Mean, not median: the simulator is deterministic and a step pays for
every late hop on its critical path, so the expected delay is the honest single figure; the
distribution is kept (quantiles) for the docs and for anyone who wants the tail.

Collective over the process group; a few hundred milliseconds. Nothing here knows Lightning.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .simulator import CostModel

QUANTILES = 20  # the hand-off distribution is kept as its 5% .. 95% quantiles plus min and max


@dataclass(frozen=True)
class MessageCosts:
    send_overhead: float  # s in isend, median
    recv_overhead: float  # s in irecv + wait on data already there, medians
    handoff_mean: float  # s from isend until the waiting receiver runs, mean over all samples
    handoff_quantiles: tuple[float, ...]  # min, 5%, ..., 95%, max
    nbytes: int  # message size measured
    think: float  # s of work between hops
    samples: int
    seconds: float  # what the measurement took

    def handoff_delay(self, costs: CostModel) -> float:
        """The mean hand-off beyond what `costs` charges a message of this size already."""
        link = costs.latency + (self.nbytes / costs.bandwidth if costs.bandwidth != float("inf") else 0.0)
        return max(self.handoff_mean - self.send_overhead - link, 0.0)

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
            f"{q[-1] * 1e6:.0f} us) at {self.nbytes} B, {self.samples} samples in {self.seconds:.2f} s"
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
    # a receive whose data is already there: what completing it costs the receiver's thread
    waits = []
    for _ in range(max(rounds // 4, 3)):
        if first:
            send = dist.isend(buf, peer, group=group)
            send.wait()
        else:
            recv = dist.irecv(inbox, peer, group=group)
            _work(max(think, 2e-4) * 2, True)  # sleep: the data lands meanwhile
            t = time.perf_counter()
            recv.wait()
            _sync(device)
            waits.append(time.perf_counter() - t)
    return {"sends": sends[1:], "posts": posts[1:], "turnarounds": turnarounds[1:], "trips": trips[1:], "waits": waits}


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
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    mine: list[dict] = []
    for phase in (0, 1):
        for i in range(phase, len(chain) - 1, 2):
            a, b = chain[i], chain[i + 1]
            if rank in (a, b):
                mine.append(
                    {"pair": (a, b), "first": rank == a, **_bounce(b if rank == a else a, rank == a, buf, rounds, think, sleep, None)}
                )
        # pairs of one phase run at once; the next phase starts when all are done
        dist.barrier(group=group)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    runs = [run for part in gathered for run in part]
    sends = [x for r in runs for x in r["sends"]]
    recvs_post = [x for r in runs for x in r["posts"]]
    waits = [x for r in runs for x in r["waits"]]
    seconds_box = [time.perf_counter() - start]
    turnarounds = {r["pair"]: r["turnarounds"] for r in runs if not r["first"]}
    handoffs = []
    for r in runs:  # a round trip less the other side's turnaround is two hand-offs: no clocks compared
        if r["first"]:
            handoffs += [(trip - turn) / 2 for trip, turn in zip(r["trips"], turnarounds[r["pair"]])]
    handoffs = sorted(max(h, 0.0) for h in handoffs)
    dist.broadcast_object_list(seconds_box, src=chain[0], group=group)
    n = len(handoffs)
    quantiles = tuple(handoffs[min(n - 1, round(k * (n - 1) / QUANTILES))] for k in range(QUANTILES + 1))
    return MessageCosts(
        send_overhead=statistics.median(sends),
        recv_overhead=statistics.median(recvs_post) + statistics.median(waits),
        handoff_mean=statistics.fmean(handoffs),
        handoff_quantiles=quantiles,
        nbytes=int(buf.numel() * buf.element_size()),
        think=think,
        samples=n,
        seconds=seconds_box[0],
    )
