"""A text form of schedules: one header line, then one line per pipeline rank, one token per action.

```
schedule name=1f1b microbatches=2 chunk_rank=0,1 backward=true
0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 R0
1: RF1.0<0 F1.0 B1.0 SB1.0>0 RF1.1<0 F1.1 B1.1 SB1.1>0 R1
```

The header carries every field of `PipelineSchedule` besides the lists: ``name`` (written as a
JSON string when it is not a plain word), ``microbatches``, ``chunk_rank`` (chunk c -> rank, comma
separated), ``backward`` (false for forward-only schedules) and, when not 1, ``weight_versions``. Each rank line starts with the
rank, ``<rank>:``, ranks 0, 1, ... in order. A token is ``<op><chunk>[.<microbatch>][<sigil><peer>]``:

    F<c>.<mb>          forward of chunk c on micro-batch mb
    B<c>.<mb>          backward (input and weight gradients)
    BI<c>.<mb>         the input gradient only (zero-bubble's B)            (Op.BACKWARD_INPUT)
    W<c>.<mb>          the weight gradients, after BI                     (Op.BACKWARD_WEIGHT)
    SF<c>.<mb>><peer>  send the activation chunk c produced to peer        (Op.SEND_ACT)
    RF<c>.<mb><<peer>  receive the activation chunk c consumes from peer  (Op.RECV_ACT)
    SB<c>.<mb>><peer>  send the input gradient of chunk c to peer         (Op.SEND_GRAD)
    RB<c>.<mb><<peer>  receive the output gradient chunk c needs          (Op.RECV_GRAD)
    R<c>[.<mb>]        chunk c's gradients are final: reduce them         (Op.REDUCE_GRAD)
                       (with .<mb>: those of the batch ending at mb, as 2BW does per batch)

A field the action leaves as None is left out of its token (the peer of a compute is written
``@<peer>`` in the odd case that it is set), so the text mirrors the data exactly and
``load(dump(s)) == s`` holds for any schedule. `load` checks syntax only and names the line and
token of a mistake; whether the lists make sense is `validate`'s business, as for any schedule.
Blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from .actions import Action, Op, PipelineSchedule

_PREFIX = {
    Op.FORWARD: "F",
    Op.BACKWARD: "B",
    Op.BACKWARD_INPUT: "BI",
    Op.BACKWARD_WEIGHT: "W",
    Op.SEND_ACT: "SF",
    Op.RECV_ACT: "RF",
    Op.SEND_GRAD: "SB",
    Op.RECV_GRAD: "RB",
    Op.REDUCE_GRAD: "R",
}
_OPS = {prefix: op for op, prefix in _PREFIX.items()}
_HEADER = "schedule"
_FIELDS = ("name", "microbatches", "chunk_rank", "backward")
_OPTIONAL = ("weight_versions",)
_INT = r"-?[0-9]+"
_TOKEN = re.compile(rf"(SF|RF|SB|RB|BI|F|B|W|R)({_INT})(?:\.({_INT}))?(?:([<>@])({_INT}))?")
_PAIR = re.compile(r'([A-Za-z_]+)=("(?:[^"\\]|\\.)*"|\S*)')
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.+:/-]+")


def _sigil(op: Op) -> str:
    return ">" if op.is_send else "<" if op.is_recv else "@"


def _integer(value: object, what: str) -> int:
    if not isinstance(value, int):
        raise TypeError(f"{what} is {value!r}: the text form holds integers only")
    return int(value)


def token(action: Action) -> str:
    """One action as text, e.g. ``SF0.3>1``."""
    text = f"{_PREFIX[Op(action.op)]}{_integer(action.chunk, 'chunk')}"
    if action.microbatch is not None:
        text += f".{_integer(action.microbatch, 'micro-batch')}"
    if action.peer is not None:
        text += f"{_sigil(Op(action.op))}{_integer(action.peer, 'peer')}"
    return text


def dump(schedule: PipelineSchedule) -> str:
    """The schedule as text (ends with a newline); `load` reads it back to an equal schedule."""
    name = schedule.name if _PLAIN_NAME.fullmatch(schedule.name) else json.dumps(schedule.name)
    placement = ",".join(str(_integer(r, "a chunk's rank")) for r in schedule.chunk_rank)
    header = (
        f"{_HEADER} name={name} microbatches={_integer(schedule.num_microbatches, 'microbatches')} "
        f"chunk_rank={placement} backward={'true' if schedule.backward else 'false'}"
    )
    if schedule.weight_versions != 1:
        header += f" weight_versions={_integer(schedule.weight_versions, 'weight_versions')}"
    lines = [header]
    for rank, actions in enumerate(schedule.actions):
        try:
            lines.append(" ".join([f"{rank}:", *(token(a) for a in actions)]))
        except TypeError as error:
            raise TypeError(f"rank {rank}: {error}") from None
    return "\n".join(lines) + "\n"


def parse_token(text: str) -> Action:
    """One token back to its action; ValueError saying what is wrong with it."""
    match = _TOKEN.fullmatch(text)
    if match is None:
        head = re.match(r"[A-Z]*", text).group(0)
        if head not in _OPS:
            raise ValueError(f"unknown op {head or text[:1]!r}; ops: {', '.join(_OPS)}")
        form = (
            f"{head}<chunk>.<micro-batch>{_sigil(_OPS[head])}<peer>"
            if head in ("SF", "RF", "SB", "RB")
            else f"{head}<chunk>.<micro-batch>"
            if head in ("F", "B", "BI", "W")
            else f"{head}<chunk>"
        )
        raise ValueError(f"expected {form}, with integers")
    prefix, chunk, mb, sigil, peer = match.groups()
    op = _OPS[prefix]
    if sigil is not None and sigil != _sigil(op):
        side = (
            "a send names its peer with '>'"
            if op.is_send
            else "a receive names its peer with '<'"
            if op.is_recv
            else f"{prefix} names its peer with '@'"
        )
        raise ValueError(f"{side}, not {sigil!r}")
    return Action(op, int(chunk), None if mb is None else int(mb), None if peer is None else int(peer))


def _header(line: str, number: int) -> dict[str, object]:
    def fail(message: str) -> ValueError:
        return ValueError(f"line {number} (header): {message}")

    if line.split(maxsplit=1)[0] != _HEADER:
        raise fail(f"must start with {_HEADER!r} followed by {' '.join(f + '=...' for f in _FIELDS)}; got {line!r}")
    rest = line[len(_HEADER) :]
    fields: dict[str, str] = {}
    position = 0
    while True:
        while position < len(rest) and rest[position].isspace():
            position += 1
        if position == len(rest):
            break
        match = _PAIR.match(rest, position)
        if match is None or (match.end() < len(rest) and not rest[match.end()].isspace()):
            bad = rest[position:].split(maxsplit=1)[0]
            raise fail(f"token {bad!r} is not key=value")
        key, value = match.groups()
        if key not in _FIELDS + _OPTIONAL:
            raise fail(f"unknown field {key!r}; fields: {', '.join(_FIELDS + _OPTIONAL)}")
        if key in fields:
            raise fail(f"field {key!r} given twice")
        fields[key] = value
        position = match.end()
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        raise fail(f"missing field(s) {', '.join(missing)}")
    out: dict[str, object] = {}
    name = fields["name"]
    if name.startswith('"'):
        try:
            out["name"] = json.loads(name)
        except json.JSONDecodeError as error:
            raise fail(f"name {name!r} is not a valid quoted string: {error.msg}") from None
    elif name:
        out["name"] = name
    else:
        raise fail('name is empty (quote it: name="")')
    try:
        out["microbatches"] = int(fields["microbatches"])
    except ValueError:
        raise fail(f"microbatches={fields['microbatches']!r} is not an integer") from None
    try:
        out["chunk_rank"] = tuple(int(r) for r in fields["chunk_rank"].split(",")) if fields["chunk_rank"] else ()
    except ValueError:
        raise fail(f"chunk_rank={fields['chunk_rank']!r} is not a comma-separated list of ranks") from None
    if fields["backward"] not in ("true", "false"):
        raise fail(f"backward={fields['backward']!r}: must be true or false")
    out["backward"] = fields["backward"] == "true"
    try:
        out["weight_versions"] = int(fields.get("weight_versions", "1"))
    except ValueError:
        raise fail(f"weight_versions={fields['weight_versions']!r} is not an integer") from None
    return out


def load(text: str) -> PipelineSchedule:
    """Read `dump`'s text form; ValueError naming the line (and token) of the first mistake."""
    header: Optional[dict[str, object]] = None
    actions: list[list[Action]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if header is None:
            header = _header(line, number)
            continue
        rank = len(actions)
        label, colon, rest = line.partition(":")
        if not colon or label.strip() != str(rank):
            raise ValueError(f"line {number}: expected the line of rank {rank}, starting '{rank}:'; got {raw.strip()!r}")
        parsed = []
        for index, item in enumerate(rest.split()):
            try:
                parsed.append(parse_token(item))
            except ValueError as error:
                raise ValueError(f"line {number} (rank {rank}), token {item!r} (action {index}): {error}") from None
        actions.append(parsed)
    if header is None:
        raise ValueError(f"no schedule: the text holds no header line ({_HEADER} {' '.join(f + '=...' for f in _FIELDS)})")
    return PipelineSchedule(
        header["name"],
        header["microbatches"],
        header["chunk_rank"],
        actions,
        header["backward"],
        header["weight_versions"],  # type: ignore[arg-type]
    )


__all__ = ["dump", "load", "parse_token", "token"]
