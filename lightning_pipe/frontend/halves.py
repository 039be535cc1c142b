"""Sub-layer cuts of a traced model's blocks (AutoPipe's attention half / MLP half), where the block allows.

A block's forward keeps local values across its sub-layers (the residual), so it cannot be cut at a
sub-module boundary the way the model is cut at its blocks. It can be when the code after the cut
reads only what a stand-in can give back: the first half (`HalfA`) runs the block until its child
`c` is called and passes on c's input `x`; the second half (`HalfB`) runs the block's forward again
with its hidden input zero, the child called just before `c` (the attention) answering `x` and
earlier children zeros (a block with weights of its own, outside its children, is not cut). In
a pre-norm block (``h = attn(ln_1(r)) + r; r = h; h = r + mlp(ln_2(h))``) c's input is then exactly
``x + 0 = x``, and so is the residual the rest of the block reads.

Whether that holds is not assumed from the block's type: the trace runs both halves on block 0's
recorded call and keeps the cut only if they give the block's own output bit for bit, trying each
child in call order (a post-norm BERT layer cuts at `intermediate`, GPT-2 and Llama before their
second norm; a block whose later code reads its input again does not verify and stays whole). Among
the cuts that verify, the one splitting the block's parameters most evenly is taken.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..models.init import stand_in
from .pipeline import FrontBlock, Frontend, _Reached, encode, original_forward
from .structure import Structure


@dataclass
class Cut:
    """Where every block is cut: before its child `child`; `before` its children called earlier, the
    last of them (`answer`) answering c's input in the leaf `answer_leaf` of its output."""

    child: str
    before: tuple[str, ...]
    answer: str
    answer_out: Structure
    answer_leaf: int  # the index among the answer's tensor leaves
    zeros: dict[str, Structure]  # the other earlier children's outputs (each a single tensor shaped as x)
    x_slot: int  # which tensor leaf of c's call is x


class _ChildForward:
    """The `forward` of a block's child while the block may be run in halves (see Frontend modes)."""

    def __init__(self, frontend: Frontend, name: str, child: nn.Module):
        self.frontend, self.name, self.child = frontend, name, child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        halves: Optional[Halves] = getattr(self.frontend, "halves", None)
        if halves is None or halves.mode is None:
            return original_forward(self.child, args, kwargs)
        return halves.child_called(self.name, self.child, args, kwargs)


class Halves:
    """The cut of one model's blocks and the state of a half being run (per process, shared)."""

    def __init__(self, frontend: Frontend, cut: Cut):
        self.frontend, self.cut = frontend, cut
        self.mode: Optional[str] = None  # "a": stop at the cut; "b": earlier children answer
        self.x: Optional[Tensor] = None

    def __deepcopy__(self, memo: dict) -> "Halves":
        return self

    @contextlib.contextmanager
    def running(self, mode: str, x: Optional[Tensor] = None) -> Iterator[None]:
        before = (self.mode, self.x)
        self.mode, self.x = mode, x
        try:
            yield
        finally:
            self.mode, self.x = before

    def child_called(self, name: str, child: nn.Module, args: tuple, kwargs: dict) -> Any:
        cut = self.cut
        if self.mode == "a" and name == cut.child:
            raise _Reached_((args, kwargs))
        if self.mode == "b" and name in cut.before:
            assert self.x is not None
            if name == cut.answer:  # its other tensors (attention weights) a zero: the cut verified they are not read
                tensors = [self.x.new_zeros(()) for _ in cut.answer_out.tensor_slots]
                tensors[cut.answer_leaf] = self.x
                return cut.answer_out.build(tuple(tensors))
            return cut.zeros[name].build((torch.zeros_like(self.x),))
        return original_forward(child, args, kwargs)

    # ---- the halves' work ------------------------------------------------------------------------
    def run_a(self, block: nn.Module, carry: Any) -> tuple[Tensor, ...]:
        fe = self.frontend
        assert fe.block_call is not None
        call = fe.block_call.build(carry)
        with self.running("a"):
            try:
                original_forward(block, *call)
            except _Reached_ as reached:
                leaves = [t for t in pytree.tree_leaves(reached.call) if isinstance(t, Tensor)]
                return (leaves[self.cut.x_slot], *side_tensors(fe, carry))
        raise RuntimeError(f"block {type(block).__name__} returned without calling its {self.cut.child}")

    def run_b(self, index: int, block: nn.Module, carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        fe = self.frontend
        assert fe.block_call is not None and fe.output is not None
        x, side = carry[0], carry[1:]
        call = rebuilt_call(fe, side, x)
        # the block holds no tensors of its own (find_cut): before the cut only its stubbed children read any
        with self.running("b", x):
            out = original_forward(block, *call)
        return fe.next_from(index, call, out)


class _Reached_(_Reached):
    """Stops a block's forward at its cut (the first half's end), apart from the model-level stop."""


def side_tensors(fe: Frontend, carry: Any) -> list[Tensor]:
    """The tensors of a block call passed along unchanged from block to block (masks, rotary tables)."""
    assert fe.block_call is not None
    tensors = carry if isinstance(carry, tuple) else (carry,)
    return [t for slot, t in zip(fe.block_call.tensor_slots, tensors) if fe.links[slot][0] == "same"]


def rebuilt_call(fe: Frontend, side: tuple[Tensor, ...], x: Tensor) -> Any:
    """A block call with the passed-along tensors `side` and zeros (shaped as x) for its hidden input."""
    assert fe.block_call is not None
    it = iter(side)
    tensors = [next(it) if fe.links[slot][0] == "same" else torch.zeros_like(x) for slot in fe.block_call.tensor_slots]
    return fe.block_call.build(tuple(tensors))


class HalfA(FrontBlock):
    def __init__(self, frontend: Frontend, index: int, path: str, block: nn.Module, children: list[str]):
        super().__init__(frontend, {encode(f"{path}.{c}"): block.get_submodule(c) for c in children})
        self.index, self.path = index, path
        self._block = [block]  # the block itself is not registered here: its halves own its children

    def forward(self, carry: Any) -> tuple[Tensor, ...]:
        return self.frontend.halves.run_a(self._block[0], carry)


class HalfB(FrontBlock):
    def __init__(self, frontend: Frontend, index: int, path: str, block: nn.Module, children: list[str]):
        super().__init__(frontend, {encode(f"{path}.{c}"): block.get_submodule(c) for c in children})
        self.index, self.path = index, path
        self._block = [block]

    def forward(self, carry: Any) -> tuple[Tensor, ...]:
        return self.frontend.halves.run_b(self.index, self._block[0], carry)


# ---- finding the cut -------------------------------------------------------------------------------
def find_cut(fe: Frontend, block: nn.Module, call: Any, output: Any, children: list[tuple[str, Any, Any]]) -> Optional[Cut]:
    """The cut of `block` (block 0, with its recorded call, output and direct children's calls in
    order: (name, (args, kwargs), output)) that verifies, the most even by parameters; None if none."""
    if list(block.parameters(recurse=False)) or list(block.buffers(recurse=False)):
        return None  # weights of the block's own: which half holds them is not a child's boundary
    names = [name for name, _, _ in children]
    if len(set(names)) != len(names):
        return None  # a child called twice
    sizes = {name: sum(p.numel() for p in block.get_submodule(name).parameters()) for name in names}
    total = sum(sizes.values()) or 1
    found: list[tuple[float, Cut]] = []
    side = {id(t) for t in side_tensors(fe, fe.block_call.flat(call))} if fe.block_call is not None else set()
    for k in range(1, len(children)):
        cut = _candidate(children, k, side)
        if cut is None:
            continue
        if _verifies(fe, block, call, output, cut):
            share = sum(sizes[n] for n in names[:k]) / total
            found.append((abs(share - 0.5), cut))
    return min(found, key=lambda item: item[0])[1] if found else None


def _candidate(children: list[tuple[str, Any, Any]], k: int, side: set[int]) -> Optional[Cut]:
    name, c_call, _ = children[k]
    tensors = [t for t in pytree.tree_leaves(c_call) if isinstance(t, Tensor)]
    own = [i for i, t in enumerate(tensors) if id(t) not in side]
    if len(own) != 1:
        return None
    x = tensors[own[0]]
    answer, _, answer_output = children[k - 1]
    try:
        answer_out = Structure.of(answer_output, "a block's sub-layer")
    except ValueError:
        return None
    leaves = [t for t in pytree.tree_leaves(answer_output) if isinstance(t, Tensor)]
    same = [i for i, t in enumerate(leaves) if t.shape == x.shape and t.dtype == x.dtype]
    if not same:
        return None
    zeros = {}
    for other, _, out in children[: k - 1]:
        if not (isinstance(out, Tensor) and out.shape == x.shape and out.dtype == x.dtype):
            return None
        zeros[other] = Structure.of(out, "a block's sub-layer")
    before = tuple(n for n, _, _ in children[:k])
    return Cut(name, before, answer, answer_out, same[0], zeros, own[0])


def _verifies(fe: Frontend, block: nn.Module, call: Any, output: Any, cut: Cut) -> bool:
    """Both halves on the recorded call give the block's recorded output, bit for bit. A block created
    empty (meta) is checked on a copy with values and a random hidden input: the trace's zeros would
    let a wrong cut through."""
    if any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
        block = stand_in(block).eval()
        call = _random_hidden(fe, call)
        with torch.no_grad():
            output = original_forward(block, *call)
    halves = Halves(fe, cut)
    saved = getattr(fe, "halves", None)
    fe.halves = halves
    patched = _patch_children(fe, block, cut)
    modes = {m: m.training for m in block.modules()}
    block.eval()  # dropout off (and no random numbers drawn): the two runs must be comparable bit for bit
    try:
        with torch.no_grad():
            carry = fe.block_call.flat(call)
            middle = halves.run_a(block, carry)
            x, side = middle[0], middle[1:]
            with halves.running("b", x):
                again = original_forward(block, *rebuilt_call(fe, side, x))
    except Exception:  # noqa: BLE001 - any failure means this cut does not hold
        return False
    finally:
        for m, mode in modes.items():
            m.training = mode
        fe.halves = saved
        for child in patched:
            child.__dict__.pop("forward", None)
    want, got = pytree.tree_leaves(output), pytree.tree_leaves(again)
    return len(want) == len(got) and all(
        (torch.equal(a, b) if isinstance(a, Tensor) and isinstance(b, Tensor) else a == b) for a, b in zip(want, got)
    )


def _random_hidden(fe: Frontend, call: Any) -> Any:
    """`call` with normal random values in its hidden input (what a block passes to the next)."""
    assert fe.block_call is not None
    carry = fe.block_call.flat(call)
    slots = fe.block_call.tensor_slots
    made = tuple(torch.randn_like(t) if fe.links[s][0] == "out" and t.is_floating_point() else t for s, t in zip(slots, carry))
    return fe.block_call.build(made)


def _patch_children(fe: Frontend, block: nn.Module, cut: Cut) -> list[nn.Module]:
    children = [block.get_submodule(n) for n in (*cut.before, cut.child)]
    for name, child in zip((*cut.before, cut.child), children):
        child.forward = _ChildForward(fe, name, child)
    return children


def split_blocks(fe: Frontend, blocks: list[nn.Module], cut: Cut) -> None:
    """Make every block run in halves at `cut` (the blocks' children's forwards dispatched)."""
    fe.halves = Halves(fe, cut)
    for block in blocks:
        _patch_children(fe, block, cut)


def unsplit_blocks(blocks: list[nn.Module], cut: Cut) -> None:
    for block in blocks:
        for name in (*cut.before, cut.child):
            block.get_submodule(name).__dict__.pop("forward", None)
