"""One validated PipelineConfig: the same settings from keywords and from Hydra, every bad setting
a SettingError naming its field, the schedule registry's promises, the registered strategy names."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from hypothesis import given, settings
from hypothesis import strategies as st
from models import trainer_kwargs
from omegaconf.errors import ValidationError

import lightning_pipe  # noqa: F401  (registers the strategies)
from lightning_pipe import AutoPipeStrategy, PipelineConfig, ScheduleSpec, SettingError
from lightning_pipe.cli.paths import CONFIG_DIR
from lightning_pipe.cli.train import pipeline_config
from lightning_pipe.lightning.compose import choose_layers
from lightning_pipe.modes.two_bw.lightning import DoubleBufferLayer
from lightning_pipe.schedules import REGISTRY


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_hydra_and_keywords_build_the_same_config():
    cfg = composed("pipeline.schedule=wave", "pipeline.waves=2", "partition=dp", "pipeline.microbatches=8", "pipeline.slicer=false")
    from_hydra = pipeline_config(cfg)
    assert isinstance(from_hydra, PipelineConfig)
    strategy = AutoPipeStrategy(schedule="wave", waves=2, partition="dp", microbatches=8)
    assert dataclasses.replace(from_hydra, stages=None) == strategy.config
    assert AutoPipeStrategy.from_config(from_hydra).config == strategy.config
    # the group's _target_ instantiates the dataclass directly
    node = dict(cfg.pipeline, start_method="spawn")
    assert instantiate(node) == dataclasses.replace(from_hydra, start_method="spawn")


def test_schedule_group_selects_a_schedule_with_its_options():
    cfg = composed("schedule=interleaved", "recipe=gpt-tiny-cpu")
    assert (cfg.pipeline.schedule, cfg.pipeline.chunks) == ("interleaved", 2)
    assert pipeline_config(cfg).schedule_spec == ScheduleSpec.of("interleaved", chunks=2)
    # every registered schedule (and auto) has its yaml
    for name in [*REGISTRY, "auto"]:
        assert composed(f"schedule={name}").pipeline.schedule == name
    assert pipeline_config(composed("schedule=flush")).schedule == "1f1b"  # PipeDream-Flush's name
    assert choose_layers(pipeline_config(composed("recipe=gpt-tiny-2bw"))).versions is DoubleBufferLayer


def test_hydra_schema_refuses_unknown_keys_and_wrong_types():
    # the typed schema (PipelineConfig's fields) is what refuses them, while composing
    with pytest.raises(ConfigCompositionException) as err:
        composed("pipeline.microbtaches=8")
    assert "not in 'PipelineSchema'" in str(err.value.__cause__)
    with pytest.raises(ConfigCompositionException) as err:
        composed("pipeline.microbatches=many")
    assert isinstance(err.value.__cause__, ValidationError)


BAD = [
    (dict(schedule="zigzag"), "schedule"),
    (dict(microbatches=0), "microbatches"),
    (dict(width=True), "width"),
    (dict(chunks=0), "chunks"),
    (dict(waves=-1), "waves"),
    (dict(partition="magic"), "partition"),
    (dict(partition=[3, 0]), "partition"),
    (dict(partition=7), "partition"),
    (dict(slicer=5, microbatches=4), "slicer"),
    (dict(slicer="yes"), "slicer"),
    (dict(schedule="wave", slicer=True), "slicer"),
    (dict(memory_limit=0), "memory_limit"),
    (dict(schedule="auto", partition=[2, 2]), "partition"),
    (dict(bandwidth=-1.0), "bandwidth"),
    (dict(start_method="thread"), "start_method"),
]


@pytest.mark.parametrize("kwargs,setting", BAD)
def test_each_bad_setting_names_itself_everywhere(kwargs, setting):
    with pytest.raises(SettingError) as direct:
        PipelineConfig(**kwargs)
    assert direct.value.setting == setting and f"{setting}=" in str(direct.value)
    with pytest.raises(SettingError) as via_strategy:  # the strategy's keywords go through the same checks
        AutoPipeStrategy(**kwargs)
    assert str(via_strategy.value) == str(direct.value)


def test_checks_that_need_the_world_and_the_model():
    config = PipelineConfig(schedule="wave", waves=2, partition="uniform")
    config.check_world(3)  # width 1 fits any world; the waves are checked against the model
    with pytest.raises(SettingError) as err:
        config.replace(width=2).check_world(3)
    assert err.value.setting == "width"
    with pytest.raises(SettingError, match=r"use waves <= 1") as err:
        config.check_model(2, 6)
    assert err.value.setting == "waves"
    with pytest.raises(SettingError, match=r"lists 3 stages") as err:
        PipelineConfig(partition=[1, 2, 3]).check_model(2, 6)
    assert err.value.setting == "partition"
    with pytest.raises(SettingError, match=r"multiple of the 2 stages") as err:
        PipelineConfig(schedule="interleaved", microbatches=3).check_world(2)
    assert err.value.setting == "microbatches"
    with pytest.raises(SettingError, match=r"batch_size=2 is smaller than microbatches=4") as err:
        PipelineConfig().check_batch_size(2)
    assert err.value.setting == "microbatches"
    PipelineConfig(partition=[2, 4]).check_model(2, 6)  # fits: no error


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(REGISTRY)),
    stages=st.integers(1, 5),
    per_stage=st.integers(1, 3),
    option=st.integers(1, 3),
    blocks=st.integers(1, 40),
)
def test_spec_counts_chunks_as_the_built_schedule_does(name, stages, per_stage, option, blocks):
    spec = ScheduleSpec.from_settings(name, {"chunks": option, "waves": option})
    built = spec.build(stages, stages * per_stage)
    assert spec.chunk_count(stages) == built.num_chunks == len(spec.placement(stages, stages * per_stage))
    if spec.chunk_count(stages) <= blocks:
        spec.check(stages, blocks)
    else:
        with pytest.raises(SettingError) as err:
            spec.check(stages, blocks)
        assert err.value.setting in (*spec.kwargs, "width")


@pytest.mark.parametrize("name", [*REGISTRY, "auto"])
def test_registered_strategy_names(name):
    trainer = L.Trainer(devices=2, strategy=f"autopipe_{name}", **trainer_kwargs())
    assert isinstance(trainer.strategy, AutoPipeStrategy) and trainer.strategy.config.schedule == name
    assert "PipelinePrecision" in type(trainer.strategy.precision_plugin).__name__
