"""Shortest-predicted-job-first with aging, as a cbcore queue policy."""

from __future__ import annotations

from cbcore_sjf.policy import ShortestPredictedJobFirst, SJFParams
from cbcore_sjf.predictors import PREDICTORS, Predictor, register_predictor, resolve_predictor

__all__ = [
    "PREDICTORS",
    "Predictor",
    "SJFParams",
    "ShortestPredictedJobFirst",
    "register_predictor",
    "resolve_predictor",
]
