"""The pure helpers of the benchmarks (the kvpress comparisons: speed_memory.py, quality_vs_kvpress.py; and
compare_sweeps.py, headline_table.py, kept_positions.py, surrogate_placement.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "kvpress"))

from compare_sweeps import compare
from headline_table import ratio_plot, table
from kept_positions import shares
from plot_benchmarks import (
    answer_cells,
    compression_table,
    fastest_table,
    gauged_table,
    ours_alone,
    paired_table,
    phase_table,
    plot_presets,
    presets_table,
)
from prefill_overhead import run_ratios
from quality_vs_kvpress import answer_tables, both_answered, trim_at_eos
from speed_memory import kvpress_ratio, run_child, summarise
from surrogate_placement import chunked_keep, scores_of

from criticalkv.models.families import attention_modules
from criticalkv.scorers import SurrogateScorer


@given(t=st.integers(min_value=64, max_value=200_000), tenths=st.integers(min_value=1, max_value=9))
def test_kvpress_ratio_keeps_the_same_count(t: int, tenths: int) -> None:
    """kvpress keeps max(1, int(T * (1 - ratio))) (kvpress/utils.py compute_n_kept); criticalkv floor(b * T)."""
    budget = f"0.{tenths}"
    ratio = kvpress_ratio(budget, t)
    assert 0 <= ratio < 1
    assert max(1, int(t * (1 - ratio))) == math.floor(t * tenths / 10)


def test_prefill_overhead_ratios_pair_each_repeat_with_the_first_methods() -> None:
    """within = median of t / (t - c); rest = median of (t - c) / t_first, repeat by repeat (not of medians)."""
    times = {"full": [10.0, 20.0, 12.0], "snapkv": [11.0, 21.0, 12.6]}
    compression = {"full": [0.0, 0.0, 0.0], "snapkv": [1.0, 0.5, 0.6]}
    within, rest = run_ratios(times, compression, "full")
    assert within["full"] == rest["full"] == 1.0
    assert within["snapkv"] == pytest.approx(statistics.median([11 / 10, 21 / 20.5, 12.6 / 12.0]))
    assert rest["snapkv"] == pytest.approx(statistics.median([10 / 10, 20.5 / 20, 12.0 / 12.0]))


def test_trim_at_eos() -> None:
    assert trim_at_eos([5, 2, 7, 2], {2}) == [5, 2]
    assert trim_at_eos([5, 6], {2}) == [5, 6]
    assert trim_at_eos([], {2}) == []


def test_a_report_pairs_only_samples_every_method_of_both_systems_answered() -> None:
    methods = ["full", "critical-snapkv"]
    ours = [
        {"key": "a", "tokens": {"full": [1], "critical-snapkv": [2]}},
        {"key": "b", "tokens": {"full": [1]}},  # an interrupted sample: one method only
        {"key": "c", "tokens": {"full": [1], "critical-snapkv": [2]}},
    ]
    theirs = [
        {"key": k, "press": p, "tokens": [1]} for k, p in [("a", "none"), ("a", "critical-snapkv"), ("b", "none")]
    ]
    theirs += [{"key": "b", "press": "critical-snapkv", "tokens": [1]}, {"key": "c", "press": "none", "tokens": [1]}]
    ours_table, theirs_table = answer_tables(ours, theirs, methods)
    assert both_answered(ours_table, theirs_table, methods) == {"a"}  # b lacks ours, c kvpress's critical-snapkv
    later = [{"key": "b", "tokens": {"full": [3], "critical-snapkv": [4]}}, {"key": "b", "tokens": {"full": [5]}}]
    ours_table, _ = answer_tables(ours + later, theirs, methods)  # an incomplete last line does not replace
    assert ours_table["b"] == {"full": [3], "critical-snapkv": [4]}
    assert both_answered(ours_table, theirs_table, methods) == {"a", "b"}


def _run(system: str, method: str, ttft: float, kv: int) -> dict:
    return {
        "length": 1024,
        "prompt_tokens": 1020,
        "system": system,
        "method": method,
        "ttft_seconds": ttft,
        "ttft_cpu_seconds": ttft,
        "decode_ms_per_token_median": 10.0,
        "decode_cpu_ms_per_token_median": 10.0,
        "peak_rss_above_start_bytes": 100,
        "kv_bytes": kv,
    }


def test_summarise_medians_fractions_and_ratios() -> None:
    runs = [_run("ours", "full", t, 1000) for t in (1.0, 3.0, 2.0)]
    runs += [_run("kvpress", "full", t, 1000) for t in (4.0, 4.0, 5.0)]
    runs += [_run("ours", "snapkv", 1.0, 200), _run("kvpress", "snapkv", 2.0, 200)]
    rows = summarise(runs, [1024], ["full", "snapkv"], ["ours", "kvpress"])
    full, snap = rows
    assert full["ours"]["ttft_seconds"] == 2.0 and full["kvpress"]["ttft_seconds"] == 4.0
    assert full["ratio_ours_over_kvpress"]["ttft_seconds"] == pytest.approx(0.5)
    assert snap["ours"]["kv_fraction_of_full"] == pytest.approx(0.2)
    assert snap["ratio_ours_over_kvpress"]["kv_bytes"] == pytest.approx(1.0)
    assert full["repeats"] == 3
    assert summarise(runs, [1024, 2048], ["full", "snapkv"], ["ours", "kvpress"]) == rows  # 2048 never ran


def test_phase_medians_and_table() -> None:
    """Per-phase medians run by run, the time no phase covers, and the table of both systems side by side."""

    def phased(system: str, ttft: float, attention: float, compression: float | None) -> dict:
        phases = {"attention": {"cpu_seconds": attention, "minor_faults": 10}, "mlp": {"cpu_seconds": 1.0}}
        phases["mlp"]["minor_faults"] = 20
        if compression is not None:
            phases["compression"] = {"cpu_seconds": compression, "minor_faults": 0}
        return {**_run(system, "snapkv", ttft, 200), "prefill_phases": phases}

    runs = [phased("ours", 2.0, 0.5, 0.1), phased("ours", 2.4, 0.7, 0.1), phased("ours", 2.2, 0.9, 0.1)]
    runs += [phased("kvpress", 2.5, 0.8, 0.2)]
    (row,) = summarise(runs, [1024], ["snapkv"], ["ours", "kvpress"])
    assert row["ours"]["phase_attention_cpu_seconds"] == 0.7 and row["ours"]["phase_mlp_minor_faults"] == 20
    assert row["ours"]["phase_other_cpu_seconds"] == pytest.approx(0.4)  # 2.0-1.6, 2.4-1.8, 2.2-2.0: median 0.4
    assert row["kvpress"]["phase_other_cpu_seconds"] == pytest.approx(0.5)
    table = phase_table([row])
    assert "| 1020 | snapkv | 0.700 / 0.800 (0.875) | 1.000 / 1.000 (1.000) | 0.100 / 0.200 (0.500) |" in table
    assert phase_table(summarise(runs[:1], [1024], ["snapkv"], ["ours", "kvpress"])) == ""  # no kvpress row


def test_gauged_table_divides_each_pair_by_its_mlp_ratio() -> None:
    """Each pair's ratio is divided by its MLP's ratio (a process of ours whose MLP ran 10% slower is judged against
    a machine 10% slower); the median over the pairs and how many are below 1; a pair without phases is left out."""

    def run(system: str, repeat: int, ttft: float, attention: float, mlp: float) -> dict:
        phases = {"attention": {"cpu_seconds": attention}, "mlp": {"cpu_seconds": mlp}}
        return {**_run(system, "snapkv", ttft, 200), "repeat": repeat, "prefill_phases": phases}

    runs = [run("ours", 0, 2.3, 0.9, 1.1), run("kvpress", 0, 2.0, 0.8, 1.0)]  # its MLP 10% slower
    runs += [run("ours", 1, 1.9, 0.76, 1.0), run("kvpress", 1, 2.0, 0.8, 1.0)]  # 5% faster, the MLP even
    runs += [{**_run("ours", "snapkv", 1.0, 200), "repeat": 2}, {**_run("kvpress", "snapkv", 9.0, 200), "repeat": 2}]
    table = gauged_table(runs)
    assert "| 1024 | snapkv | 2 | 0.9977 | 1 | 0.9864 | 1 |" in table  # 1.045 and 0.95; 1.023 and 0.95
    assert gauged_table(runs[4:]) == ""


def test_compression_time_summary_and_table() -> None:
    """The compression figure is summarised only where every run recorded it; the rest of the prefill run by run."""
    timed = [{**_run("ours", "snapkv", t, 200), "compression_cpu_seconds": c} for t, c in ((2.0, 0.5), (4.0, 0.1))]
    timed.append({**_run("ours", "snapkv", 3.0, 200), "compression_cpu_seconds": 0.3})
    theirs = [{**_run("kvpress", "snapkv", t, 200), "compression_cpu_seconds": 0.6} for t in (3.0, 3.0, 3.0)]
    (row,) = summarise(timed + theirs, [1024], ["snapkv"], ["ours", "kvpress"])
    assert row["ours"]["compression_cpu_seconds"] == pytest.approx(0.3)
    assert row["ours"]["ttft_cpu_outside_compression_seconds"] == pytest.approx(2.7)  # of 1.5, 3.9, 2.7
    assert row["ratio_ours_over_kvpress"]["compression_cpu_seconds"] == pytest.approx(0.5)
    table = compression_table([row])
    assert "| 1020 | snapkv | 0.300 | 0.600 | 0.500 | 2.70 | 2.40 | 1.125 |" in table
    older = summarise(timed + theirs + [_run("ours", "snapkv", 3.0, 200)], [1024], ["snapkv"], ["ours", "kvpress"])
    assert "compression_cpu_seconds" not in older[0]["ours"] and compression_table(older) == ""


def test_a_report_of_criticalkv_alone_gets_one_row_and_one_bar_per_preset(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--systems ours`` over every preset: no kvpress columns, the compression where a method has one, and one bar
    per (method, length) in the plot (its line plots would draw ten methods of two dozen); a method that ran at one
    length only gets an empty bar at the other."""

    import plot_benchmarks

    runs = [_run("ours", "full", 3.0, 1000)] + [
        {**_run("ours", method, t, 200), "compression_cpu_seconds": t / 10}
        for method in ("snapkv", "tova")
        for t in (2.0, 4.0)
    ]
    longer = [{**r, "length": 2048, "prompt_tokens": 2044} for r in runs if r["method"] != "tova"]
    summary = summarise(runs + longer, [1024, 2048], ["full", "snapkv", "tova"], ["ours"])
    both = summarise([*runs, _run("kvpress", "snapkv", 3.0, 200)], [1024], ["snapkv"], ["ours", "kvpress"])
    assert ours_alone(summary) and not ours_alone(both) and not ours_alone([])
    table = presets_table(summary, "cpu")
    assert "| 1020 | full | 3.00 | – | 10.0 | 0.0 (100.0%) | 0 |" in table
    assert "| 1020 | tova | 3.00 | 0.300 | 10.0 | 0.0 (20.0%) | 0 |" in table
    assert "| 2044 | snapkv | 3.00 | 0.300 |" in table and "| 2044 | tova |" not in table
    assert "| 1020 | tova | 3.00 | 0.300 | 10.0 | 0.0 (20.0%) |\n" in presets_table(summary, "cpu", live_rss=False)
    plot_presets(summary, "cpu", "every preset", tmp_path / "presets.png")
    assert (tmp_path / "presets.png").stat().st_size > 0
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"summary": summary, "runs": runs + longer, "model": "m", "budget": 0.2}))
    args = ["plot_benchmarks.py", "--speed", str(report), "--tag", "t", "--out-dir", str(tmp_path), "--tables"]
    monkeypatch.setattr(sys, "argv", args)
    plot_benchmarks.main()
    printed = capsys.readouterr().out
    assert "criticalkv alone" in printed and "kvpress" not in printed and "peak RSS" in printed  # no command: mmap
    assert (tmp_path / "t_presets.png").exists() and not (tmp_path / "t_time.png").exists()


def test_line_plots_draw_every_method_in_its_own_colour(tmp_path: Path, monkeypatch) -> None:
    """Twelve methods on both systems: 24 lines, 12 colours (matplotlib's default cycle has 10)."""
    import plot_benchmarks

    methods = [f"m{i}" for i in range(12)]
    runs = [_run(system, m, 1.0 + i, 100) for i, m in enumerate(methods) for system in ("ours", "kvpress")]
    summary = summarise(runs, [1024], methods, ["ours", "kvpress"])
    drawn = []
    monkeypatch.setattr(plot_benchmarks.plt, "close", drawn.append)
    plot_benchmarks._against_length(summary, [("kv_bytes", "KV", 1.0)], "t", tmp_path / "kv.png")
    lines = drawn[0].axes[0].get_lines()
    assert sorted(line.get_label() for line in lines) == sorted(
        f"{m} ({plot_benchmarks.SYSTEM_NAME[s]})" for m in methods for s in ("ours", "kvpress")
    )
    assert len({line.get_color() for line in lines}) == 12


def test_kvpress_hook_clock_sums_the_hooks_time_and_passes_their_results() -> None:
    """kvpress's side: ``HookClock`` wraps a press's ``forward_hook`` (no kvpress needed: any object with one)."""
    from speed_kvpress import HookClock

    class Press:
        def forward_hook(self, module, inputs, kwargs, output):
            if output is None:
                raise ValueError("no output")
            return sum(i * i for i in range(200_000)) and output  # some CPU time, then the output unchanged

    press, clock = Press(), HookClock()
    clock.wrap(press)
    assert clock() == 0.0
    assert press.forward_hook(None, [], {}, "out") == "out"
    first = clock()
    assert first > 0
    with pytest.raises(ValueError, match="no output"):
        press.forward_hook(None, [], {}, None)
    assert clock() >= first  # a hook that raises still counts


def test_gpu_benchmark_method_specs_and_summary() -> None:
    from gpu_speed_memory import parse_spec
    from gpu_speed_memory import summarise as summarise_gpu

    assert parse_spec("critical-adakv") == ("critical-adakv", {}, "auto")
    assert parse_spec("critical-snapkv@norm_dtype=model@window=16") == (
        "critical-snapkv",
        {"norm_dtype": "model", "window": 16},
        "auto",
    )
    assert parse_spec("adakv@attention=segments") == ("adakv", {}, "segments")
    run = {"ttft_seconds": 2.0, "decode_ms_per_token_median": 10.0, "kv_bytes": 100, "peak_cuda_above_start_bytes": 50}
    runs = [
        {"length": 8, "batch": 1, "method": "full", **run},
        {"length": 8, "batch": 1, "method": "snapkv", **run, "kv_bytes": 20, "ttft_seconds": 1.0},
        {"length": 8, "batch": 1, "method": "snapkv", **run, "kv_bytes": 20, "ttft_seconds": 3.0},
        {"length": 8, "batch": 4, "method": "snapkv", **run},  # no full run at batch 4: no ratios
    ]
    rows = {(r["batch"], r["method"]): r for r in summarise_gpu(runs)}
    assert rows[1, "snapkv"]["repeats"] == 2 and rows[1, "snapkv"]["ttft_seconds"] == 2.0
    assert rows[1, "snapkv"]["relative_to_full"]["kv_bytes"] == 0.2
    assert rows[1, "full"]["relative_to_full"]["ttft_seconds"] == 1.0
    assert "relative_to_full" not in rows[4, "snapkv"]


def test_fastest_table_takes_each_systems_fastest_repeat() -> None:
    def run(repeat: int, method: str, system: str, ttft: float, decode: float) -> dict:
        return {
            "repeat": repeat,
            "length": 2048,
            "method": method,
            "system": system,
            "ttft_cpu_seconds": ttft,
            "decode_cpu_ms_per_token_median": decode,
        }

    runs = [
        run(0, "snapkv", "ours", 4.0, 60.0),
        run(0, "snapkv", "kvpress", 5.0, 50.0),
        run(1, "snapkv", "ours", 3.0, 70.0),
        run(1, "snapkv", "kvpress", 6.0, 40.0),
        run(0, "measured-snapkv", "ours", 1.0, 1.0),  # no kvpress twin: no row
    ]
    rows = [line for line in fastest_table(runs, "cpu").splitlines() if line.startswith("| 2048")]
    assert rows == ["| 2048 | snapkv | 0.600 | 1.500 |"]


def test_paired_table_divides_within_each_repeat() -> None:
    def run(repeat: int, system: str, ttft: float, decode: float, method: str = "snapkv") -> dict:
        return {
            "repeat": repeat,
            "length": 4096,
            "method": method,
            "system": system,
            "ttft_cpu_seconds": ttft,
            "decode_cpu_ms_per_token_median": decode,
        }

    # pairs of one repeat: TTFT 0.90, 0.95, 3.22 (median 0.95, ours lower twice), decoding 1.0, 1.5, 0.5 (once)
    runs = [
        run(0, "ours", 9.0, 10.0),
        run(0, "kvpress", 10.0, 10.0),
        run(1, "ours", 19.0, 30.0),
        run(1, "kvpress", 20.0, 20.0),
        run(2, "ours", 29.0, 10.0),
        run(2, "kvpress", 9.0, 20.0),
        run(3, "ours", 10.0, 20.0),  # no kvpress run in repeat 3: not a pair
        run(0, "ours", 1.0, 1.0, method="measured-snapkv"),  # no kvpress twin: no row
    ]
    rows = [line for line in paired_table(runs, "cpu").splitlines() if line.startswith("| 4096")]
    assert rows == ["| 4096 | snapkv | 3 | 0.950 | 2 | 1.000 | 1 |"]


def test_answer_cells_start_near_the_first_difference_on_one_line() -> None:
    common = ":\n\n1. 1138554\n2. 1138556\n3. 1138557\n4. 1138558\n5. 1138560\n"
    ours, theirs = answer_cells(common + "\nThese | numbers", common + "6. 1138561\n7.", context=8, width=25)
    assert ours == "…1138560⏎⏎These / numbers"
    assert theirs == "…1138560⏎6. 1138561⏎7."
    assert answer_cells("same", "same") == ("same", "same")
    assert answer_cells("ab", "abc") == ("ab", "abc")
    long = "x" * 30
    assert answer_cells(long + "a", long + "b", context=5, width=4) == ("…xxxx…", "…xxxx…")


def test_allocator_setting_reaches_the_measurement_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    names = "('MALLOC_MMAP_THRESHOLD_', 'MALLOC_MMAP_MAX_', 'MALLOC_TRIM_THRESHOLD_')"
    show = [sys.executable, "-c", f"import json, os; print(json.dumps([os.environ.get(n) for n in {names}]))"]
    assert run_child(show, "mmap") == ["65536", None, None]
    assert run_child(show, "glibc") == [None, None, None]
    assert run_child(show, "retain") == [None, "0", str(2**62)]  # never mmapped, never trimmed
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert run_child(show, "mmap") == ["131072", None, None]  # a threshold the user set is kept
    assert run_child(show, "glibc") == [None, None, None]
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")  # a retain setting of the caller's own does not leak into mmap
    assert run_child(show, "mmap") == ["131072", None, None]
    with pytest.raises(ValueError, match="allocator"):
        run_child(show, "jemalloc")


def _tiny_shape_folder(folder: Path, tokenizer) -> Path:
    """A folder of a 2-layer Llama's config.json and a tokenizer, as a shape to draw weights for."""
    from test_sweep import _tiny_model
    from transformers import LlamaConfig

    folder.mkdir()
    _tiny_model(LlamaConfig, tokenizer).config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "criticalkv-preset.json").write_text("{}")  # a converted preset's marker: must not be copied
    return folder


def test_random_weights_follow_the_seed_and_keep_the_shape(tmp_path: Path, tiny_tokenizer) -> None:
    import torch
    from random_weights import write_random_model
    from safetensors.torch import load_file

    shape = _tiny_shape_folder(tmp_path / "shape", tiny_tokenizer)
    a, b, c = (write_random_model(shape, tmp_path / name, seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    weights = [load_file(folder / "model.safetensors") for folder in (a, b, c)]
    assert weights[0].keys() == weights[2].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # same seed, same weights
    assert not torch.equal(
        weights[0]["model.layers.0.self_attn.q_proj.weight"], weights[2]["model.layers.0.self_attn.q_proj.weight"]
    )
    assert weights[0]["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 KV heads of 16
    assert weights[0]["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    assert (a / "tokenizer.json").is_file() and not (a / "criticalkv-preset.json").exists()
    with pytest.raises(SystemExit, match="not empty"):
        write_random_model(shape, a)


def test_one_process_times_several_runs_of_the_same_generation(tmp_path: Path, tiny_tokenizer) -> None:
    """``--runs-per-process N``: one warm-up, then N timed generations of the same prompt, the same tokens."""

    from random_weights import write_random_model

    folder = write_random_model(_tiny_shape_folder(tmp_path / "shape", tiny_tokenizer), tmp_path / "model", seed=0)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"input_ids": [[(7 * i) % 290 + 2 for i in range(96)]]}))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "speed_memory.py"
    command = [sys.executable, str(script), "--single", "snapkv", "--ids", str(ids), "--model", str(folder)]
    command += ["--budget", "0.5", "--decode-steps", "3", "--warmup-tokens", "16", "--runs-per-process", "2"]
    runs = run_child(command, "glibc")
    assert [r["run_in_process"] for r in runs] == [0, 1]
    assert runs[0]["generated"] == runs[1]["generated"] and len(runs[0]["generated"]) == 4
    assert runs[0]["kv_entries"] == runs[1]["kv_entries"] and runs[0]["method"] == "snapkv"
    # each run's own compression time (the compressor's running total read around its prefill), inside its TTFT
    assert all(0 < r["compression_cpu_seconds"] <= r["ttft_cpu_seconds"] for r in runs)
    assert all(isinstance(r["prefill_minor_faults"], int) and r["prefill_minor_faults"] >= 0 for r in runs)


def test_prefill_page_faults_count_memory_first_touched_inside_the_prefill(tiny_tokenizer) -> None:
    """``timed_greedy``'s fault count spans the prefill: 64 MiB written afresh inside it are faults it sees."""
    import contextlib

    import torch
    from test_sweep import _tiny_model
    from timed_generation import timed_greedy
    from transformers import DynamicCache, LlamaConfig

    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer)

    @contextlib.contextmanager
    def touch_fresh_memory():
        fresh = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold, so new pages, all written
        yield
        del fresh

    ids = torch.randint(2, len(tiny_tokenizer), (1, 32))
    result = timed_greedy(model, ids, DynamicCache(config=model.config), 1, prefill_scope=touch_fresh_memory)
    # 16384 pages of 4 KiB; 32 if the kernel backs them with 2 MiB pages: at least that many either way
    assert result["prefill_minor_faults"] >= 32


def test_prefill_operator_count_sees_compression_and_host_reads(tiny_tokenizer) -> None:
    """The full cache's prefill reads nothing back to the host; compression adds operators and host reads."""
    import torch
    from test_sweep import _tiny_model
    from timed_generation import count_prefill_ops
    from transformers import DynamicCache, LlamaConfig

    import criticalkv

    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer)
    config = model.config
    ids = torch.randint(2, len(tiny_tokenizer), (1, 96))
    full = count_prefill_ops(model, ids, DynamicCache(config=config))
    with criticalkv.compress(model, "snapkv", 0.5):
        snap = count_prefill_ops(model, ids, DynamicCache(config=config))
    assert full["prefill_host_reads"] == 0 and full["prefill_dispatched_ops"] > 0
    assert 0 < full["prefill_launching_ops"] < full["prefill_dispatched_ops"]  # views and allocations launch nothing
    assert snap["prefill_dispatched_ops"] > full["prefill_dispatched_ops"]
    # four per forward, none per layer: the budget's check, the plan (rows kept whole, whether the rows keep as
    # many entries), the padding, and the top-k width; with every head keeping its row's budget the width is the
    # same in every layer, and the kept entries are gathered without counting them
    assert snap["prefill_host_reads"] == 4
    # CriticalKV without its value-norm screen (as on a GPU with float32 values): both stages' top-k widths once per
    # forward (one Tensor.tolist, which dispatches no operator: counted by wrapping it), none per layer: SnapKV's
    # scores are attention probabilities, non-negative by construction, so their sign is not checked
    with criticalkv.compress(model, "critical-snapkv", 0.5, screen=False):
        critical = count_prefill_ops(model, ids, DynamicCache(config=config))
    assert critical["prefill_host_reads"] == 4
    # the l2 screen, which runs on CPUs only (where a host read waits for nothing), reads per layer which entries of
    # each head it computes: two reads for the heads (their positions and that list) and one per head, in each of
    # its two rounds
    with criticalkv.compress(model, "critical-snapkv", 0.5):
        screened = count_prefill_ops(model, ids, DynamicCache(config=config))
    h_kv = config.num_key_value_heads
    assert screened["prefill_host_reads"] == 4 + 2 * (2 + h_kv) * config.num_hidden_layers

    # a scorer that does not declare its scores non-negative has them checked: one read per layer
    class UndeclaredSnapKV(criticalkv.scorers.SnapKVScorer):  # SnapKV's scores, not said to be non-negative
        non_negative = False

    unchecked = criticalkv.Method(UndeclaredSnapKV(), selector=criticalkv.selectors.CriticalSelector(screen=False))
    with criticalkv.compress(model, unchecked, 0.5):
        checked = count_prefill_ops(model, ids, DynamicCache(config=config))
    assert checked["prefill_host_reads"] == 4 + config.num_hidden_layers
    # AdaKV: its two widths from the budgets alone once per forward; per layer the selector's width of the head
    # budgets it allotted, and the kept counts (they differ per head)
    with criticalkv.compress(model, "adakv", 0.5):
        ada = count_prefill_ops(model, ids, DynamicCache(config=config))
    assert ada["prefill_host_reads"] == 4 + 2 * config.num_hidden_layers
    # rows of other lengths keep other counts: the kept entries are counted in every layer (one read each), beyond
    # the reads of the full cache's padded prefill (transformers' mask) and the runtime's check of left padding
    mask = torch.ones(2, 96, dtype=torch.long)
    mask[1, :40] = 0
    padded_full = count_prefill_ops(model, ids.expand(2, -1), DynamicCache(config=config), attention_mask=mask)
    with criticalkv.compress(model, "snapkv", 0.5):
        padded = count_prefill_ops(model, ids.expand(2, -1), DynamicCache(config=config), attention_mask=mask)
    assert padded["prefill_host_reads"] - padded_full["prefill_host_reads"] == 5 + config.num_hidden_layers


def test_gpu_block_sizes_counts_the_windows_logits_as_one_product(tiny_tokenizer) -> None:
    """On a CPU the window's logits are products over 512 keys at a time; counted with a GPU's block sizes, a prompt
    of 600 tokens dispatches fewer operators, and the CPU's sizes are back afterwards."""
    import torch
    from speed_memory import gpu_block_sizes
    from test_sweep import _tiny_model
    from timed_generation import count_prefill_ops
    from transformers import DynamicCache, LlamaConfig

    import criticalkv
    from criticalkv.scorers import base

    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer)
    ids = torch.randint(2, len(tiny_tokenizer), (1, 600))
    with criticalkv.compress(model, "snapkv", 0.5):
        on_cpu = count_prefill_ops(model, ids, DynamicCache(config=model.config))
        with gpu_block_sizes():
            as_on_gpu = count_prefill_ops(model, ids, DynamicCache(config=model.config))
    assert as_on_gpu["prefill_dispatched_ops"] < on_cpu["prefill_dispatched_ops"]
    assert as_on_gpu["prefill_host_reads"] == on_cpu["prefill_host_reads"]
    assert base.CPU_KEY_CHUNK == 512


def test_phase_clock_counts_a_nested_phase_in_its_own_phase_only() -> None:
    """A step wrapped as its own phase inside an attention module (criticalkv compresses there) leaves that module's
    phase: its CPU time and the 64 MiB it writes afresh are the step's, and each phase counts its calls."""
    import time

    import torch
    from timed_generation import PhaseClock
    from torch import nn

    class Step:
        def run(self) -> None:
            fresh = torch.ones(16 * 2**20)  # 64 MiB written afresh: pages the kernel maps in
            start = time.process_time()
            while time.process_time() - start < 0.05:
                pass
            del fresh

    step = Step()

    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            step.run()
            return x

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = Attention(), nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.self_attn(x))

    model = nn.Sequential(Layer(), Layer())
    clock = PhaseClock(model)
    clock.wrap(step, "run", "compression")
    model(torch.zeros(3))
    phases = clock.snapshot()
    assert {phase: p["calls"] for phase, p in phases.items()} == {"attention": 2, "mlp": 2, "compression": 2}
    assert phases["compression"]["cpu_seconds"] >= 0.1
    assert phases["attention"]["cpu_seconds"] < 0.02  # the modules themselves do nothing
    assert phases["compression"]["minor_faults"] >= 64  # 2 x 16384 pages of 4 KiB, or 2 x 32 of 2 MiB
    assert phases["attention"]["minor_faults"] < phases["compression"]["minor_faults"] / 4
    clock.reset()
    assert clock.snapshot() == {}


def test_timed_prefill_splits_into_phases_with_compression_apart(tiny_tokenizer) -> None:
    """With a phase clock, each layer's attention and MLP are counted once per prefill and the compression apart;
    the phases fit inside the prefill's CPU time."""
    import torch
    from test_sweep import _tiny_model
    from timed_generation import PhaseClock, timed_greedy
    from transformers import DynamicCache, LlamaConfig

    import criticalkv

    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer)
    layers = model.config.num_hidden_layers
    clock = PhaseClock(model)
    ids = torch.randint(2, len(tiny_tokenizer), (1, 96))
    with criticalkv.compress(model, "snapkv", 0.5) as compressor:
        clock.wrap(compressor, "compress_layer", "compression")
        result = timed_greedy(model, ids, DynamicCache(config=model.config), 2, phase_clock=clock)
    phases = result["prefill_phases"]
    assert {phase: p["calls"] for phase, p in phases.items()} == {
        "attention": layers,
        "mlp": layers,
        "compression": layers,
    }  # the prefill only: the two decode steps are not in it
    assert sum(p["cpu_seconds"] for p in phases.values()) <= result["ttft_cpu_seconds"]
    assert all(p["cpu_seconds"] > 0 for p in phases.values())


def _same_process_run(label: str, repeat: int, ttft: float, compression: float, decode_ms: float) -> dict:
    return {
        "label": label,
        "repeat": repeat,
        "ttft_cpu_seconds": ttft,
        "compression_cpu_seconds": compression,
        "decode_cpu_ms_per_token_median": decode_ms,
        "kv_bytes": 100 if label.startswith("ours") else 500,
        "prefill_minor_faults": 3 if label.startswith("ours") else 0,
        "generated": [1, 2, 3],
    }


def test_same_process_summary_pairs_each_repeats_systems() -> None:
    """Ratio of medians beside the median of the per-repeat ratios; ours lower counted; rest = TTFT - compression."""
    from same_process import summarise as summarise_same

    runs = [_same_process_run("full", k, 9.0 + k, 0.0, 50.0) for k in range(3)]
    for k, (ours, theirs) in enumerate([(10.0, 11.0), (12.0, 11.0), (8.0, 10.0)]):
        runs.append(_same_process_run("ours:snapkv", k, ours, 0.1, 40.0))
        runs.append(_same_process_run("kvpress:snapkv", k, theirs, 0.3, 50.0))
    s = summarise_same(runs, ["snapkv"])["snapkv"]
    assert s["repeats"] == 3 and s["ttft_ours"] == 10.0 and s["ttft_kvpress"] == 11.0
    assert s["ttft_ratio"] == pytest.approx(10 / 11)
    assert s["ttft_within"] == pytest.approx(10 / 11) and s["ttft_ours_lower"] == 2  # ratios 0.909, 1.091, 0.8
    assert s["rest_ours"] == pytest.approx(9.9) and s["rest_kvpress"] == pytest.approx(10.7)
    assert s["compression_ratio"] == pytest.approx(1 / 3) and s["decode_ms_within"] == pytest.approx(0.8)
    assert (s["kv_bytes_ours"], s["kv_bytes_kvpress"], s["first_difference"]) == (100, 500, None)
    assert (s["faults_ours"], s["faults_kvpress"]) == (3, 0)
    runs[-1]["generated"] = [1, 2, 4]
    assert summarise_same(runs, ["snapkv"])["snapkv"]["first_difference"] == 2
    assert summarise_same(runs, ["snapkv"])["full"] == {"repeats": 3, "ttft_median": 10.0}
    within = [10 / 11, 12 / 11, 0.8]
    assert s["ttft_within_mean"] == pytest.approx(sum(within) / 3)
    assert s["ttft_within_standard_error"] == pytest.approx(statistics.stdev(within) / 3**0.5)
    assert "full" not in summarise_same([r for r in runs if r["label"] != "full"], ["snapkv"])  # --no-control
    for run in runs:  # --decode-steps 0: no decode figure, the prefill's still summarised
        run["decode_cpu_ms_per_token_median"] = math.nan
    s = summarise_same(runs, ["snapkv"])["snapkv"]
    assert math.isnan(s["decode_ms_within_standard_error"]) and s["ttft_within_mean"] == pytest.approx(sum(within) / 3)


def test_same_process_adapter_gives_a_press_hook_the_cache_and_positions(tiny_tokenizer) -> None:
    """Under transformers 5.x the attention modules get ``cache``: the adapter, run before a press's hook, hands it
    over as ``past_key_values`` with the forward's positions; it is removed with the press."""
    import torch
    from same_process import adapted
    from test_sweep import _tiny_model
    from transformers import DynamicCache, LlamaConfig

    from criticalkv.models.families import attention_modules

    model = _tiny_model(LlamaConfig, tiny_tokenizer)
    seen = []

    class Press:  # registers its hook as kvpress's BasePress.__call__ does
        @contextlib.contextmanager
        def __call__(self, model):
            def hook(module, args, kwargs, output):
                seen.append((module.layer_idx, kwargs["past_key_values"] is cache, kwargs["cache_position"].tolist()))

            handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
            yield
            for handle in handles:
                handle.remove()

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        with adapted(model, Press()):
            model(input_ids=torch.arange(2, 7)[None], cache=cache, use_cache=True)
        assert seen == [(i, True, [0, 1, 2, 3, 4]) for i in range(model.config.num_hidden_layers)]
        with adapted(model, Press()):
            model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
        assert seen[-1] == (model.config.num_hidden_layers - 1, True, [5])
        count = len(seen)
        model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)  # outside: no hook left behind
    assert len(seen) == count


def test_same_process_table_and_ratios_read_each_repeat() -> None:
    from plot_benchmarks import same_process_ratios, same_process_table
    from same_process import summarise as summarise_same

    runs = [_same_process_run("full", k, 9.0, 0.0, 50.0) for k in range(2)]
    for k, (ours, theirs) in enumerate([(10.0, 8.0), (9.0, 10.0)]):
        runs.append(_same_process_run("ours:critical-adakv", k, ours, 0.5, 30.0))
        runs.append(_same_process_run("kvpress:critical-adakv", k, theirs, 1.0, 60.0))
    report = {"model": "m", "prompt_tokens": 2048, "runs": runs, "summary": summarise_same(runs, ["critical-adakv"])}
    assert same_process_ratios(report, "critical-adakv", "ttft_cpu_seconds") == [1.25, 0.9]
    table = same_process_table([report])
    assert table.count("\n") == 2  # header, rule, one row: the full control is a column, not a row
    row = "| m | 2048 | critical-adakv | 2 | 9.50 / 9.00 | 1.056 | 1.075, 1 of 2 | 9.00 | 0.500 / 1.000 |"
    assert row in table and table.endswith("| 30.0 / 60.0 | 0.500 | 0.200 | identical |")
    uncontrolled = [r for r in runs if r["label"] != "full"]  # --no-control
    report |= {"runs": uncontrolled, "summary": summarise_same(uncontrolled, ["critical-adakv"])}
    assert "| 1.075, 1 of 2 | not run | 0.500 / 1.000 |" in same_process_table([report])


def test_pairs_table_reads_prefills_alone(tmp_path: Path) -> None:
    """Reports without the control or decode steps: the within-pair mean and its standard error, and the ratio the
    compression times alone would give (kvpress's median TTFT less the difference of the compression medians)."""
    from plot_benchmarks import pairs_table, plot_pairs
    from same_process import summarise as summarise_same

    runs = []
    for k, (ours, theirs) in enumerate([(9.0, 10.0), (10.0, 10.0), (11.0, 10.0)]):
        runs.append(_same_process_run("ours:snapkv", k, ours, 0.1, math.nan))
        runs.append(_same_process_run("kvpress:snapkv", k, theirs, 0.3, math.nan))
    report = {"model": "m", "prompt_tokens": 2048, "budget": "0.2", "runs": runs}
    report["summary"] = summarise_same(runs, ["snapkv"])
    table = pairs_table([report])
    se = statistics.stdev([0.9, 1.0, 1.1]) / 3**0.5
    row = f"| m | 2048 | snapkv | 3 | 10.000 / 10.000 | 1.0000 | 1.0000 ± {se:.4f} | 1.0000 | 1 | 0.100 / 0.300 "
    row += "| 0.9800 |"
    assert table.count("\n") == 2 and row in table
    plot_pairs([report], "pairs", tmp_path / "pairs.png")
    assert (tmp_path / "pairs.png").stat().st_size > 0


def test_window_attention_benchmarks_baseline_is_the_same_attention() -> None:
    """benchmarks/window_attention.py times one product and a fresh softmax against criticalkv's key blocks and
    softmax in place: on a left-padded view of three key blocks, the same values to the bit."""
    import torch
    from torch import nn
    from window_attention import one_product

    from criticalkv.scorers.base import CPU_KEY_CHUNK, LayerView, window_attention

    gen = torch.Generator().manual_seed(0)
    t = 2 * CPU_KEY_CHUNK + 77
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :40] = False
    module = nn.Module()
    query, keys = torch.randn(2, 6, t, 16, generator=gen), torch.randn(2, 2, t, 16, generator=gen)
    view = LayerView(module, query.bfloat16(), keys.bfloat16(), keys.bfloat16(), valid, 0.25)
    assert torch.equal(window_attention(view, 8), one_product(view, 8))


def test_rerun_under_starts_the_script_again_under_the_allocator_once(tmp_path: Path) -> None:
    """glibc reads its settings at start: the script runs again (exec) with them and the marker set, then goes on."""
    import os
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent / 'benchmarks')!r})\n"
        "from timed_generation import rerun_under\n"
        "print('started', flush=True)\n"
        "setting = rerun_under(sys.argv[1], 'TEST_RERUN')\n"
        "malloc = {k: v for k, v in os.environ.items() if k.startswith('MALLOC_')}\n"
        "print(json.dumps([setting, sys.argv[1:], malloc, sys.flags.utf8_mode]))\n"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "TEST_RERUN"))}

    def lines(allocator: str, env: dict, flags: tuple[str, ...] = ()) -> list[str]:
        run = subprocess.run([sys.executable, *flags, str(script), allocator], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    printed = lines("retain", environment, ("-X", "utf8"))  # an interpreter flag, kept by the run again
    assert printed[:2] == ["started", "started"] and len(printed) == 3  # run again once, not in a loop
    assert json.loads(printed[2]) == [
        "retain", ["retain"], {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}, 1
    ]  # fmt: skip
    # "mmap": every tensor buffer mmapped (a 64 KiB threshold), so peak RSS follows live memory
    assert json.loads(lines("mmap", environment)[2])[2] == {"MALLOC_MMAP_THRESHOLD_": "65536"}
    # already under the marker (the run again): no exec, the marker's setting, the environment as it is
    printed = lines("retain", {**environment, "TEST_RERUN": "mmap"})
    assert printed[0] == "started" and json.loads(printed[1]) == ["mmap", ["retain"], {}, 0]


def _sweep_folder(path: Path, scores: dict) -> Path:
    """A sweep folder of aware rows, {(task, index, method, budget): score}."""
    from dataclasses import asdict

    from criticalkv.eval.sweep import Row

    path.mkdir()
    rows = [Row(t, i, "aware", m, b, s, "", 100, 1.0) for (t, i, m, b), s in scores.items()]
    (path / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    return path


def test_compare_sweeps_pairs_the_samples_both_folders_answered(tmp_path):
    def folder(name, scores):
        return _sweep_folder(tmp_path / name, scores)

    one_shot = {("a", 0, "full", 1.0): 100.0, ("a", 1, "full", 1.0): 50.0, ("b", 0, "full", 1.0): 0.0}
    one_shot |= {("a", 0, "snapkv", 1024): 100.0, ("a", 1, "snapkv", 1024): 0.0, ("b", 0, "snapkv", 1024): 0.0}
    chunked = {("a", 0, "full", 1.0): 100.0, ("a", 1, "full", 1.0): 50.0}  # b #0 not answered yet
    chunked |= {("a", 0, "snapkv", 1024): 0.0, ("a", 1, "snapkv", 1024): 0.0, ("c", 0, "snapkv", 1024): 100.0}
    entries = {e["method"]: e for e in compare(folder("one-shot", one_shot), folder("chunked", chunked))}
    assert entries["full"]["samples"] == 2 and entries["full"]["difference"] == 0.0
    assert entries["full"]["interval"] == (0.0, 0.0)
    snap = entries["snapkv"]
    assert snap["budget"] == "1024" and snap["samples"] == 2 and snap["means"] == [50.0, 0.0]
    assert snap["difference"] == -50.0 and snap["interval"][0] <= -50.0 <= snap["interval"][1]
    assert (snap["better"], snap["worse"]) == (0, 1)


def test_compare_sweeps_pairs_two_methods_of_one_folder(tmp_path):
    """``pairs``: the first folder's method against another method of the second (here the same folder); the full
    cache beside them."""
    scores = {("a", i, "full", 1.0): 100.0 for i in range(3)}
    scores |= {("a", 0, "m", 0.2): 0.0, ("a", 1, "m", 0.2): 50.0, ("a", 2, "m", 0.2): 100.0}
    scores |= {("a", 0, "m:x=1", 0.2): 100.0, ("a", 1, "m:x=1", 0.2): 50.0, ("a", 2, "m:x=1", 0.2): 0.0}
    scores |= {("a", 0, "m:x=1", 0.4): 100.0}  # no first-method row at 0.4: no entry
    one = _sweep_folder(tmp_path / "one", scores)
    entries = compare(one, one, [("m", "m:x=1")])
    assert [e["method"] for e in entries] == ["full", "m vs m:x=1"]
    assert entries[0]["difference"] == 0.0 and (entries[0]["better"], entries[0]["worse"]) == (0, 0)
    pair = entries[1]
    assert pair["budget"] == "0.2" and pair["samples"] == 3 and pair["means"] == [50.0, 50.0]
    assert (pair["better"], pair["worse"]) == (1, 1) and pair["difference"] == 0.0


def test_the_headline_table_puts_each_models_figures_in_its_column(tmp_path):
    """Mean, loss and loss ratio of every (method, budget), one column per folder; a pair one folder lacks is "not
    run"; a ratio whose base loses nothing in some resample has an n/a interval."""
    big = {("a", i, "full", 1.0): 100.0 for i in range(4)}
    big |= {("a", i, "snapkv", 0.2): s for i, s in enumerate([0.0, 0.0, 100.0, 100.0])}  # loss 50%
    big |= {("a", i, "critical-snapkv", 0.2): s for i, s in enumerate([0.0, 100.0, 100.0, 100.0])}  # loss 25%
    small = {("a", i, "full", 1.0): 100.0 for i in range(2)} | {("a", i, "snapkv", 0.2): 100.0 for i in range(2)}
    text = table({"big": _sweep_folder(tmp_path / "big", big), "small": _sweep_folder(tmp_path / "s", small)}, "aware")
    lines = text.splitlines()
    assert lines[0] == "| method | budget | big (4 samples, 4 per task) | small (2 samples, 2 per task) |"
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[3:5] for line in lines[2:]}
    assert [key[0] for key in rows] == ["`full`", "`snapkv`", "`critical-snapkv`"]
    big_snap, small_snap = (cell.strip() for cell in rows[("`snapkv`", "0.2")])
    assert big_snap.startswith("50.0 · 50.0% (") and small_snap == "100.0 · 0.0% (0.0 to 0.0)"
    big_critical, small_critical = (cell.strip() for cell in rows[("`critical-snapkv`", "0.2")])
    assert big_critical.startswith("75.0 · 25.0% (") and " · 0.50 (" in big_critical
    assert small_critical == "not run"


def test_the_headline_table_can_keep_only_the_samples_every_method_answered(tmp_path):
    """A method that has answered 2 of 4 samples so far: with ``common`` every row of the column is on those 2."""
    rows = {("a", i, "full", 1.0): 100.0 for i in range(4)}
    rows |= {("a", i, "snapkv", 0.2): s for i, s in enumerate([0.0, 100.0, 100.0, 100.0])}
    rows |= {("a", i, "new", 0.2): 100.0 for i in range(2)}
    folder = _sweep_folder(tmp_path / "f", rows)
    every, common = table({"f": folder}, "aware"), table({"f": folder}, "aware", common=True)
    assert "(4 samples, 2-4 per task)" in every.splitlines()[0] and "`snapkv` | 0.2 | 75.0 ·" in every
    assert "(2 samples, 2 per task)" in common.splitlines()[0] and "`snapkv` | 0.2 | 50.0 ·" in common


def test_the_headline_plot_draws_each_models_loss_ratios_in_a_panel(tmp_path):
    """A panel per folder; in each, a line per CriticalKV variant through its loss ratio at each budget that has an
    interval (0.5 at 0.2: the base loses 100% in every resample, the variant 50%; at 0.4 the base loses nothing in
    some resample, so its ratio is left out), the 0.5 line drawn, one legend naming every variant."""
    big = {("a", i, "full", 1.0): 100.0 for i in range(4)}
    for budget, base, variant in ((0.2, [0] * 4, [0, 0, 100, 100]), (0.4, [0, 100, 100, 100], [0] * 4)):
        big |= {("a", i, "snapkv", budget): s for i, s in enumerate(base)}
        big |= {("a", i, "critical-snapkv", budget): s for i, s in enumerate(variant)}
    small = {("a", i, "full", 1.0): 100.0 for i in range(2)} | {("a", i, "snapkv", 0.2): 0.0 for i in range(2)}
    small |= {("a", i, "critical-snapkv", 0.2): 100.0 * i for i in range(2)}
    folders = {"big": _sweep_folder(tmp_path / "big", big), "small": _sweep_folder(tmp_path / "s", small)}
    fig = ratio_plot(folders, "aware", tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").stat().st_size > 0
    big_ax, small_ax = fig.axes
    assert (big_ax.get_title(), small_ax.get_title()) == ("big", "small")
    [big_bars] = [bars for bars in big_ax.containers if bars.get_label() == "critical-snapkv"]
    assert list(big_bars.lines[0].get_ydata()) == [0.5]  # 50% over 100%; 0.4's 100% over 25% has no interval
    [small_bars] = [bars for bars in small_ax.containers if bars.get_label() == "critical-snapkv"]
    assert list(small_bars.lines[0].get_ydata()) == [0.5]
    assert any(list(line.get_ydata()) == [0.5, 0.5] for line in big_ax.get_lines())
    assert [text.get_text() for text in small_ax.get_legend().get_texts()] == ["critical-snapkv"]


def test_gpu_layer_costs_time_every_piece_each_method_calls(monkeypatch) -> None:
    """``gpu_selection_cost.layer_costs`` on the CPU (the synchronisation made a no-op): one decoder-layer time per
    layer and prefill, a compression step per layer for compressing methods only, value norms for CriticalKV's."""
    import torch
    from gpu_selection_cost import layer_costs
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = {
        r["method"]: r for r in layer_costs(model, ["full", "snapkv", "critical-snapkv:screen=false"], "0.2", 2, 96, 2)
    }
    assert rows["full"]["decoder layer calls"] == 4 and "compression ms" not in rows["full"]
    assert rows["snapkv"]["compression calls"] == rows["snapkv"]["scoring calls"] == 4
    assert "value norms ms" not in rows["snapkv"]
    assert rows["critical-snapkv:screen=false"]["value norms calls"] == 4  # the screen (CPU) is off on a GPU
    assert all(v > 0 for r in rows.values() for k, v in r.items() if k.endswith(" ms"))


def test_surrogate_maps_records_the_prefills_attention_input_and_fits_deterministically(tiny_tokenizer) -> None:
    import torch
    from surrogate_maps import fit_figures, gather, linear_candidate, mlp_candidate
    from test_surrogate import _model, _text

    from criticalkv.scorers.reconstruct import ReconstructionScorer
    from criticalkv.training.surrogate import window_ids

    model = _model()
    windows = window_ids(tiny_tokenizer, _text().text, 3, 64, torch.Generator().manual_seed(0))
    scorer = ReconstructionScorer(chunk_size=32, tokenizer=tiny_tokenizer)
    rows = [gather(model, ids, scorer) for ids in windows]
    train, held_out = rows[:2], rows[2:]
    assert sorted(train[0]) == [0, 1]
    for layer, layer_rows in train[0].items():
        # the recorded hidden states are the prefill's attention input: its value projection gives the cached values
        v_proj = model.model.layers[layer].self_attn.v_proj.weight  # (h_kv * d, D)
        values = (layer_rows.hidden @ v_proj.T).reshape(-1, 2, 16).transpose(0, 1)  # (h_kv, n, d)
        torch.testing.assert_close(values, layer_rows.features[..., -16:], atol=1e-5, rtol=1e-5)
        assert layer_rows.inputs("kv+hidden").shape[-1] == layer_rows.features.shape[-1] + 64
    predict, parameters = linear_candidate("kv", 1e-3, train)
    assert parameters == 2 * 2 * (layer_rows.features.shape[-1] + 1)
    figures = fit_figures(predict, held_out, 0.2)
    assert -1 <= figures["spearman"] <= 1 and 0 <= figures["overlap"] <= 1
    first, _ = mlp_candidate(train, hidden=4, steps=3, batch=16, seed=0)
    second, _ = mlp_candidate(train, hidden=4, steps=3, batch=16, seed=0)
    assert torch.equal(first(1, held_out[0][1]), second(1, held_out[0][1]))  # seeded: the same fit twice


def test_surrogate_lengths_measures_on_the_held_out_fifth_and_the_two_haystacks() -> None:
    from surrogate_lengths import texts

    from criticalkv.eval.facts import haystack_id, haystack_text
    from criticalkv.eval.needle import load_haystack
    from criticalkv.training.surrogate import HELD_OUT_SHARE
    from criticalkv.training.text import kjv_text

    got = texts()
    kjv = kjv_text().text
    split = int(len(kjv) * (1 - HELD_OUT_SHARE))
    assert got["king-james-held-out"] == kjv[split:]  # past every training window's text
    assert got["ruler-essays"] == load_haystack()
    assert got["language-reference"] == haystack_text() and len(haystack_text()) > 100_000
    assert haystack_id() == hashlib.sha256(haystack_text().encode()).hexdigest()[:12]


def test_surrogate_lengths_measures_every_map_at_every_length_on_the_same_windows(tiny_tokenizer) -> None:
    """Each length's figures are ``measured``'s at that length (the same seeded windows for every
    map), keyed by length, text and map."""
    from surrogate_lengths import FIGURES, by_length, card_scorer, measured
    from test_surrogate import OPTIONS, _model, _text

    from criticalkv.training.surrogate import train_surrogate

    model, text = _model(), _text()
    trained = train_surrogate(model, tiny_tokenizer, text, OPTIONS, "tiny-llama", progress=False)
    scorer = card_scorer(trained, tiny_tokenizer)
    maps = {"trained": trained}
    texts = {"words": text.text}
    lengths = [OPTIONS.lengths[0], 2 * OPTIONS.lengths[-1]]  # at a fitted length and past the last
    report = by_length(model, tiny_tokenizer, maps, texts, scorer, lengths, 2, 0.2, seed=3)
    assert list(report) == [str(n) for n in lengths]
    for length in lengths:
        direct = measured(model, tiny_tokenizer, maps, texts, scorer, 2, length, 0.2, seed=3)
        assert report[str(length)] == {"words": {"trained": {k: direct["words"]["trained"][k] for k in FIGURES}}}
        figures = report[str(length)]["words"]["trained"]
        assert -1 <= figures["mean_spearman"] <= 1 and 0 <= figures["mean_overlap"] <= 1


def test_kept_shares_count_every_layer_and_head_per_tenth_and_whole_spans() -> None:
    held = torch.zeros(2, 3, 20, dtype=torch.bool)  # (layers, h_kv, t)
    held[:, :, 18:] = True  # every pair holds the last tenth
    held[0, 0, 4:6] = True  # one pair of six holds positions 4 and 5 (the third tenth)
    held[1, 2, 4] = True  # another holds position 4 alone
    out = shares(held, [(4, 6), (18, 20)])
    assert out["share_per_tenth"] == [0.0, 0.0, round(3 / 15, 4)] + [0.0] * 6 + [round(12 / 15, 4)]
    assert out["pairs_holding_value"] == [round(1 / 6, 4), 1.0]


def test_surrogate_placement_one_chunk_keeps_the_one_shot_choice_and_chunks_keep_the_cap():
    """surrogate_placement.py: a chunk as long as the context is the one-shot compression, either placement; with
    chunks each head keeps ``cap`` distinct prompt positions, the 4 sinks among them."""
    from test_every_preset import _random_surrogate
    from test_runtime import _model

    model = _model("llama")
    module = attention_modules(model)[0]
    t, cap = 40, 12
    h, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    keys, values = torch.randn(2, 1, h, t, d, generator=torch.Generator().manual_seed(3))
    weights = _random_surrogate(model)
    for place in ("held", "prompt"):
        scorer = SurrogateScorer(weights=weights, place=place)
        scorer.check_model(model)
        one_shot = scores_of(scorer, module, keys, values, torch.arange(t).expand(h, -1), t).topk(cap, dim=-1).indices
        assert torch.equal(chunked_keep(scorer, module, keys, values, cap, t), one_shot.sort(-1).values)
        kept = chunked_keep(scorer, module, keys, values, cap, 10)  # (h_kv, cap)
        assert (
            kept.shape == (h, cap)
            and bool((kept.diff(dim=-1) > 0).all())
            and bool((kept[:, :4] == torch.arange(4)).all())
        )
