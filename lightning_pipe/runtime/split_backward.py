"""A stage's backward in two halves, as zero-bubble schedules run it (Qi et al., ICLR 2024).

BI computes the gradient with respect to the stage's input, what the previous stage waits for;
W later computes the weight gradients, accumulating them into ``.grad`` as a whole backward would.
W must not redo BI's work, so the autograd graph is cut where the two meet:

- the *input side* is every node from which the stage's input is reachable (walking
  ``next_functions``); BI runs exactly those, with `torch.autograd.grad` and ``retain_graph``;
- every edge from an input-side node to a node off it (a matmul's edge to its weight, a bias'
  accumulator, a weight-only subgraph) is a `GradientEdge` asked for as an extra input of that same
  call, so the engine hands back the gradient arriving there without running past it;
- W runs `torch.autograd.backward` from those edges with those gradients (plus any output that does
  not depend on the input at all, e.g. everything on the first stage, whose input is data).

Every node runs once, in BI or in W, so the two cost one backward between them. The input side's
saved tensors live until W has run (the graph is retained): a deferred W holds its activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class Deferred:
    """What a micro-batch's W needs: where to start in the graph and the gradients arriving there."""

    edges: list[GradientEdge]
    grads: list[Tensor]


def _input_side(roots: Sequence[Any], targets: set) -> set:
    """The nodes reachable from `roots` from which a node of `targets` is reachable (iterative
    post-order over the DAG: stages may be deep enough to exceed Python's recursion limit)."""
    reaches: dict[Any, bool] = {}
    stack = [(node, False) for node in roots]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            reaches[node] = node in targets or any(reaches.get(child, False) for child, _ in node.next_functions if child is not None)
            continue
        if node in reaches:
            continue
        reaches[node] = False  # a DAG: no path comes back to a node being expanded
        stack.append((node, True))
        stack += [(child, False) for child, _ in node.next_functions if child is not None and child not in reaches]
    return {node for node, hit in reaches.items() if hit}


def backward_input(outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor]) -> tuple[list[Tensor], Deferred]:
    """BI: the gradients of `inputs` (zeros where none flows) given the outputs' gradients (None for
    a scalar loss), and what W needs to compute the rest."""
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(outputs, grads)]
    roots = [get_gradient_edge(t) for t in outputs]
    side = _input_side([e.node for e in roots], {get_gradient_edge(t).node for t in inputs})
    near = [(t, g) for t, e, g in zip(outputs, roots, grads) if e.node in side]
    deferred = Deferred([e for e, t in zip(roots, outputs) if e.node not in side], [g for e, g in zip(roots, grads) if e.node not in side])
    frontier = list(
        dict.fromkeys((child, nr) for node in side for child, nr in node.next_functions if child is not None and child not in side)
    )
    if not near:
        return [torch.zeros_like(t) for t in inputs], deferred
    edges = [GradientEdge(child, nr) for child, nr in frontier]
    found = torch.autograd.grad([t for t, _ in near], list(inputs) + edges, [g for _, g in near], retain_graph=True, allow_unused=True)
    for edge, g in zip(edges, found[len(inputs) :]):
        if g is not None:
            deferred.edges.append(edge)
            deferred.grads.append(g)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, found[: len(inputs)])], deferred


def backward_weight(deferred: Deferred) -> None:
    """W: the rest of the backward, accumulating every weight gradient into ``.grad``; frees the graph."""
    if deferred.edges:
        torch.autograd.backward(deferred.edges, deferred.grads)
