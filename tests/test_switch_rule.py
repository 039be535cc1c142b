"""The adaptive rule's decision (ours): the gain threshold and its hysteresis against switching back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.adaptive.policy import SwitchRule

A = ((0, 5), (5, 10))
B = ((0, 6), (6, 10))
C = ((0, 4), (4, 10))
free = lambda bounds: 0.0  # noqa: E731  a switch that costs nothing


def test_the_rule_switches_to_the_best_candidate_that_clears_the_gain():
    rule = SwitchRule(gain=0.05)
    assert rule.choose(1.0, [(0.97, B), (0.99, C)], 100, free) is None, "3% < 5%: stay"
    bounds, gain, seconds = rule.choose(1.0, [(0.90, B), (0.94, C)], 100, free)
    assert (bounds, seconds) == (B, 0.90) and gain == pytest.approx(0.10)
    # the switch's cost counts: 0.1 s per iteration saved over 10 iterations is 1 s, paid by a 2 s switch
    assert rule.choose(1.0, [(0.90, B)], 10, lambda b: 2.0) is None


def test_hysteresis_asks_more_of_a_switch_back_only():
    rule = SwitchRule(gain=0.05, hysteresis=0.05)
    rule.switched(40, A)  # the last switch left A
    assert rule.left == A and rule.last_switch == 40
    assert rule.required(A) == pytest.approx(0.10) and rule.required(B) == pytest.approx(0.05)
    assert rule.choose(1.0, [(0.93, A)], 100, free) is None, "7% does not bring it back to A"
    assert rule.choose(1.0, [(0.89, A)], 100, free)[0] == A, "11% does"
    # a candidate that clears its own (lower) bar wins over the one just left that does not
    assert rule.choose(1.0, [(0.92, A), (0.94, B)], 100, free)[0] == B


def test_without_hysteresis_the_partition_just_left_is_like_any_other():
    rule = SwitchRule(gain=0.05)
    rule.switched(40, A)
    assert rule.choose(1.0, [(0.94, A)], 100, free)[0] == A


def test_the_partition_left_survives_a_checkpoint_and_old_checkpoints_load():
    rule = SwitchRule(hysteresis=0.05)
    rule.switched(12, [[0, 5], [5, 10]])
    restored = SwitchRule(hysteresis=0.05)
    restored.load_state_dict(rule.state_dict())
    assert (restored.left, restored.last_switch) == (A, 12)
    old = {k: v for k, v in rule.state_dict().items() if k != "left"}
    older = SwitchRule()
    older.load_state_dict(old)
    assert older.left is None and older.last_switch == 12


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0.01, 10),
    times=st.lists(st.floats(0.01, 10), min_size=1, max_size=5),
    gain=st.floats(0, 0.5),
    hysteresis=st.floats(0, 0.5),
)
def test_the_choice_always_clears_its_bar_and_saves_the_most(now, times, gain, hysteresis):
    rule = SwitchRule(gain=gain, hysteresis=hysteresis)
    rule.switched(0, A)
    candidates = [A, B, C, ((0, 7), (7, 10)), ((0, 3), (3, 10))][: len(times)]
    scored = list(zip(times, candidates))
    chosen = rule.choose(now, scored, 100, free)
    gains = {b: rule.predicted_gain(now, t, 100, 0.0) for t, b in scored}
    eligible = [b for b in gains if gains[b] >= rule.required(b)]
    if not eligible:
        assert chosen is None
    else:
        assert chosen is not None and chosen[0] in eligible and chosen[1] == max(gains[b] for b in eligible)
