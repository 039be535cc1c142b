"""AutoPipe's heuristic search bound (ours: the paper sets none): a PipelineConfig setting that
reaches the search, refused when bad, and said (one line under the plan's table) when it stops a
search that had splits left."""

from __future__ import annotations

import logging

import pytest

from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.planning import transformer_costs
from lightning_pipe.planning.entry import plan_run
from lightning_pipe.planning.heuristic import MAX_EXPANSIONS_PER_STAGE, autopipe_search, expansion_bound
from lightning_pipe.planning.replay import Evaluator
from lightning_pipe.simulation import CostModel

LOGGER = "lightning_pipe.planning.heuristic"
# 15 blocks on 6 stages, 16 micro-batches: a bound of 1 split per stage (6) stops the heuristic with
# splits left (12 splits simulated); 50 per stage lets it run out of splits (35 simulated)
FORWARD = (7, 3, 3, 1, 6, 2, 1, 2, 2, 9, 8, 4, 7, 8, 8)
RATIO = (2, 1.5, 3, 1.5, 3, 3, 2, 1.5, 1.5, 2, 3, 1.5, 3, 1.5, 1.5)
COSTS = CostModel(tuple(map(float, FORWARD)), tuple(f * r for f, r in zip(FORWARD, RATIO)))


def hits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "hit its bound" in r.getMessage()]


def test_the_bound_stops_the_search_and_says_so(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    simulated = {}
    for per_stage in (1, 50):
        caplog.clear()
        ev = Evaluator(COSTS, "1f1b", 6, 16)
        with expansion_bound(per_stage):
            autopipe_search(ev, 6)
        simulated[per_stage] = len(ev._time)  # every split the search simulated
        if per_stage == 1:
            (message,) = hits(caplog)
            assert "6 splits processed (at most 6: autopipe_expansions x 6 stages) with splits still to process" in message
        else:
            assert hits(caplog) == []  # it ran out of splits first
    assert simulated[1] < simulated[50]  # the bound is what stopped the smaller search


def test_the_run_setting_reaches_the_planner(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stopped = plan_run(COSTS, 6, PipelineConfig(microbatches=16, partition="autopipe", autopipe_expansions=1))
    assert len(hits(caplog)) == 1
    # said once, as the last line of the plan's table, with the setting that raises the bound
    assert stopped.plan.table().splitlines()[-1] == hits(caplog)[0]
    assert "Raise autopipe_expansions (pipeline.autopipe_expansions=...)" in stopped.plan.table()
    caplog.clear()
    finished = plan_run(COSTS, 6, PipelineConfig(microbatches=16, partition="autopipe", autopipe_expansions=50))
    assert hits(caplog) == [] and "hit its bound" not in finished.plan.table()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_bounds_name_the_setting(bad):
    with pytest.raises(SettingError, match=r"autopipe_expansions=.*an integer >= 1") as err:
        PipelineConfig(autopipe_expansions=bad)
    assert err.value.setting == "autopipe_expansions"
    with pytest.raises(ValueError, match="an integer >= 1"):
        with expansion_bound(bad):
            pass


@pytest.mark.parametrize("model,stages", [("gpt2-345m", 4), ("gpt2-1.3b", 8)])
def test_the_default_bound_lets_the_papers_search_finish_where_it_can(caplog, model, stages):
    # the default is the paper's whole search on these (the earlier 2 per stage stopped both short)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    costs, _ = transformer_costs(model, stages)
    ev = Evaluator(costs, "1f1b", stages, 4 * stages)
    with expansion_bound(MAX_EXPANSIONS_PER_STAGE):
        default = autopipe_search(ev, stages)
    assert not hits(caplog)  # it ran out of splits, the bound did not stop it
    assert ev.time(default) == ev.time(autopipe_search(Evaluator(costs, "1f1b", stages, 4 * stages), stages, 10**9))
    with expansion_bound(2):
        autopipe_search(Evaluator(costs, "1f1b", stages, 4 * stages), stages)
    assert hits(caplog)  # where a smaller bound would have stopped it
    assert PipelineConfig().autopipe_expansions == MAX_EXPANSIONS_PER_STAGE
