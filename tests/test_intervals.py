"""Bootstrap intervals of a sweep's figures (eval/intervals.py) against a slow per-resample reference, and their
invariants."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.errors import CriticalKVError
from criticalkv.eval import intervals
from criticalkv.eval.intervals import difference, loss_interval, loss_ratio, resampled_means, task_means
from criticalkv.eval.report import summarise
from criticalkv.eval.sweep import Row


def _scores(seed: int, tasks: int = 3, samples: int = 5, scale: float = 100.0) -> dict[tuple[str, int], float]:
    rng = random.Random(seed)
    return {(f"t{t}", i): rng.choice([0.0, scale / 2, scale]) for t in range(tasks) for i in range(samples)}


def _slow_resampled_means(columns, resamples, seed):
    """One resample at a time, one task at a time, with the draws ``resampled_means`` makes (its generator, its
    order of tasks): plain loops over Python floats."""
    keys = sorted(set.intersection(*(set(c) for c in columns)))
    tasks = sorted({task for task, _ in keys})
    generator = torch.Generator().manual_seed(seed)
    draws = {}
    for task in tasks:
        mine = [k for k in keys if k[0] == task]
        draws[task] = (mine, torch.randint(len(mine), (resamples, len(mine)), generator=generator).tolist())
    out = []
    for r in range(resamples):
        row = []
        for column in columns:
            per_task = []
            for task in tasks:
                mine, index = draws[task]
                per_task.append(sum(column[mine[i]] for i in index[r]) / len(mine))
            row.append(sum(per_task) / len(per_task))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def test_resampled_means_equal_a_slow_loop_over_resamples():
    columns = [_scores(1), _scores(2), _scores(3)]
    del columns[1][("t0", 0)]  # a sample one column lacks drops out of all of them (paired)
    fast = resampled_means(columns, resamples=50, seed=7)
    torch.testing.assert_close(fast, _slow_resampled_means(columns, 50, 7), rtol=1e-12, atol=1e-12)


def test_the_point_figures_are_the_mean_over_tasks_of_task_means_on_common_samples():
    a = {("x", 0): 10.0, ("x", 1): 20.0, ("y", 0): 100.0, ("y", 5): 7.0}
    b = {("x", 0): 0.0, ("x", 1): 0.0, ("y", 0): 50.0}  # ("y", 5) is not common
    assert task_means([a, b]).tolist() == [(15.0 + 100.0) / 2, (0.0 + 50.0) / 2]
    assert difference(a, b)[0] == 25.0 - 57.5


def test_no_common_sample_is_refused():
    with pytest.raises(CriticalKVError, match="share no sample"):
        difference({("x", 0): 1.0}, {("x", 1): 1.0})


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.1, 10.0))
def test_loss_and_ratio_intervals_do_not_change_with_the_scale_of_the_scores(seed, factor):
    full, base, variant = _scores(seed), _scores(seed + 1), _scores(seed + 2)
    full = {k: v + 1.0 for k, v in full.items()}  # never 0: a loss is defined in every resample
    scaled = [{k: v * factor for k, v in s.items()} for s in (full, base, variant)]
    torch.testing.assert_close(loss_interval(full, base), loss_interval(*scaled[:2]))
    point, interval = loss_ratio(full, base, variant)
    scaled_point, scaled_interval = loss_ratio(*scaled)
    assert (point is None) == (scaled_point is None) and (interval is None) == (scaled_interval is None)
    if point is not None:
        assert scaled_point == pytest.approx(point, rel=1e-9)
    if interval is not None:
        assert scaled_interval == pytest.approx(interval, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(-20.0, 20.0))
def test_a_shift_of_every_sample_is_a_difference_without_spread(seed, shift):
    """Paired: the same resampled keys for both runs, so a constant shift has no spread (unpaired, it would)."""
    a = _scores(seed)
    point, (low, high) = difference(a, {k: v + shift for k, v in a.items()})
    assert point == pytest.approx(shift) and low == pytest.approx(shift) and high == pytest.approx(shift)


def test_a_method_equal_to_the_full_cache_loses_nothing_in_every_resample():
    full = _scores(4)
    assert loss_interval(full, dict(full)) == (0.0, 0.0)


def test_loss_ratio_is_none_where_the_base_loses_nothing():
    full = {("x", i): 100.0 for i in range(4)}
    assert loss_ratio(full, dict(full), {("x", i): 50.0 for i in range(4)}) == (None, None)


def test_the_interval_holds_the_point_and_narrows_with_more_samples():
    rng = random.Random(0)
    sizes = (10, 160)
    widths = []
    for n in sizes:
        full = {(f"t{t}", i): 100.0 * (rng.random() < 0.9) for t in range(4) for i in range(n)}
        method = {k: v * (rng.random() < 0.6) for k, v in full.items()}
        low, high = loss_interval(full, method)
        loss = 1 - task_means([full, method])[1].item() / task_means([full, method])[0].item()
        assert low <= loss <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(16) of it


def test_summarise_gives_each_critical_variant_its_ratio_to_the_base():
    rows = []
    for i in range(6):
        for method, budget, score in (
            ("full", 1.0, 100.0),
            ("snapkv", 0.2, 20.0 * (i % 3)),
            ("critical-snapkv", 0.2, 70.0),
        ):
            rows.append(Row("task", i, "aware", method, budget, score, "", 100, budget))
    summary = summarise(rows)
    losses = {e["method"]: e["loss"] for e in summary["rows"]}
    (ratio,) = summary["loss_ratios"]
    assert ratio["method"] == "critical-snapkv" and ratio["base"] == "snapkv" and ratio["budget"] == 0.2
    assert ratio["ratio"] == pytest.approx(losses["critical-snapkv"] / losses["snapkv"])
    low, high = ratio["interval"]
    assert low <= ratio["ratio"] <= high and low < high


def test_intervals_are_the_same_on_every_run():
    full, method = _scores(11), _scores(12)
    assert loss_interval(full, method) == loss_interval(full, method)
    assert intervals.SEED == 0 and intervals.RESAMPLES >= 1000


def test_the_report_says_n_a_where_the_full_cache_scores_0_in_some_resample(tmp_path):
    import json
    from dataclasses import asdict

    from criticalkv.eval.report import write_report

    rows = [Row("needle", i, "aware", "full", 1.0, s, "", 100, 1.0) for i, s in enumerate((100.0, 0.0, 100.0))]
    rows += [Row("needle", i, "aware", "snapkv", 1024, s, "", 100, 0.3) for i, s in enumerate((100.0, 0.0, 0.0))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    summary = summarise(rows)
    assert {e["method"]: e["loss_interval"] for e in summary["rows"]}["snapkv"] is None  # (0, 0, 0) full is drawn
    assert "| snapkv | 1024 | 33.3 | 33.3 | 50.0% (n/a) |" in write_report(tmp_path).read_text()
