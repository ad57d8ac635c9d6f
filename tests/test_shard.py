"""A sweep split with --shard K/N: the shards partition the samples evenly, and their merged folders hold the rows
of the whole sweep."""

import json
from collections import Counter
from typing import NamedTuple

import pytest
from conftest import ONE_LAYER_LLAMA, save_random_llama
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from criticalkv.cli import app
from criticalkv.errors import CriticalKVError
from criticalkv.eval.shard import Shard


def test_parse_reads_k_of_n_and_refuses_anything_else():
    assert Shard.parse("2/3") == Shard(2, 3)
    assert Shard.parse(" 1 / 1 ") == Shard(1, 1)
    assert Shard.parse(None) is None and Shard.parse("") is None
    for text in ("0/2", "3/2", "1", "1/2/3", "a/b", "-1/2"):
        with pytest.raises(CriticalKVError, match="--shard"):
            Shard.parse(text)


class Sample(NamedTuple):
    index: int
    task: str


@given(st.integers(1, 6), st.integers(0, 9), st.integers(1, 7))
def test_the_shards_partition_the_samples_every_task_evenly_in_order(tasks, per_task, count):
    samples = [Sample(i, f"t{j}") for i in range(per_task) for j in range(tasks)]  # index-major, as RULER's
    parts = [Shard(k, count).take(samples) for k in range(1, count + 1)]
    assert sorted(x for part in parts for x in part) == sorted(samples)  # each sample in exactly one shard
    assert all(part == sorted(part) for part in parts)  # the sweep's order kept
    for j in range(tasks):  # every task spread within one sample
        counts = [Counter(s.task for s in part)[f"t{j}"] for part in parts]
        assert max(counts) - min(counts) <= 1


def _rows(folder):
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    return sorted((r["task"], r["index"], r["method"], r["budget"], r["prediction"]) for r in rows)


def test_merged_shards_hold_the_rows_of_the_whole_sweep(tmp_path, tiny_tokenizer):
    model = save_random_llama(tmp_path / "llama", tiny_tokenizer, **ONE_LAYER_LLAMA, max_position_embeddings=512)
    args = ["eval", "facts", "--model", str(model), "--tasks", "fact_single,fact_pair", "--samples", "3"]
    args += ["--length", "400", "--methods", "snapkv", "--budgets", "0.5", "--max-new-tokens", "2", "--device", "cpu"]
    for name, extra in (("whole", []), ("one", ["--shard", "1/2"]), ("two", ["--shard", "2/2"])):
        result = CliRunner().invoke(app, [*args, *extra, "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    samples = lambda rows: {(task, index) for task, index, *_ in rows}  # noqa: E731
    assert samples(one) == {("fact_single", 0), ("fact_pair", 1), ("fact_single", 2)}  # (index + task rank) mod 2
    assert samples(two) == {("fact_pair", 0), ("fact_single", 1), ("fact_pair", 2)}
    merged = tmp_path / "merged"
    result = CliRunner().invoke(app, ["report", str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(merged)])
    assert result.exit_code == 0, result.output
    assert _rows(merged) == _rows(tmp_path / "whole")


def test_a_bad_shard_is_refused_before_loading():
    result = CliRunner().invoke(app, ["eval", "ruler", "--model", "/nonexistent", "--shard", "3/2"])
    assert result.exit_code == 2 and "K must be between 1 and N" in " ".join(result.output.split()), result.output
