"""AvgPipe's tuner of the micro-batch count M and the parallel pipeline count N (Chen et al.,
PPoPP 2023, §5.2): profile one setting, predict every other with Eq. 1-8, pick the fastest that
fits. No Lightning here: `record` measures a rank's steps, `predict` holds the equations and the
choice; the CLI runs the profile (`lightning_pipe.cli.tune`)."""

from ..profiling.link import measure_link
from .calibrated import predict_calibrated
from .predict import Prediction, StageProfile, TuneProfile, TuneResult, choose, default_grid, predict
from .record import StageRecorder
from .utilisation import UtilisationSampler

__all__ = [
    "Prediction",
    "StageProfile",
    "StageRecorder",
    "TuneProfile",
    "TuneResult",
    "UtilisationSampler",
    "choose",
    "default_grid",
    "measure_link",
    "predict",
    "predict_calibrated",
]
