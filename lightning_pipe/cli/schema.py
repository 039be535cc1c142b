"""`PipelineConfig` as Hydra's schema for the `pipeline` group (ConfigStore `pipeline_schema`).

conf/pipeline/default.yaml extends it, so a mistyped key (`pipeline.microbtaches=8`) or value
(`pipeline.microbatches=many`) is refused by Hydra while composing, and `instantiate(cfg.pipeline)`
builds the checked `PipelineConfig` through its `_target_`.
"""

from __future__ import annotations

import dataclasses
import typing

from hydra.core.config_store import ConfigStore

from ..config import PipelineConfig

TARGET = f"{PipelineConfig.__module__}.{PipelineConfig.__name__}"


def _schema() -> type:
    hints = typing.get_type_hints(PipelineConfig)
    fields = [("_target_", str, dataclasses.field(default=TARGET))]
    fields += [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(PipelineConfig)]
    return dataclasses.make_dataclass("PipelineSchema", fields)


PipelineSchema = _schema()
# stored outside the pipeline group (a top-level config), so `--help` lists only the groups users pick from
ConfigStore.instance().store(name="pipeline_schema", node=PipelineSchema)
