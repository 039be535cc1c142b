"""The text form of schedules: golden files of the builders' lists, round trip, clear parse errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.schedules import Action, Op, PipelineSchedule, ScheduleError, build_schedule, forward_only, validate, wave_placement
from lightning_pipe.schedules.text import dump, load

GOLDEN = Path(__file__).resolve().parent / "golden"


def _regen():
    spec = importlib.util.spec_from_file_location("golden_regen", GOLDEN / "regen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _regen().CASES


# ---- golden files ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_builders_produce_the_golden_lists(case):
    expected = (GOLDEN / f"{case}.txt").read_text()
    assert dump(CASES[case]()) == expected, f"schedule {case} changed: if on purpose, run python tests/golden/regen.py"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_text_loads_to_the_schedule_and_validates(case):
    loaded = load((GOLDEN / f"{case}.txt").read_text())
    assert loaded == CASES[case]()
    validate(loaded)


def test_golden_file_reads_as_documented():
    lines = (GOLDEN / "1f1b-p3-m4.txt").read_text().splitlines()
    assert lines[0] == "schedule name=1f1b microbatches=4 chunk_rank=0,1,2 backward=true"
    # rank 0 of 1F1B on 3 ranks: two warm-up forwards, then one forward, one backward
    assert lines[1].split()[:8] == ["0:", "F0.0", "SF0.0>1", "F0.1", "SF0.1>1", "F0.2", "SF0.2>1", "RB0.0<1"]
    assert lines[1].split()[-1] == "R0"
    assert lines[3].startswith("2: RF2.0<1 F2.0 B2.0 SB2.0>1 ")


def _without(text: str, token: str) -> str:
    assert f" {token}" in text
    return text.replace(f" {token}", "", 1)


def test_hand_broken_golden_text_is_rejected_by_validate():
    text = (GOLDEN / "1f1b-p3-m4.txt").read_text()
    with pytest.raises(ScheduleError, match=r"rank 2, action \d+ RECV_F\(chunk=2, mb=1, from=1\): no matching send on rank 1"):
        validate(load(_without(text, "SF1.1>2")))
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ SEND_F\(chunk=0, mb=3, to=1\): no matching receive on rank 1"):
        validate(load(_without(text, "RF1.3<0")))
    with pytest.raises(ScheduleError, match=r"rank 1: chunk 1 never reduces its gradients"):
        validate(load(_without(text, "R1")))
    # two receives swapped: posted in another order than the peer sends
    swapped = text.replace("RF1.0<0 F1.0 SF1.0>2 RF1.1<0", "RF1.1<0 F1.0 SF1.0>2 RF1.0<0", 1)
    assert swapped != text
    with pytest.raises(
        ScheduleError, match=r"rank 1, action 0 RECV_F\(chunk=1, mb=1, from=0\): rank 0 sends activation of chunk 0 mb 0 first"
    ):
        validate(load(swapped))


def test_hand_written_text_with_comments_and_blank_lines():
    text = """
    # 1F1B on two ranks, two micro-batches
    schedule name=1f1b microbatches=2 chunk_rank=0,1 backward=true

    0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 R0
    1: RF1.0<0 F1.0 B1.0 SB1.0>0 RF1.1<0 F1.1 B1.1 SB1.1>0 R1
    """
    loaded = load(text)
    assert loaded == build_schedule("1f1b", 2, 2)
    assert loaded.actions[0][1] == Action(Op.SEND_ACT, 0, 0, 1)
    assert loaded.actions[1][-1] == Action(Op.REDUCE_GRAD, 1)


# ---- round trip --------------------------------------------------------------------------------
@st.composite
def built(draw) -> PipelineSchedule:
    """Any valid setting of every builder (and forward_only over each multi-chunk placement)."""
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "wave", "forward"]))
    p = draw(st.integers(1, 4))
    if kind == "interleaved":
        return build_schedule(kind, p, p * draw(st.integers(1, 3)), chunks=draw(st.integers(1, 3)))
    m = draw(st.integers(1, 6))
    if kind == "wave":
        return build_schedule(kind, p, m, waves=draw(st.integers(1, 2)))
    if kind == "forward":
        placement = draw(st.sampled_from([None, wave_placement(p, 1), tuple(c % p for c in range(2 * p))]))
        return forward_only(p, m, placement)
    return build_schedule(kind, p, m)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(built())
def test_round_trip_of_built_schedules(schedule):
    text = dump(schedule)
    loaded = load(text)
    assert loaded == schedule
    assert dump(loaded) == text
    assert len(text.splitlines()) == 1 + schedule.num_ranks


small = st.integers(-3, 40)
actions = st.builds(Action, st.sampled_from(list(Op)), small, st.none() | small, st.none() | small)


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.text(max_size=12),
    small,
    st.lists(small, max_size=6).map(tuple),
    st.lists(st.lists(actions, max_size=6), max_size=4),
    st.booleans(),
)
def test_round_trip_of_any_schedule(name, m, placement, lists, backward):
    """The text mirrors the data: even lists that `validate` rejects come back unchanged, so a
    broken schedule can be dumped, read and pointed at."""
    schedule = PipelineSchedule(name, m, placement, lists, backward)
    assert load(dump(schedule)) == schedule


def test_names_that_are_not_plain_words_are_quoted():
    for name in ["", "two words", 'quote"d', "line\nbreak", "back\\slash", "ünïcode", "#hash"]:
        s = PipelineSchedule(name, 1, (0,), [[Action(Op.FORWARD, 0, 0)]], backward=False)
        text = dump(s)
        assert len(text.splitlines()) == 2
        assert load(text).name == name


# ---- malformed text ----------------------------------------------------------------------------
HEAD = "schedule name=x microbatches=2 chunk_rank=0,1 backward=true\n"
MALFORMED = [
    ("", r"no schedule: the text holds no header line"),
    ("# only a comment\n", r"no schedule"),
    ("0: F0.0\n", r"line 1 \(header\): must start with 'schedule'"),
    ("schedule name=x microbatches=2\n", r"line 1 \(header\): missing field\(s\) chunk_rank, backward"),
    ("schedule name=x microbatches=two chunk_rank=0 backward=true\n", r"line 1 \(header\): microbatches='two' is not an integer"),
    ("schedule name=x microbatches=2 chunk_rank=0,,1 backward=true\n", r"line 1 \(header\): chunk_rank='0,,1' is not a comma-separated"),
    ("schedule name=x microbatches=2 chunk_rank=0 backward=yes\n", r"line 1 \(header\): backward='yes': must be true or false"),
    ("schedule name=x microbatches=2 chunk_rank=0 backward=true waves=2\n", r"line 1 \(header\): unknown field 'waves'"),
    ("schedule name=x name=y microbatches=2 chunk_rank=0 backward=true\n", r"line 1 \(header\): field 'name' given twice"),
    ("schedule name=x microbatches=2 chunk_rank=0 backward=true extra\n", r"line 1 \(header\): token 'extra' is not key=value"),
    ('schedule name="x microbatches=2 chunk_rank=0 backward=true\n', r"line 1 \(header\): name '\"x' is not a valid quoted string"),
    ("schedule name= microbatches=2 chunk_rank=0 backward=true\n", r"line 1 \(header\): name is empty"),
    (HEAD + "0: F0.0 X0.1\n", r"line 2 \(rank 0\), token 'X0.1' \(action 1\): unknown op 'X'"),
    (HEAD + "0: F0.0\n1: RF1.0<0 F1.x\n", r"line 3 \(rank 1\), token 'F1.x' \(action 1\): expected F<chunk>.<micro-batch>, with integers"),
    (HEAD + "0: SF0.0<1\n", r"line 2 \(rank 0\), token 'SF0.0<1' \(action 0\): a send names its peer with '>', not '<'"),
    (HEAD + "0: RB0.0>1\n", r"token 'RB0.0>1' \(action 0\): a receive names its peer with '<', not '>'"),
    (HEAD + "0: F0.0>1\n", r"token 'F0.0>1' \(action 0\): F names its peer with '@', not '>'"),
    (HEAD + "0: SF0.0>\n", r"token 'SF0.0>' \(action 0\): expected SF<chunk>.<micro-batch>><peer>"),
    (HEAD + "0: R\n", r"token 'R' \(action 0\): expected R<chunk>"),
    (HEAD + "0: F0.0,F0.1\n", r"token 'F0.0,F0.1' \(action 0\): expected F<chunk>.<micro-batch>"),
    (HEAD + "1: F1.0\n", r"line 2: expected the line of rank 0, starting '0:'; got '1: F1.0'"),
    (HEAD + "0: F0.0\n0: F1.0\n", r"line 3: expected the line of rank 1"),
    (HEAD + "F0.0 F0.1\n", r"line 2: expected the line of rank 0"),
]


@pytest.mark.parametrize("text,message", MALFORMED)
def test_malformed_text_names_line_and_token(text, message):
    with pytest.raises(ValueError, match=message):
        load(text)


def test_dump_names_a_field_that_is_not_an_integer():
    s = PipelineSchedule("x", 1, (0,), [[Action(Op.FORWARD, 0, "0")]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rank 0: micro-batch is '0': the text form holds integers only"):
        dump(s)
