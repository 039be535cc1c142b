"""The training layers in Lightning, composed by `compose.Training` (the strategy names none).

| layer            | variants                                                    | module           |
|------------------|-------------------------------------------------------------|------------------|
| weight versions  | FlushLayer; DoubleBufferLayer (PipeDream-2BW)                | flush, double_buffer |
| replicas         | NoReplicas; AllReduce (width); ElasticReplicas (AvgPipe)     | replicas         |
| partition        | StaticPartition; AdaptivePartition (rule / learned)          | partition        |
| controllers      | AdvanceController (AvgPipe's Algorithm 1)                    | controllers      |

Every hook is declared in `base.Layer` (and its kinds); `compose.choose_layers` is the one place
that turns a `PipelineConfig` into layers.
"""

from .base import ControllerLayer, Layer, PartitionLayer, ReplicasLayer, VersionsLayer
from .compose import LayerChoice, Training, choose_layers

__all__ = ["ControllerLayer", "Layer", "LayerChoice", "PartitionLayer", "ReplicasLayer", "Training", "VersionsLayer", "choose_layers"]
