"""The one builder from settings to layers, and the one module of checkpoint keys."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning.checkpoint import keys
from lightning_pipe.lightning.compose import choose_layers
from lightning_pipe.modes.advance.lightning import AdvanceController
from lightning_pipe.modes.avgpipe.lightning import ElasticReplicas
from lightning_pipe.modes.engine import Versions
from lightning_pipe.modes.flush.lightning import FlushLayer
from lightning_pipe.modes.lightning import Layer, PartitionLayer, VersionsLayer
from lightning_pipe.modes.partition.lightning import AdaptivePartition, StaticPartition
from lightning_pipe.modes.two_bw.lightning import DoubleBufferLayer
from lightning_pipe.modes.width.lightning import AllReduce, NoReplicas
from lightning_pipe.schedules import REGISTRY


@pytest.mark.parametrize(
    "settings, versions, replicas, partition, controllers",
    [
        ({}, FlushLayer, NoReplicas, StaticPartition, ()),
        ({"schedule": "2bw"}, DoubleBufferLayer, NoReplicas, StaticPartition, ()),
        ({"width": 2}, FlushLayer, AllReduce, StaticPartition, ()),
        ({"pipelines": 2}, FlushLayer, ElasticReplicas, StaticPartition, ()),
        ({"adaptive": "rule"}, FlushLayer, NoReplicas, AdaptivePartition, ()),
        ({"schedule": "2bw", "adaptive": "rule"}, DoubleBufferLayer, NoReplicas, AdaptivePartition, ()),
        ({"adaptive": "learned"}, FlushLayer, NoReplicas, AdaptivePartition, ()),
        ({"schedule": "advance"}, FlushLayer, NoReplicas, StaticPartition, (AdvanceController,)),
        ({"schedule": "advance", "advance_num": 2}, FlushLayer, NoReplicas, StaticPartition, ()),
        ({"schedule": "advance", "pipelines": 2}, FlushLayer, ElasticReplicas, StaticPartition, (AdvanceController,)),
    ],
)
def test_choose_layers_composes_the_settings(settings, versions, replicas, partition, controllers):
    choice = choose_layers(PipelineConfig(**settings))
    assert (choice.versions, choice.replicas, choice.partition, choice.controllers) == (versions, replicas, partition, controllers)
    assert choice.all == (versions, replicas, partition, *controllers)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_schedule_has_a_weight_versions_layer(name):
    assert issubclass(choose_layers(PipelineConfig(schedule=name)).versions, VersionsLayer)


def test_the_interfaces_are_abstract_where_a_variant_must_say_something():
    with pytest.raises(TypeError):
        VersionsLayer(None, None)  # make_runner is required
    with pytest.raises(TypeError):
        PartitionLayer(None, None, None)  # request is required
    with pytest.raises(TypeError):
        Versions()  # run, executor, drain, state_dict are required
    Layer(None)  # every hook has a default


def test_a_layer_refuses_trainer_settings_before_spawning():
    from lightning_pipe.errors import SettingError

    class Trainer:
        accumulate_grad_batches = 2

    with pytest.raises(SettingError, match="accumulate_grad_batches=2"):
        choose_layers(PipelineConfig(schedule="2bw")).check_trainer(PipelineConfig(schedule="2bw"), Trainer(), None)
    choose_layers(PipelineConfig()).check_trainer(PipelineConfig(), Trainer(), None)  # a flush accumulates fine


QUICK = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])  # a busy CI machine is no failure


@QUICK
@given(st.dictionaries(st.sampled_from(sorted(keys.RUN)), st.integers() | st.text(max_size=5), max_size=len(keys.RUN)))
def test_run_state_round_trips_under_its_checkpoint_keys(state):
    saved = keys.encode_run(state)
    assert all(keys.is_ours(k) for k in saved) and keys.decode_run(saved) == state


@QUICK
@given(st.dictionaries(st.sampled_from(sorted(keys.PARAMETER)), st.integers(), max_size=len(keys.PARAMETER)))
def test_parameter_extras_round_trip_and_stay_apart_from_the_optimizers_state(extras):
    entry = {"exp_avg": 1, **keys.encode_parameter(extras)}
    assert keys.decode_parameter(entry) == extras and [k for k in entry if not keys.is_ours(k)] == ["exp_avg"]


def test_an_unknown_layer_state_is_refused_naming_the_keys_module():
    with pytest.raises(KeyError, match="keys.py"):
        keys.encode_run({"my_new_state": 1})
    assert len(set(keys.RUN.values()) | set(keys.PARAMETER.values())) == len(keys.RUN) + len(keys.PARAMETER)
