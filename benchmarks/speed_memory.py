"""Speed and memory over context lengths, criticalkv against NVIDIA kvpress 0.5.5 on the same prompts.

For every context length, method and repeat, one process runs a warm-up generation on the first 256 tokens,
then ``--runs-per-process`` timed generations (default one; on a GPU, where a process's start costs more than its
runs, more): the prefill of the whole prompt (time to first token), ``--decode-steps`` greedy decode steps
(median seconds per token), the KV bytes the cache holds after the prefill and the peak memory above the start
of the prefill (process RSS; on a GPU also CUDA's allocator). The kvpress runs use kvpress's own virtual
environment and process (benchmarks/kvpress/speed_kvpress.py) on the same model folder and the same token ids,
and the same timing code (benchmarks/timed_generation.py). Runs are interleaved (repeat, length, method,
system), so a drift of the machine hits every method alike; the report gives medians and ours/kvpress ratios.
Times are recorded twice: wall clock, and the process's CPU time, which (with ``--threads 1``) is the figure to
read on a machine that other jobs share. Each compressed run also records the CPU time its system spent
compressing inside the prefill (criticalkv's compressor; kvpress's forward hooks), the part of the time to first
token in which the two systems differ; the report adds the rest of the prefill, run by run. With ``--phases``
the prefill also splits into each layer's attention module, its MLP and the compression (CPU time and page
faults, ``timed_generation.PhaseClock``). ``--allocator`` sets glibc's allocator in every measurement process:
``mmap`` for peak memory, ``glibc`` (its defaults) or ``retain`` (no page faults in a run after one of the same
length, as with ``--warmup-tokens`` at the prompt's length) for times.

    OMP_NUM_THREADS=1 python benchmarks/speed_memory.py --model smollm2-135m --lengths 2048,4096,8192 \
        --repeats 5 --threads 1 --out results/speed_memory_smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from timed_generation import ALLOCATORS, PhaseClock, child_environment, count_prefill_ops, timed_greedy

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("CRITICALKV_KVPRESS_VENV", Path.home() / ".cache/criticalkv/kvpress-venv"))
PRESS_OF = {  # criticalkv preset -> kvpress press of benchmarks/kvpress/run_kvpress.py
    "full": "none",
    "snapkv": "snapkv",
    "critical-snapkv": "critical-snapkv",
    "adakv": "adakv",
    "critical-adakv": "critical-adakv",
    "streaming": "streaming",
    "knorm": "knorm",
    "tova": "tova",
}
SYSTEMS = ("ours", "kvpress")
FIGURES = (
    "ttft_seconds",
    "ttft_cpu_seconds",
    "decode_ms_per_token_median",
    "decode_cpu_ms_per_token_median",
    "peak_rss_above_start_bytes",
    "kv_bytes",
)
OPTIONAL_FIGURES = (  # on a GPU; with --count-ops; under compression (runs made before it was recorded lack it)
    "peak_cuda_above_start_bytes",
    "prefill_dispatched_ops",
    "prefill_host_reads",
    "prefill_dispatched_ops_gpu_blocks",
    "prefill_launching_ops",
    "prefill_launching_ops_gpu_blocks",
    "compression_cpu_seconds",
    "prefill_minor_faults",
)


@contextlib.contextmanager
def gpu_block_sizes():
    """criticalkv's CPU-only block sizes switched to a GPU's, for an operator count on a CPU: the window's logits in
    one product (``scorers.base.CPU_KEY_CHUNK``), the value norms of every head in one product in a GPU's chunks
    (``value_norm``)."""
    from criticalkv.scorers import base
    from criticalkv.selectors import value_norm

    saved = base.CPU_KEY_CHUNK, value_norm._PER_HEAD_PRODUCTS_ON_CPU
    base.CPU_KEY_CHUNK, value_norm._PER_HEAD_PRODUCTS_ON_CPU = sys.maxsize, False
    try:
        yield
    finally:
        base.CPU_KEY_CHUNK, value_norm._PER_HEAD_PRODUCTS_ON_CPU = saved


def prompt_ids(tokenizer, length: int, seed: int = 0) -> list[int]:
    """A chat-templated needle-in-a-haystack prompt of about ``length`` tokens, template included."""
    from criticalkv.eval.needle import build_needle_sample
    from criticalkv.prompts import encode_prompt

    def ids_for(context_tokens: int) -> list[int]:
        sample = build_needle_sample(tokenizer, context_tokens, seed=seed)
        prefix_ids, suffix_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        return prefix_ids + suffix_ids

    first = ids_for(length)
    overhead = len(first) - length  # template, question and the needle sample's rounding
    return ids_for(length - overhead) if overhead > 0 else first


def kvpress_ratio(budget: str, prompt_tokens: int) -> float:
    """kvpress's compression ratio that keeps as many entries per head as criticalkv's budget.

    kvpress keeps int(T * (1 - ratio)); 1 - 0.2 carries float error (int(4160 * 0.19999999999999996) = 831), so
    the ratio puts the product half an entry above criticalkv's count.
    """
    from criticalkv.budget import Budget

    kept = int(Budget.parse(budget).entries_for(torch.tensor([prompt_tokens]))[0])
    return 1 - (kept + 0.5) / prompt_tokens


def measure_ours(args: argparse.Namespace) -> list[dict]:
    """``--runs-per-process`` runs of criticalkv in this process (``--single``), after one warm-up."""
    import transformers
    from transformers import DynamicCache

    import criticalkv
    from criticalkv.models import load_model

    device = torch.device(args.device)
    ids = torch.tensor(json.loads(args.ids.read_text())["input_ids"], dtype=torch.long, device=device)
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    phases = PhaseClock(model) if args.phases else None
    with criticalkv.compress(model, args.single, args.budget) as compressor:
        if phases is not None and compressor is not None:  # the compression clock's two steps
            phases.wrap(compressor, "compress_layer", "compression")  # each layer, inside its attention function
            phases.wrap(compressor, "finish_deferred", "compression")  # a deferred method's, at the end
        timed_greedy(model, ids[:, : args.warmup_tokens], DynamicCache(config=model.config), args.warmup_steps)
        clock = (lambda: compressor.compress_cpu_seconds) if compressor is not None else None
        results = [
            timed_greedy(
                model,
                ids,
                DynamicCache(config=model.config),
                args.decode_steps,
                compression_clock=clock,
                phase_clock=phases,
            )
            for _ in range(args.runs_per_process)
        ]
        ops = {}
        if args.count_ops:
            ops = count_prefill_ops(model, ids, DynamicCache(config=model.config))
            if model.device.type == "cpu":
                with gpu_block_sizes():
                    as_on_gpu = count_prefill_ops(model, ids, DynamicCache(config=model.config))
                ops["prefill_dispatched_ops_gpu_blocks"] = as_on_gpu["prefill_dispatched_ops"]
                ops["prefill_launching_ops_gpu_blocks"] = as_on_gpu["prefill_launching_ops"]
    shared = {
        "system": "ours",
        "method": args.single,
        "budget": args.budget if compressor is not None else "full",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "attention_path": os.environ.get("CRITICALKV_ATTENTION", "auto"),
        "source_sha256": source_digest(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "criticalkv": criticalkv.__version__,
        },
    }
    return [{**result, **shared, **ops, "run_in_process": k} for k, result in enumerate(results)]


def source_digest() -> str:
    """sha256 of criticalkv's Python sources as imported: tells runs on different working trees apart."""
    import hashlib

    import criticalkv

    digest = hashlib.sha256()
    for path in sorted(Path(criticalkv.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_child(command: list[str], allocator: str) -> dict:
    """Run one measurement process; ``allocator`` one of ``timed_generation.ALLOCATORS`` (``child_environment``)."""
    done = subprocess.run(command, capture_output=True, text=True, env=child_environment(allocator))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_process(
    args: argparse.Namespace, system: str, method: str, folder: Path, ids_file: Path, tokens: int
) -> list[dict]:
    """``--runs-per-process`` measurements in one fresh process of ``system``."""
    shared = ["--threads", str(args.threads), "--decode-steps", str(args.decode_steps), "--device", args.device]
    shared += ["--warmup-tokens", str(args.warmup_tokens), "--warmup-steps", str(args.warmup_steps)]
    shared += ["--runs-per-process", str(args.runs_per_process)] + (["--count-ops"] if args.count_ops else [])
    shared += ["--phases"] if args.phases else []
    if system == "ours":
        command = [sys.executable, __file__, "--single", method, "--ids", str(ids_file), "--model", args.model]
        command += ["--budget", args.budget, "--dtype", args.dtype]
    else:
        command = [str(VENV / "bin/python"), str(HERE / "kvpress/speed_kvpress.py"), "--model", str(folder)]
        command += ["--input", str(ids_file), "--press", PRESS_OF[method], "--dtype", args.dtype]
        command += ["--compression-ratio", repr(kvpress_ratio(args.budget, tokens) if method != "full" else 0.0)]
    results = run_child(command + shared, args.allocator)
    for result in results:
        result.update(method=method, allocator=args.allocator)
    return results


def summarise(runs: list[dict], lengths: list[int], methods: list[str], systems: list[str]) -> list[dict]:
    """Medians per (length, method, system), the KV fraction of the same system's full cache, ours/kvpress."""
    rows = []
    for length in lengths:
        for method in methods:
            row = {"length": length, "method": method}
            for system in systems:
                mine = [r for r in runs if r["length"] == length and r["method"] == method and r["system"] == system]
                if not mine:
                    continue
                row["prompt_tokens"] = mine[0]["prompt_tokens"]
                row["repeats"] = len(mine)
                keys = FIGURES + tuple(k for k in OPTIONAL_FIGURES if all(k in r for r in mine))
                row[system] = {k: statistics.median(r[k] for r in mine) for k in keys}
                if "compression_cpu_seconds" in keys:  # the prefill's CPU time besides compressing, run by run
                    rest = (r["ttft_cpu_seconds"] - r["compression_cpu_seconds"] for r in mine)
                    row[system]["ttft_cpu_outside_compression_seconds"] = statistics.median(rest)
                if all("prefill_phases" in r for r in mine):
                    row[system].update(phase_medians(mine))
            if "repeats" in row:  # a partial report (a run stopped early) has no row for what never ran
                rows.append(row)
    for row in rows:
        full = next((r for r in rows if r["length"] == row["length"] and r["method"] == "full"), None)
        for system in systems:
            if full and system in row and system in full:
                row[system]["kv_fraction_of_full"] = row[system]["kv_bytes"] / full[system]["kv_bytes"]
        if "ours" in row and "kvpress" in row:
            row["ratio_ours_over_kvpress"] = {
                k: row["ours"][k] / row["kvpress"][k] for k in row["ours"] if k in row["kvpress"] and row["kvpress"][k]
            }
    return rows


def phase_medians(runs: list[dict]) -> dict[str, float]:
    """Medians of each phase's CPU seconds and faults (``phase_attention_cpu_seconds``, ...), and of the prefill's CPU
    time no phase covers (``phase_other_cpu_seconds``: embeddings, norms, mask, rotary tables, head)."""
    names = sorted({name for r in runs for name in r["prefill_phases"]})
    out = {}
    for name in names:
        for figure in ("cpu_seconds", "minor_faults"):
            out[f"phase_{name}_{figure}"] = statistics.median(
                r["prefill_phases"].get(name, {}).get(figure, 0) for r in runs
            )
    other = (r["ttft_cpu_seconds"] - sum(p["cpu_seconds"] for p in r["prefill_phases"].values()) for r in runs)
    out["phase_other_cpu_seconds"] = statistics.median(other)
    return out


def _one_line(r: dict) -> str:
    return (
        f"TTFT {r['ttft_seconds']:7.3f} s (CPU {r['ttft_cpu_seconds']:7.3f} s)  "
        f"decode {r['decode_ms_per_token_median']:7.2f} ms/tok (CPU {r['decode_cpu_ms_per_token_median']:7.2f})  "
        f"KV {r['kv_bytes'] / 2**20:6.1f} MiB  peak RSS +{r['peak_rss_above_start_bytes'] / 2**20:6.0f} MiB"
        + (f"  compression {r['compression_cpu_seconds']:6.3f} CPU s" if "compression_cpu_seconds" in r else "")
    )


def git_state() -> dict:
    """The commit measured and whether the working tree differed from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"head": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine() -> dict:
    """What the numbers ran on."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "arch": platform.machine(), "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_report(
    args: argparse.Namespace, folder: Path, runs: list[dict], lengths: list[int], methods: list[str], systems: list[str]
) -> None:
    """The JSON report of every run so far, with medians and ratios."""
    report = {
        "command": "python benchmarks/speed_memory.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("single", "ids", "resume")
        ),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "model": args.model,
        "model_folder_name": folder.name,
        "machine": machine(),
        "git": git_state(),
        "budget": args.budget,
        "summary": summarise(runs, lengths, methods, systems),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="preset name or local model folder")
    parser.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens, template included")
    parser.add_argument("--methods", default="full,snapkv,critical-snapkv,critical-adakv", help="criticalkv presets")
    parser.add_argument("--systems", default="ours,kvpress", help="ours, kvpress or both")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--repeats", type=int, default=5, help="processes per (length, method, system)")
    parser.add_argument(
        "--runs-per-process",
        type=int,
        default=1,
        help="timed runs in each process after its warm-up (a GPU's process start costs more than its runs)",
    )
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per run (median)")
    parser.add_argument("--warmup-tokens", type=int, default=256, help="prompt length of each process's warm-up")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="decode steps of the warm-up (on a GPU, 32: the first timed run otherwise meets shapes it did not)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path("results/speed_memory.json"))
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="mmap",
        help="mmap: every tensor buffer mmapped and returned on free, so peak RSS is live memory (the page faults "
        "add CPU time, more to the method that allocates more); glibc: its defaults, for times (peak RSS then "
        "includes what the allocator retains); retain: nothing mmapped or trimmed, so a run after one of the same "
        "length maps no fresh pages (times without page faults; pair with --warmup-tokens at the prompt's length)",
    )
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the rest")
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="after the timed runs, count the operators of one more prefill and those the host waits for "
        "(timed_generation.count_prefill_ops); on a CPU criticalkv's also with a GPU's block sizes (gpu_block_sizes)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="split each timed prefill's CPU time and page faults into attention, MLP and compression "
        "(timed_generation.PhaseClock; hooks on every layer, on both sides)",
    )
    parser.add_argument("--single", help=argparse.SUPPRESS)  # internal: one run of one method in this process
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)  # internal: the token ids of that run
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.runs_per_process < 1:
        raise SystemExit("--runs-per-process must be at least 1")
    if args.single:
        print(json.dumps(measure_ours(args)))
        return

    from transformers import AutoConfig, AutoTokenizer

    from criticalkv.methods import build_method
    from criticalkv.models import PRESETS, resolve_model_folder

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    lengths = [int(x) for x in args.lengths.split(",")]
    for method in methods:
        build_method(method)  # unknown names fail before any work
    if not set(systems) <= set(SYSTEMS):
        raise SystemExit(f"--systems takes {', '.join(SYSTEMS)}")
    if "kvpress" in systems and not (VENV / "bin/python").exists():
        raise SystemExit(f"no kvpress environment at {VENV}: run benchmarks/kvpress/setup_kvpress_env.sh")
    folder = resolve_model_folder(args.model) if args.model in PRESETS else Path(args.model)
    limit = getattr(AutoConfig.from_pretrained(folder, trust_remote_code=False), "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise SystemExit(f"length {max(lengths)} exceeds the model's {limit} positions")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)

    runs: list[dict] = json.loads(args.out.read_text())["runs"] if args.resume and args.out.exists() else []
    done = {(r["repeat"], r["length"], r["method"], r["system"]) for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for length in lengths:
            files[length] = Path(tmp) / f"ids_{length}.json"
            files[length].write_text(json.dumps({"input_ids": [prompt_ids(tokenizer, length)]}))
        for repeat in range(args.repeats):
            for length in lengths:
                tokens = len(json.loads(files[length].read_text())["input_ids"][0])
                for method in methods:
                    for system in systems:
                        first = repeat * args.runs_per_process  # the repeat index of this process's first run
                        if (system == "kvpress" and method not in PRESS_OF) or (first, length, method, system) in done:
                            continue
                        for k, r in enumerate(run_process(args, system, method, folder, files[length], tokens)):
                            r.update(length=length, repeat=first + k, process=repeat)
                            runs.append(r)
                            print(f"#{first + k} {length:6d} {method:16s} {system:8s} {_one_line(r)}", flush=True)
                        write_report(args, folder, runs, lengths, methods, systems)  # after every process: resumable
    write_report(args, folder, runs, lengths, methods, systems)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
