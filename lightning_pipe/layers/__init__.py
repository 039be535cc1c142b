"""The engine's training layers: what one optimizer step runs on a rank's stage. No Lightning.

A step is composed of independent layers, each behind one declared interface (`layers.base`):

- weight versions (`Versions`): runs the schedule's action list for a step. `Flush` (one version,
  the pipeline fills and drains inside the step: every synchronous schedule) or `DoubleBuffer`
  (PipeDream-2BW: no flush, two weight versions, the version lag is its state).
- replicas: `ElasticAveraging` (AvgPipe's pull against the stage's reference process) is the
  engine part of the elastic replicas; an all-reduce across `width` lives in the gradients'
  REDUCE (`lightning/gradients.py`), no replicas needs nothing.
- controllers (`Controller`): per-step rules that change the schedule between steps, the same way
  on every rank (`AdvanceRule`, AvgPipe's Algorithm 1).

Partition control (static, adaptive by rule, adaptive learned) works between steps on the cut,
in `lightning_pipe.adaptive`. The Lightning side of every layer (checkpoint extras, Trainer checks,
evaluation, live switches) is `lightning_pipe.lightning.layers`.
"""

from .advance import AdvanceRule
from .base import Controller, Versions
from .double_buffer import DoubleBuffer
from .elastic import ElasticAveraging
from .flush import Flush

__all__ = ["AdvanceRule", "Controller", "DoubleBuffer", "ElasticAveraging", "Flush", "Versions"]
