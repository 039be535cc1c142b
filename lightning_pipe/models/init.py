"""Initial weights block by block, so a rank can create only the blocks it holds.

A model built on the meta device (`trainer.init_module(empty_init=True)`, or under
`torch.device("meta")`) has shapes but no values. The strategy then allocates and initialises only
its stage's blocks (`materialize`). For every rank to end up with the weights a one-process run
starts from, a block's initial values depend only on (the model's seed, the block's index), never on
which blocks were created before it: block i is initialised under the torch generator seeded with
`block_seed(seed, i)`, on the CPU (the same numbers whatever device the block is created on or
trains on), and the caller's random state is left as it was.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy
from typing import Callable, Iterator, Optional

import torch
from torch import nn

InitBlock = Callable[[int, nn.Module], None]  # (block index, block): give the block its initial values


def block_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**63 - 1)


@contextlib.contextmanager
def seeded(seed: int, index: int) -> Iterator[None]:
    """Block `index`'s random numbers from the global CPU generator (for a module's own
    reset_parameters()), which is left as it was; no other device's generator is touched."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(block_seed(seed, index))
        yield


def block_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator of block `index`'s own."""
    return torch.Generator().manual_seed(block_seed(seed, index))


def draw_seed() -> int:
    """A model seed from the global CPU generator (so seed_everything fixes it), on the CPU even
    under a `torch.device("meta")` context."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def reset_block(block: nn.Module) -> None:
    """The default initialisation: `reset_parameters()` of every sub-module that defines it (as
    torch's layers do), in module order."""
    for module in block.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize(
    blocks: dict[int, nn.Module], init: InitBlock, device: Optional[torch.device] = None, within: Optional[nn.Module] = None
) -> None:
    """Give the meta tensors of `blocks` (index -> block) storage on `device` (default CPU) and
    initial values from `init`. A tensor reached from several blocks (a tied embedding) gets one
    storage, so it stays shared; `within` (the whole model): the blocks not created are pointed at
    it too, so a tie between a created block and another one is still one object. (`to_empty`
    cannot be used: it makes a new parameter per module holding it, which unties tied weights.)"""
    device = torch.device("cpu") if device is None else device
    made: dict[int, torch.Tensor] = {}
    for block in blocks.values():
        for _table, t in _tensor_slots(block):
            if t.is_meta and id(t) not in made:
                empty = torch.empty_like(t, device=device)
                made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    for module in [*blocks.values(), *([within] if within is not None else [])]:
        for table, t in _tensor_slots(module):
            if id(t) in made:
                table[next(k for k, v in table.items() if v is t)] = made[id(t)]
    with torch.no_grad():
        for index, block in sorted(blocks.items()):
            init(index, block)


def _tensor_slots(root: nn.Module) -> list[tuple[dict, torch.Tensor]]:
    """(the dict holding it, tensor) for every parameter and buffer slot of every sub-module."""
    return [(table, t) for m in root.modules() for table in (m._parameters, m._buffers) for t in list(table.values()) if t is not None]


class Transient(nn.Module):
    """A meta block that runs by creating a throw-away copy with values for each call (profiling a
    meta-built model: the blocks before a rank's share only make its input). It holds no
    parameters of its own, so moving it between devices costs nothing."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self._meta = [block]  # a list: not a registered sub-module

    def forward(self, *args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        device = next((t.device for t in _tensors(x)), torch.device("cpu"))
        return stand_in(self._meta[0], device)(*args, **kwargs)


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)


def stand_in(block: nn.Module, device: Optional[torch.device] = None) -> nn.Module:
    """A copy of a meta block with storage and default values (for timing, not for training)."""
    copy = deepcopy(block)
    materialize({0: copy}, lambda _i, b: _typical_values(b), device)
    return copy


def _typical_values(block: nn.Module) -> None:
    """Every tensor given a value first (small normal floats, zero integers), then the layers' own
    `reset_parameters`: a tensor no layer of the block resets (a head's tied embedding weight) would
    keep whatever the fresh memory held, and denormal or NaN garbage made its matmul ~40x slower
    on a CPU: the profile then charged a GPT head 20 ms instead of 1 and the plan left it alone."""
    for t in [*block.parameters(), *block.buffers()]:
        if t.is_floating_point():
            t.normal_(0.0, 0.02)
        else:
            t.zero_()
    reset_block(block)


def profiling_blocks(blocks: list[nn.Module], measured: range) -> list[nn.Module]:
    """The blocks to profile a meta-built model with: copies with values for the `measured` ones
    (one rank's share), a `Transient` for each other block."""
    return [stand_in(b) if i in measured else Transient(b) for i, b in enumerate(blocks)]
