"""An experiment's statistics, from rliable (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"):
pure functions of the runs' scores (numpy arrays), no MLflow. Scores are paired: index i of every arm is seed i.

Every interval is rliable's stratified percentile bootstrap with `reps` resamples, seeded: one
`rly.get_interval_estimates` call per statistic over every arm (or pair) in order, right after `np.random.seed(seed)`
(rliable 1.2 draws its resampled indices from numpy's global RNG), so the report is the same every time it is made
and a reader recomputes it the same way.

    aggregates    per arm: IQM, mean and median with intervals
    improvement   per ordered pair (x, y): P(x > y) (rliable's probability_of_improvement) with its interval; the
                  paired differences x - y per seed, their mean with an interval, and whether the arms separate;
                  when they do not, about how many seeds would at the observed spread
    profiles      per arm: the share of runs scoring above tau, with intervals (performance profiles)
    curves        per arm: the IQM at each step of the metric's curve, with intervals (sample efficiency)
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Iterator

import numpy as np
from rliable import library as rly
from rliable import metrics as rm
from scipy.stats import norm

# rliable's aggregate_median is the median over tasks of each task's mean over runs: with one metric (one task) it is
# the mean; the median here is over the runs, as a reader of one metric expects (the bootstrap is rliable's)
ESTIMATES = {"iqm": rm.aggregate_iqm, "mean": rm.aggregate_mean, "median": lambda x: float(np.median(x))}
PROFILE_POINTS = 51


def run_scores(history: list[tuple[int, float]]) -> dict[str, float]:
    """A run's scores of one metric from its curve [(step, value)] by step: 'final' (the last step's value) and 'auc'
    (the area under the curve over the steps logged, divided by their span: the curve's mean value, the steps
    weighted by their spacing; the one value itself when there is one step)."""
    if not history:
        raise ValueError("a run's metric has no logged step")
    steps = np.array([s for s, _ in history], dtype=np.float64)
    values = np.array([v for _, v in history], dtype=np.float64)
    auc = float(values[0]) if len(values) == 1 \
        else float(((values[1:] + values[:-1]) / 2 * np.diff(steps)).sum() / (steps[-1] - steps[0]))
    return {"final": float(values[-1]), "auc": auc}


def _estimates(scores: dict, func, reps: int, confidence: float, seed: int):
    """rliable's interval estimates over `scores` in order, numpy's global RNG seeded with `seed` for the call
    (rliable 1.2's stratified bootstrap draws its indices from np.random whatever `random_state` says; the global
    state is put back after)."""
    with _numpy_seeded(seed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arch")
        return rly.get_interval_estimates(scores, func, reps=reps, confidence_interval_size=confidence,
                                          random_state=np.random.RandomState(seed))


def _interval(value, bounds) -> dict[str, float]:
    return {"value": float(value), "low": float(bounds[0]), "high": float(bounds[1])}


def aggregates(scores: dict[str, np.ndarray], reps: int, confidence: float, seed: int) -> dict[str, dict]:
    """arm -> {iqm, mean, median: {value, low, high}} of its runs' scores (arm -> [runs])."""
    matrices = {arm: np.asarray(s, dtype=np.float64).reshape(-1, 1) for arm, s in scores.items()}
    point, bounds = _estimates(matrices, lambda x: np.array([f(x) for f in ESTIMATES.values()]), reps, confidence, seed)
    return {arm: {name: _interval(point[arm][i], bounds[arm][:, i]) for i, name in enumerate(ESTIMATES)}
            for arm in scores}


def pairs(arms: list[str]) -> list[tuple[str, str]]:
    """Every ordered pair of distinct arms, in the arms' order."""
    return [(x, y) for x in arms for y in arms if x != y]


def improvement(scores: dict[str, np.ndarray], reps: int, confidence: float, seed: int,
                direction: str = "maximize") -> dict[str, dict]:
    """'x,y' -> P(x improves on y) with its interval (rliable: the probability that a run of x scores better than
    one of y, ties counting half); the paired differences x - y per seed, their mean with an interval; whether the
    arms separate (two seeds or more, and the interval of the mean difference excludes 0) and, when not, about how
    many seeds would."""
    sign = 1.0 if direction == "maximize" else -1.0
    arms = list(scores)
    keyed = {f"{x},{y}": (sign * np.asarray(scores[x], np.float64).reshape(-1, 1),
                          sign * np.asarray(scores[y], np.float64).reshape(-1, 1)) for x, y in pairs(arms)}
    if not keyed:
        return {}
    point, bounds = _estimates(keyed, rm.probability_of_improvement, reps, confidence, seed)
    differences = {key: np.asarray(scores[x], np.float64) - np.asarray(scores[y], np.float64)
                   for key, (x, y) in zip(keyed, pairs(arms))}
    mean, mean_bounds = _estimates({k: d.reshape(-1, 1) for k, d in differences.items()},
                                   lambda x: np.array([rm.aggregate_mean(x)]), reps, confidence, seed)
    out = {}
    for key, d in differences.items():
        low, high = float(mean_bounds[key][0, 0]), float(mean_bounds[key][1, 0])
        separated = len(d) >= 2 and (low > 0 or high < 0)  # one seed shows no spread: nothing to separate by
        out[key] = {"probability": _interval(point[key], bounds[key][:, 0]),
                    "differences": [float(v) for v in d], "mean_difference": _interval(mean[key][0], (low, high)),
                    "separated": separated,
                    "seeds_needed": None if separated else seeds_needed(d, confidence)}
    return out


def seeds_needed(differences: np.ndarray, confidence: float) -> int | None:
    """About how many paired seeds would put the mean difference's interval clear of 0 at the spread observed:
    n = ceil((z * sd / |mean|)^2), z the normal quantile of the interval, sd the paired differences' sample standard
    deviation. None when it cannot be said: fewer than 2 seeds, or no difference observed."""
    d = np.asarray(differences, dtype=np.float64)
    if len(d) < 2 or d.mean() == 0:
        return None
    sd = float(d.std(ddof=1))
    if sd == 0:
        return len(d)  # every seed gave the same difference: the bootstrap interval is already that one point
    z = float(norm.ppf(1 - (1 - confidence) / 2))
    return max(2, math.ceil((z * sd / abs(float(d.mean()))) ** 2))


@contextmanager
def _numpy_seeded(seed: int) -> Iterator[None]:
    """rliable's performance profiles draw from numpy's global RNG (they take no random_state): seed it for the
    call and put back what was there."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def profiles(scores: dict[str, np.ndarray], reps: int, confidence: float, seed: int) -> dict:
    """{tau: [...], arm: {value: [...], low: [...], high: [...]}}: the share of each arm's runs scoring above tau, tau
    over the range of every score (rliable's performance profiles)."""
    matrices = {arm: np.asarray(s, dtype=np.float64).reshape(-1, 1) for arm, s in scores.items()}
    every = np.concatenate([m.ravel() for m in matrices.values()])
    tau = np.linspace(every.min(), every.max(), PROFILE_POINTS)
    with _numpy_seeded(seed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arch")
        point, bounds = rly.create_performance_profile(matrices, tau, reps=reps, confidence_interval_size=confidence)
    return {"tau": [float(t) for t in tau],
            "arms": {arm: {"value": point[arm].tolist(), "low": bounds[arm][0].tolist(),
                           "high": bounds[arm][1].tolist()}
                     for arm in scores}}


def curves(values: dict[str, np.ndarray], steps: list[int], reps: int, confidence: float, seed: int) -> dict:
    """{steps, arms: {arm: {value, low, high}}}: the IQM over an arm's runs at each step (values: arm -> [runs,
    steps]), with intervals (rliable's sample-efficiency curves)."""
    matrices = {arm: np.asarray(v, dtype=np.float64)[:, None, :] for arm, v in values.items()}

    def per_step(x: np.ndarray) -> np.ndarray:
        return np.array([rm.aggregate_iqm(x[..., j]) for j in range(x.shape[-1])])

    point, bounds = _estimates(matrices, per_step, reps, confidence, seed)
    return {"steps": list(steps), "arms": {arm: {"value": point[arm].tolist(), "low": bounds[arm][0].tolist(),
                                                 "high": bounds[arm][1].tolist()} for arm in values}}
