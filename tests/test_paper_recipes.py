"""The recipes that name a paper run that paper's method: `bert-tiny-wave` Hanayo's own order
(not our greedy `wave`), `gpt-tiny-avgpipe` AvgPipe's 1F1B with advance forward (not plain 1F1B)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

import lightning_pipe.cli.schema  # noqa: F401  (registers the pipeline schema the recipes extend)
from lightning_pipe.cli.paths import CONFIG_DIR
from lightning_pipe.cli.train import pipeline_config
from lightning_pipe.schedules import build_schedule


def recipe(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"recipe={name}", *overrides])
    return cfg, pipeline_config(cfg)


def test_bert_tiny_wave_runs_hanayos_order():
    cfg, config = recipe("bert-tiny-wave")
    assert (config.schedule, config.waves, config.microbatches, cfg.trainer.devices) == ("hanayo", 2, 4, 2)
    built = config.schedule_spec.build(2, 4)
    assert built.name == "hanayo-w2" and built.chunk_rank == (0, 1, 1, 0, 0, 1, 1, 0)  # down, up, down, up
    # at this P = 2, W = 2, B = 4 our greedy order happens to give the same per-rank order (it
    # differs elsewhere: tests/test_multichunk.py); the recipe names the paper's generator all the same
    compute = lambda s: [[(a.op, a.chunk, a.microbatch) for a in acts if a.op.is_compute] for acts in s.actions]  # noqa: E731
    assert compute(built) == compute(build_schedule("hanayo", 2, 4, waves=2))


def test_gpt_tiny_avgpipe_runs_advance_forward():
    cfg, config = recipe("gpt-tiny-avgpipe")
    assert (config.schedule, config.advance_num, config.pipelines) == ("advance", None, 2)
    # 2 pipelines x 2 stages: 4 processes on the recipe's 2 devices (N per device, the paper's layout)
    world = config.world(cfg.trainer.devices)
    assert world == 4 and config.topology(world, cfg.trainer.devices).depth == 2
    # plain 1F1B stays one override away
    assert recipe("gpt-tiny-avgpipe", "pipeline.schedule=1f1b")[1].schedule == "1f1b"
