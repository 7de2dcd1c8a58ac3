"""The performance predictor: pure Python, no torch, fast enough for a planner's inner loop."""

from hethub.predictor.calibration import Calibration, default_calibration
from hethub.predictor.iteration import predict
from hethub.predictor.results import Prediction, StagePrediction

__all__ = ["Calibration", "Prediction", "StagePrediction", "default_calibration", "predict"]
