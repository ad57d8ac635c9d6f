"""Bootstrap confidence intervals of a sweep's figures: the compression loss of a pair, the ratio of a CriticalKV
variant's loss to its base method's, and the difference between two runs of one pair (chunked against one-shot).

A benchmark's mean is the mean over tasks of per-task means, so the bootstrap resamples samples within each task
(stratified), and every figure that compares pairs resamples them together: the same (task, index) keys for all of
them in each resample (paired). The interval is the central ``LEVEL`` of the resampled figures (percentile method);
a fixed seed makes it the same on every run.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from criticalkv.errors import CriticalKVError

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0

Scores = dict[tuple[str, int], float]  # (task, sample index) -> score
Interval = tuple[float, float]


def common_samples(columns: list[Scores]) -> dict[str, list[tuple[str, int]]]:
    """The (task, index) keys that every column scored, grouped by task (both sorted)."""
    keys = set.intersection(*(set(column) for column in columns))
    if not keys:
        raise CriticalKVError("the runs compared share no sample: nothing to resample")
    by_task: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key in sorted(keys):
        by_task[key[0]].append(key)
    return dict(sorted(by_task.items()))


def _task_tables(columns: list[Scores]) -> list[torch.Tensor]:
    """Per task (sorted), the columns' scores on their common samples: (n_task, columns) float64 each."""
    by_task = common_samples(columns)
    return [torch.tensor([[c[k] for c in columns] for k in keys], dtype=torch.float64) for keys in by_task.values()]


def task_means(columns: list[Scores]) -> torch.Tensor:
    """The mean over tasks of per-task means of each column on their common samples: (columns,) float64."""
    return torch.stack([table.mean(0) for table in _task_tables(columns)]).mean(0)


def resampled_means(columns: list[Scores], resamples: int = RESAMPLES, seed: int = SEED) -> torch.Tensor:
    """``task_means`` of ``resamples`` task-stratified bootstrap resamples of the common samples, the same resampled
    keys for every column: (resamples, columns) float64."""
    tables = _task_tables(columns)
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(resamples, len(columns), dtype=torch.float64)
    for table in tables:  # (n, columns)
        draws = torch.randint(len(table), (resamples, len(table)), generator=generator)  # (resamples, n)
        total += table[draws].mean(1)  # (resamples, columns)
    return total / len(tables)


def percentile_interval(figures: torch.Tensor) -> Interval | None:
    """The central ``LEVEL`` of resampled figures (resamples,), or None where some resample has no figure (NaN or
    infinite: a ratio over a zero)."""
    if not bool(torch.isfinite(figures).all()):
        return None
    tail = (1 - LEVEL) / 2
    low, high = torch.quantile(figures, torch.tensor([tail, 1 - tail], dtype=figures.dtype)).tolist()
    return low, high


def loss_interval(full: Scores, method: Scores) -> Interval | None:
    """Of the compression loss ``(full - method) / full`` on the common samples; None where a resample's full score
    is 0 (no loss defined)."""
    means = resampled_means([full, method])
    return percentile_interval((means[:, 0] - means[:, 1]) / means[:, 0])


def loss_ratio(full: Scores, base: Scores, variant: Scores) -> tuple[float | None, Interval | None]:
    """The variant's loss over the base method's (``< 0.5``: the variant cuts the base's loss by more than half),
    on the samples all three answered, and its interval: None where the base loses nothing (the point), or in some
    resample (the interval)."""
    point = _loss_ratios(task_means([full, base, variant])[None])[0].item()
    interval = percentile_interval(_loss_ratios(resampled_means([full, base, variant])))
    return (point if math.isfinite(point) else None), interval


def _loss_ratios(means: torch.Tensor) -> torch.Tensor:
    """(n, 3) means of full, base and variant -> (n,) loss ratios; NaN where the base's loss is not positive."""
    full, base, variant = means.unbind(-1)
    base_loss, variant_loss = (full - base) / full, (full - variant) / full
    return torch.where(base_loss > 0, variant_loss / base_loss, torch.full_like(full, float("nan")))


def difference(a: Scores, b: Scores) -> tuple[float, Interval | None]:
    """The mean of ``b`` minus the mean of ``a`` on their common samples, and its interval (paired)."""
    point = task_means([a, b])
    means = resampled_means([a, b])
    return (point[1] - point[0]).item(), percentile_interval(means[:, 1] - means[:, 0])
