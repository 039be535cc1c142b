"""A stage's backward in two halves, as zero-bubble schedules run it (Qi et al., ICLR 2024).

BI computes the gradient with respect to the stage's input, what the previous stage waits for;
W later computes the weight gradients, accumulating them into ``.grad`` as a whole backward would.
A node of the autograd graph computes only the outputs the engine needs, so the cut is made in the
nodes that feed both sides (a linear layer's addmm: input gradient and weight gradient):

- the *input side* is every node from which the stage's input is reachable (walking
  ``next_functions``); a *cut node* is one of them with an edge off that side (to a weight, a
  bias, a weight-only subgraph);
- BI runs `torch.autograd.grad` for the input only (``retain_graph``): each node computes its
  input-side outputs, none of the weight matmuls; a pre-hook keeps the gradient arriving at each
  cut node;
- W runs each cut node again from that gradient with `torch.autograd.backward(..., inputs=its
  weights)`: now only the weight-side outputs are needed, then the weight-only subgraph.

Cut nodes whose weights overlap (a weight used twice in the stage) are run in one call, each
pinned to the gradient BI saw (a pre-hook replaces what reaches it again in W), so nothing counts
twice; other calls touch disjoint weights. An output that does not depend on the input (the first
stage: its input is data) is all W's. The input side's saved tensors live until W has run: a
deferred W holds its activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(eq=False)  # by identity: groups are merged by the leaves they own
class Group:
    """One W call: where to start (cut nodes with the gradients BI saw, or whole outputs) and the
    weight leaves it accumulates into."""

    starts: list[tuple[Any, tuple]] = field(default_factory=list)  # (cut node, its gradients) or (edge, (gradient,))
    leaves: dict[Any, None] = field(default_factory=dict)  # AccumulateGrad nodes, in discovery order


@dataclass
class Deferred:
    """What a micro-batch's W needs."""

    groups: list[Group]


def _children(node: Any) -> list[Any]:
    return [child for child, _ in node.next_functions if child is not None]


def _input_side(roots: Sequence[Any], targets: set) -> dict[Any, None]:
    """The nodes reachable from `roots` from which a node of `targets` is reachable, in a fixed
    order (iterative post-order over the DAG: a stage may be deeper than Python's recursion limit)."""
    reaches: dict[Any, bool] = {}
    stack = [(node, False) for node in roots]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            reaches[node] = node in targets or any(reaches.get(child, False) for child in _children(node))
            continue
        if node in reaches:
            continue
        reaches[node] = False  # a DAG: no path comes back to a node being expanded
        stack.append((node, True))
        stack += [(child, False) for child in _children(node) if child not in reaches]
    return {node: None for node, hit in reaches.items() if hit}


def _leaves(starts: Sequence[Any], side: dict) -> dict[Any, None]:
    """The weight leaves (AccumulateGrad nodes) below `starts`, not passing through `side`."""
    seen: set = set()
    found: dict[Any, None] = {}
    stack = [node for node in starts if node not in side]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad: a leaf tensor's accumulator
            found[node] = None
        stack += [child for child in _children(node) if child not in side and child not in seen]
    return found


def _grouped(starts: list[tuple[Any, tuple, dict]]) -> list[Group]:
    """Merge the starts whose weight leaves overlap (union by shared leaf), in order."""
    groups: list[Group] = []
    owner: dict[Any, Group] = {}
    for start, grads, leaves in starts:
        hit = list(dict.fromkeys(owner[leaf] for leaf in leaves if leaf in owner))
        group = hit[0] if hit else Group()
        if not hit:
            groups.append(group)
        for other in hit[1:]:  # merge
            group.starts += other.starts
            group.leaves.update(other.leaves)
            groups.remove(other)
        group.starts.append((start, grads))
        group.leaves.update(leaves)
        for leaf in group.leaves:
            owner[leaf] = group
    return groups


def backward_input(outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor]) -> tuple[list[Tensor], Deferred]:
    """BI: the gradients of `inputs` (zeros where none flows) given the outputs' gradients (None for
    a scalar loss), and what W needs to compute the rest."""
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(outputs, grads)]
    roots = [get_gradient_edge(t) for t in outputs]
    side = _input_side([e.node for e in roots], {get_gradient_edge(t).node for t in inputs})
    cut = [node for node in side if any(child not in side for child in _children(node))]
    seen: dict[Any, tuple] = {}
    hooks = [node.register_prehook(lambda g, node=node: seen.__setitem__(node, g)) for node in cut]
    near = [(t, g) for t, e, g in zip(outputs, roots, grads) if e.node in side]
    try:
        found = (
            torch.autograd.grad([t for t, _ in near], list(inputs), [g for _, g in near], retain_graph=True, allow_unused=True)
            if near
            else ()
        )
    finally:
        for hook in hooks:
            hook.remove()
    starts = [(node, seen[node], _leaves(_children(node), side)) for node in cut if node in seen]
    starts += [(e, (g,), _leaves([e.node], side)) for e, g in zip(roots, grads) if e.node not in side]
    input_grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, found or [None] * len(inputs))]
    return input_grads, Deferred(_grouped(starts))


def backward_weight(deferred: Deferred) -> None:
    """W: the weight gradients, accumulated into ``.grad`` (each weight leaf by one call)."""
    for group in deferred.groups:
        edges, grads, pinned = [], [], []
        for start, given in group.starts:
            if isinstance(start, GradientEdge):  # a whole output
                edges.append(start)
                grads.append(given[0])
                continue
            edges += [GradientEdge(start, k) for k, g in enumerate(given) if g is not None]
            grads += [g for g in given if g is not None]
            if len(group.starts) > 1:  # another start may reach it again: its gradient is BI's
                pinned.append(start.register_prehook(lambda _, given=given: given))
        try:
            if edges and group.leaves:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=[leaf.variable for leaf in group.leaves])
        finally:
            for hook in pinned:
                hook.remove()
