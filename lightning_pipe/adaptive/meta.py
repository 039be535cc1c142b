"""Meta-learning across environments (AutoPipe-RL §4.2: "to summarize the generic knowledge from
various environments, we apply meta-learning"), then the online adaptation it prepares for.

The paper names meta-learning (citing Vanschoren's survey) and, in §4.3, adapts the meta-network and
the RL model online by transfer learning: a few gradient steps on the running job. It does not pin
an algorithm. We use **Reptile** (Nichol, Achiam, Schulman, 2018): it learns the initialisation from
which exactly such a few-step adaptation fits a new environment; it is first order (no second
derivatives through the LSTM, cheap on a CPU) and needs no split of an environment's samples into
support and query sets. First-order MAML would serve as well; Reptile's update is the simpler one.

    inner (= the online adaptation, `adapt`): k Adam steps on one environment's samples, from theta
    outer: theta <- theta + epsilon * (theta_k - theta), epsilon annealed linearly to 0
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def sample(task: Batch, size: int, generator: torch.Generator) -> Batch:
    """A random batch of `size` samples (all of them when fewer) from a task's tensors."""
    n = len(task[-1])
    idx = torch.randperm(n, generator=generator)[:size]
    return tuple(t[idx] for t in task)


def adapt(model: nn.Module, loss_fn: LossFn, task: Batch, steps: int, lr: float, batch: int, generator: torch.Generator) -> None:
    """k gradient steps on one environment's samples, in place (a fresh optimizer: no state carried
    from elsewhere; beta1 = 0 as in Reptile, so every step reads only its own batch)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.0, 0.999))
    model.train()
    for _ in range(steps):
        loss = loss_fn(model, sample(task, batch, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def reptile_step(model: nn.Module, loss_fn: LossFn, task: Batch, steps: int, lr: float, batch: int, epsilon: float, generator) -> None:
    """One outer update: adapt a copy to `task`, then move `model` epsilon of the way to it."""
    adapted = copy.deepcopy(model)
    adapt(adapted, loss_fn, task, steps, lr, batch, generator)
    with torch.no_grad():
        for p, q in zip(model.parameters(), adapted.parameters()):
            p.add_(epsilon * (q - p))


def reptile(
    model: nn.Module,
    tasks: Sequence[Batch],
    loss_fn: LossFn,
    meta_steps: int,
    inner_steps: int = 5,
    inner_lr: float = 1e-3,
    batch: int = 32,
    epsilon: float = 0.5,
    seed: int = 0,
) -> nn.Module:
    """Reptile over `tasks` (one per training environment), in place; returns `model`."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(meta_steps):
        task = tasks[int(torch.randint(len(tasks), (1,), generator=generator))]
        reptile_step(model, loss_fn, task, inner_steps, inner_lr, batch, epsilon * (1 - step / meta_steps), generator)
    return model.eval()
