"""``criticalkv eval ruler``, ``eval facts``, ``eval needle`` and ``eval longbench``: sweeps over methods and budgets,
one prefill per sample."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from criticalkv.budget import Budget
from criticalkv.distributed import launch
from criticalkv.errors import CriticalKVError, did_you_mean
from criticalkv.eval.bounded import (
    Bounded,
    CapOption,
    ChunkSizeOption,
    CompressEveryOption,
    FullFromOption,
    GuideChunksOption,
)
from criticalkv.eval.report import HEATMAP_PREFIX, file_stem, write_report
from criticalkv.eval.shard import SHARD_HELP, Shard
from criticalkv.eval.sweep import REGIMES, check_out_folder, load_rows, pair_label, run_sweep, stored_settings
from criticalkv.files import write_json
from criticalkv.methods import build_method
from criticalkv.models.device_dtype import DEVICE_HELP, DTYPE_HELP, as_dtype
from criticalkv.models.families import check_length
from criticalkv.models.loading import load_notes
from criticalkv.models.presets import DEFAULT_PRESET
from criticalkv.progress import output_console, print_error
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.checks import check_methods_config

if TYPE_CHECKING:  # needle_grid pulls matplotlib: imported by the command only
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from criticalkv.eval.needle_grid import NeedleCell
    from criticalkv.runtime.method import Method

app = typer.Typer(
    help="Benchmarks: RULER, facts and needle-in-a-haystack, generated offline; LongBench from local files.",
    no_args_is_help=True,
)
console = output_console()
# options the sweep commands share
ModelOption = Annotated[str, typer.Option(help="Preset name, local folder or hub id.")]
MethodsOption = Annotated[str, typer.Option(help="Comma-separated presets (the full cache always runs).")]
BudgetsOption = Annotated[str, typer.Option(help="Comma-separated budgets.")]
DtypeOption = Annotated[str, typer.Option(help=DTYPE_HELP)]
DEFAULT_MODE = "agnostic"  # of run and eval alike: a context compressed once serves any later question
ModeOption = Annotated[
    str | None,
    typer.Option(
        help=f"agnostic: the context is compressed before the question is seen; aware: the question is compressed "
        f"with it. Default {DEFAULT_MODE}, in run and eval alike."
    ),
]
QuestionAwareOption = Annotated[bool, typer.Option(help="The same as --mode aware.")]
ShardOption = Annotated[str | None, typer.Option(help=SHARD_HELP)]


def regime_of(mode: str | None, question_aware: bool) -> str:
    """The regime ``--mode`` and its older spelling ``--question-aware`` ask for (``DEFAULT_MODE`` when neither is
    given)."""
    if mode not in (None, *REGIMES):
        raise CriticalKVError(f"--mode must be 'agnostic' or 'aware', got {mode!r}")
    if question_aware and mode == "agnostic":
        raise CriticalKVError("--question-aware is --mode aware: it contradicts --mode agnostic")
    return "aware" if question_aware else mode or DEFAULT_MODE


def regime_line(regime: str) -> str:
    """The line run and eval print first: which regime they measure, and how to ask for the other."""
    what = {
        "agnostic": "the context is compressed before the question is seen",
        "aware": "the question is compressed with the context",
    }[regime]
    other = next(r for r in REGIMES if r != regime)
    return f"question-{regime} (--mode {regime}): {what}; --mode {other} for the other regime"


def split_items(text: str, option: str) -> list[str]:
    """The comma-separated items of ``option``, each once (a task named twice was answered and counted twice)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    repeated = sorted({x for x in items if items.count(x) > 1})
    if repeated:
        raise CriticalKVError(f"{option} names {', '.join(repeated)} more than once")
    return items


def parse_numbers(text: str, cast: type, option: str) -> list:
    """The comma-separated numbers of ``option``, each read by ``cast`` (int or float)."""
    try:
        return [cast(x) for x in split_items(text, option)]
    except ValueError:
        raise CriticalKVError(f"{option} takes comma-separated {cast.__name__}s, got {text!r}") from None


def at_least(value: int, minimum: int, option: str) -> None:
    """Refuse a count below ``minimum`` as every other bad input is refused (typer's ``min=`` prints a usage box)."""
    if value < minimum:
        raise CriticalKVError(f"{option} must be >= {minimum}, got {value}")


def _suffix(part: Shard | None) -> str:
    """The default folder's ending for a shard (its own folder: two shards never share one)."""
    return "" if part is None else part.folder_suffix


def _capped(default: Callable[[Any], int], cap: int) -> Callable[[Any], int]:
    """Tokens to generate for a sample: its benchmark's own count ``default(sample)``, at most ``cap`` (0: no cap)."""
    return lambda sample: min(default(sample), cap) if cap else default(sample)


def _methods(text: str) -> tuple[list[str], list[Method | None]]:
    """The comma-separated method specs and each built, so a bad name or option fails before the model loads (the
    built ones are checked against the model's config by ``_load``)."""
    names = split_items(text, "--methods")
    if not names:
        raise CriticalKVError("--methods needs at least one method (the full cache always runs as the reference)")
    return names, [build_method(name) for name in names]


def _budgets(text: str) -> list[Budget]:
    """The comma-separated budgets, at least one."""
    parsed = [Budget.parse(b) for b in split_items(text, "--budgets")]
    if not parsed:
        raise CriticalKVError("--budgets needs at least one budget")
    return parsed


def _load(
    model: str,
    dtype: str,
    device: str,
    methods: list[Method | None],
    prepare: Callable[[PretrainedConfig, PreTrainedTokenizerBase], None],
) -> tuple[Any, Any]:
    """``launch.load_model``, with its hints (``load_notes``: a bfloat16 model on a CPU without bfloat16
    instructions, a tokenizer without a chat template); ``methods`` checked against the config and ``prepare``
    (the samples built and their lengths checked) run with the tokenizer, both before the weights load."""
    check = partial(check_methods_config, methods=methods)
    loaded, tokenizer = launch.load_model(model, dtype=dtype, device=device, check_config=check, with_tokenizer=prepare)
    for note in load_notes(loaded, tokenizer) if launch.is_main_process() else []:
        console.print(note, style="dim", markup=False)
    return loaded, tokenizer


def _dtype_setting(folder: Path, model: Any, dtype: str) -> dict[str, str]:
    """A sweep's dtype setting: the dtype the model loaded in, so a resumed folder keeps the dtype it was answered in
    (``auto`` and the dtype it resolves to are the same setting). Older folders: a RULER or needle folder made before
    the option records no dtype and resumes with ``auto`` only; a LongBench folder of then records the word as typed,
    "auto" (resumes with ``auto`` only) or a dtype's name or alias (resumes with any --dtype loading that dtype)."""
    stored = stored_settings(folder)
    if dtype == "auto" and stored is not None and stored.get("dtype", "auto") == "auto":
        return {"dtype": "auto"} if "dtype" in stored else {}
    word = (stored or {}).get("dtype")
    if word not in (None, "auto") and _is_dtype_word(word, model.dtype):  # LongBench recorded the word as typed
        return {"dtype": word}
    return {"dtype": str(model.dtype).removeprefix("torch.")}


def _is_dtype_word(word: str, dtype: Any) -> bool:
    """Whether ``word`` (a --dtype value, aliases included: bf16, fp32, ...) names ``dtype``."""
    try:
        return as_dtype(word, "auto") == dtype
    except CriticalKVError:
        return False


@contextmanager
def _resume_hint(folder: Path) -> Iterator[None]:
    """Ctrl-C in a sweep: say that the same command resumes it (the rows answered so far are on disk), and exit 130
    as an interrupted command does."""
    try:
        yield
    except KeyboardInterrupt:
        if launch.is_main_process():
            console.print(
                f"interrupted: the answers so far are in {folder / 'results.jsonl'}; run the same command again to "
                "resume where it stopped"
            )
        raise typer.Exit(130) from None


def _fail(error: Exception) -> None:
    print_error(console, error)
    raise typer.Exit(2) from None


_BATCH_HELP = (
    "The compressed pairs of a sample answer as the rows of one batched decode: 1.2-2.7x less CPU time, but in "
    "bfloat16 some long answers differ from separate runs (rounding of batched products). Off: each pair answers "
    "alone, exactly as a separate run. The full cache always answers alone."
)


@app.command()
def ruler(
    model: ModelOption = DEFAULT_PRESET,
    methods: MethodsOption = "snapkv,critical-snapkv",
    budgets: BudgetsOption = "0.2",
    tasks: Annotated[str, typer.Option(help="Comma-separated RULER tasks (default: all 13).")] = "",
    length: Annotated[int, typer.Option(help="Prompt length in the model's tokens.")] = 4096,
    samples: Annotated[int, typer.Option(help="Samples per task.")] = 20,
    mode: ModeOption = None,
    question_aware: QuestionAwareOption = False,
    max_new_tokens: Annotated[int, typer.Option(help="Cap on generated tokens (0: RULER's per task).")] = 0,
    reserve_answer: Annotated[
        bool,
        typer.Option(help="Size prompts so prompt and answer fit --length, as RULER's max_seq_length does."),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the generated samples.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Results folder (resumes if it has results).")] = None,
    batch_answers: Annotated[bool, typer.Option(help=_BATCH_HELP)] = False,
    dtype: DtypeOption = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: GuideChunksOption = False,
    full_from: FullFromOption = None,
    shard: ShardOption = None,
) -> None:
    """RULER's 13 tasks: every method and budget against the full cache, with compression loss."""
    from criticalkv.eval import ruler as ruler_data

    def generate(task: str, tokenizer: PreTrainedTokenizerBase, max_length: int | None) -> list:
        return ruler_data.generate(
            task, tokenizer, length, samples, seed=seed, max_length=max_length, reserve_answer=reserve_answer
        )

    benchmark = _Generated(
        "ruler",
        "RULER",
        ruler_data.TASKS,
        generate,
        ruler_data.score,
        ruler_data.TOKENS_TO_GENERATE,
        {"reserve_answer": True} if reserve_answer else {},  # absent: the folders made before it
    )
    _sweep_generated(
        benchmark,
        model,
        methods,
        budgets,
        tasks,
        length,
        samples,
        mode,
        question_aware,
        max_new_tokens,
        seed,
        out,
        batch_answers,
        dtype,
        device,
        Bounded(chunk_size, cap, compress_every, guide_chunks),
        shard,
        full_from,
    )


@app.command()
def facts(
    model: ModelOption = DEFAULT_PRESET,
    methods: MethodsOption = "snapkv,critical-snapkv",
    budgets: BudgetsOption = "0.2",
    tasks: Annotated[str, typer.Option(help="Comma-separated facts tasks (default: all 5).")] = "",
    length: Annotated[int, typer.Option(help="Prompt length in the model's tokens.")] = 4096,
    samples: Annotated[int, typer.Option(help="Samples per task.")] = 20,
    mode: ModeOption = None,
    question_aware: QuestionAwareOption = False,
    max_new_tokens: Annotated[int, typer.Option(help="Cap on generated tokens (0: the task's own).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the generated samples.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Results folder (resumes if it has results).")] = None,
    batch_answers: Annotated[bool, typer.Option(help=_BATCH_HELP)] = False,
    dtype: DtypeOption = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: GuideChunksOption = False,
    full_from: FullFromOption = None,
    shard: ShardOption = None,
) -> None:
    """The facts benchmark (RULER's check on other text and phrasing): every method and budget against the full
    cache, with compression loss."""
    from criticalkv.eval import facts as facts_data

    def generate(task: str, tokenizer: PreTrainedTokenizerBase, max_length: int | None) -> list:
        return facts_data.generate(task, tokenizer, length, samples, seed=seed, max_length=max_length)

    benchmark = _Generated(
        "facts",
        "facts",
        facts_data.TASKS,
        generate,
        facts_data.score,
        facts_data.TOKENS_TO_GENERATE,
        {"haystack": facts_data.haystack_id()},  # pydoc_data of another Python makes other samples
    )
    _sweep_generated(
        benchmark,
        model,
        methods,
        budgets,
        tasks,
        length,
        samples,
        mode,
        question_aware,
        max_new_tokens,
        seed,
        out,
        batch_answers,
        dtype,
        device,
        Bounded(chunk_size, cap, compress_every, guide_chunks),
        shard,
        full_from,
    )


@dataclass
class _Generated:
    """A benchmark generated offline and swept alike by ``eval ruler`` and ``eval facts``."""

    name: str  # its name in settings and folder names
    title: str  # in messages
    tasks: tuple[str, ...]
    generate: Callable[[str, PreTrainedTokenizerBase, int | None], list]  # task, tokenizer, max length -> samples
    score: Callable
    tokens_to_generate: dict[str, int]
    settings: dict  # what else makes its (task, index) the same sample across runs


def _sweep_generated(
    benchmark: _Generated,
    model: str,
    methods: str,
    budgets: str,
    tasks: str,
    length: int,
    samples: int,
    mode: str | None,
    question_aware: bool,
    max_new_tokens: int,
    seed: int,
    out: Path | None,
    batch_answers: bool,
    dtype: str,
    device: str,
    bounded: Bounded,
    shard: str | None,
    full_from: Path | None,
) -> None:
    """Generate ``benchmark``'s samples once the tokenizer is known (index-major: sample 0 of every task, then sample
    1, ...: a sweep stopped early has every task evenly), then sweep them (``shard``'s share of them) into a
    resumable folder and report."""
    try:
        part = Shard.parse(shard)
        at_least(samples, 1, "--samples")
        at_least(length, 1, "--length")
        at_least(max_new_tokens, 0, "--max-new-tokens")
        chosen = split_items(tasks, "--tasks") or list(benchmark.tasks)
        unknown = [t for t in chosen if t not in benchmark.tasks]
        if unknown:
            raise CriticalKVError(
                f"unknown {benchmark.title} task(s) {unknown}.{did_you_mean(unknown[0], benchmark.tasks)} "
                f"Tasks: {', '.join(benchmark.tasks)}"
            )
        parsed = bounded.budgets(_budgets(budgets))
        names, built = _methods(methods)
        regime = regime_of(mode, question_aware)
        bounded.check_guide(regime)
        bounded.check_full_from(full_from)
        if launch.is_main_process():
            console.print(regime_line(regime))
        folder = out or Path("results") / f"{benchmark.name}-{Path(model).name}-{length}-{regime}{_suffix(part)}"
        check_out_folder(folder)
        every: list = []

        def prepare(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
            max_length = check_length(config, length)
            with console.status(f"generating {samples} samples of {len(chosen)} task(s)"):  # a task too short fails
                for task in chosen:
                    every.extend(benchmark.generate(task, tokenizer, max_length))
            every.sort(key=lambda sample: sample.index)  # stable: the tasks keep their order within an index
            if part is not None:
                every[:] = part.take(every)

        loaded, tokenizer = _load(model, dtype, device, built, prepare)
        budget_of = _capped(lambda sample: benchmark.tokens_to_generate[sample.task], max_new_tokens)
        with _resume_hint(folder):
            run_sweep(
                loaded,
                tokenizer,
                every,
                benchmark.score,
                names,
                parsed,
                regime,
                folder,
                budget_of,
                total=len(every),
                batch_answers=batch_answers,
                bounded=bounded.options,
                guide_chunks=bounded.guide_chunks,
                full_from=full_from,
                settings={
                    **bounded.setting,
                    "benchmark": benchmark.name,
                    "model": model,
                    "length": length,
                    "seed": seed,
                    "max_new_tokens": max_new_tokens,
                    **benchmark.settings,
                    **_dtype_setting(folder, loaded, dtype),
                },
            )
    except CriticalKVError as error:
        _fail(error)
    if launch.is_main_process():
        console.print(f"wrote {write_report(folder)}")


@dataclass
class _NeedleItem:
    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answer: str


def _check_prompts(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, cells: list[NeedleCell]) -> None:
    """Every cell's whole prompt (its context, then the question and answer prefix) fits the model, as ``run``
    checks its prompt: ``--lengths`` counts the context alone."""
    for cell in cells:
        prefix_ids, suffix_ids = encode_prompt(
            tokenizer, cell.sample.context, cell.sample.question, cell.sample.answer_prefix
        )
        check_length(config, len(prefix_ids) + len(suffix_ids), f"--lengths {cell.length}: prompt length")


@app.command()
def needle(
    model: ModelOption = DEFAULT_PRESET,
    methods: Annotated[str, typer.Option(help="Comma-separated presets.")] = "snapkv,critical-snapkv",
    budgets: Annotated[
        str, typer.Option("--budgets", "--budget", help="Comma-separated budgets (one heatmap per method and budget).")
    ] = "0.2",
    lengths: Annotated[str, typer.Option(help="Comma-separated context lengths.")] = "1024,2048,4096",
    depths: Annotated[str, typer.Option(help="Comma-separated depths in [0, 1].")] = "0,0.25,0.5,0.75,1",
    mode: ModeOption = None,
    question_aware: QuestionAwareOption = False,
    seed: Annotated[int, typer.Option(help="Seed of the needles.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Results folder (resumes if it has results).")] = None,
    batch_answers: Annotated[bool, typer.Option(help=_BATCH_HELP)] = False,
    dtype: DtypeOption = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: GuideChunksOption = False,
    full_from: FullFromOption = None,
) -> None:
    """Needle in a haystack over depths x lengths: one heatmap per method and budget."""
    from criticalkv.eval.needle_grid import check_grid, needle_grid, plot_heatmap

    try:
        bounded = Bounded(chunk_size, cap, compress_every, guide_chunks)
        parsed = bounded.budgets(_budgets(budgets))
        names, built = _methods(methods)
        regime = regime_of(mode, question_aware)
        bounded.check_guide(regime)
        bounded.check_full_from(full_from)
        if launch.is_main_process():
            console.print(regime_line(regime))
        folder = out or Path("results") / f"needle-{Path(model).name}-{regime}"
        grid = {"lengths": parse_numbers(lengths, int, "--lengths"), "depths": parse_numbers(depths, float, "--depths")}
        check_grid(grid["lengths"], grid["depths"])  # before the model loads
        check_out_folder(folder)
        cells: list[NeedleCell] = []

        def prepare(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
            check_length(config, max(grid["lengths"], default=0), "--lengths")
            cells.extend(needle_grid(tokenizer, grid["lengths"], grid["depths"], seed))
            _check_prompts(config, tokenizer, cells)

        loaded, tokenizer = _load(model, dtype, device, built, prepare)
        items = [
            _NeedleItem(
                f"needle-{c.length}", i, c.sample.context, c.sample.question, c.sample.answer_prefix, c.sample.answer
            )
            for i, c in enumerate(cells)
        ]
        with _resume_hint(folder):
            run_sweep(
                loaded,
                tokenizer,
                items,
                lambda s, p: 100.0 * (s.answer in p),
                names,
                parsed,
                regime,
                folder,
                lambda s: 16,
                total=len(items),
                batch_answers=batch_answers,
                bounded=bounded.options,
                guide_chunks=bounded.guide_chunks,
                full_from=full_from,
                # a sample's index is its cell in the lengths x depths grid
                settings={
                    **bounded.setting,
                    "benchmark": "needle",
                    "model": model,
                    **grid,
                    "seed": seed,
                    **_dtype_setting(folder, loaded, dtype),
                },
            )
    except CriticalKVError as error:
        _fail(error)
    if not launch.is_main_process():
        return
    rows = [r for r in load_rows(folder / "results.jsonl") if r.regime == regime]
    grids: dict[str, dict] = {}
    for row in rows:
        cell = cells[row.index]
        grids.setdefault(pair_label(row.method, Budget(row.budget)), {})[(cell.length, cell.depth)] = row.score
    for label, scores in grids.items():
        path = folder / f"{HEATMAP_PREFIX}{file_stem(label)}.png"  # the spec's ':', '=', '/' and the '@' as '_'
        plot_heatmap(scores, path, f"{label} · {Path(model).name} · question-{regime}")
        console.print(f"wrote {path}")
    write_json(
        folder / "heatmaps.json",
        {label: {f"{k[0]}@{k[1]}": v for k, v in s.items()} for label, s in grids.items()},
        indent=2,
    )
    console.print(f"wrote {write_report(folder)}")  # scores and loss against the full cache, as eval ruler writes


@app.command()
def longbench(
    data: Annotated[Path, typer.Argument(help="A LongBench JSONL file, or a folder of <dataset>.jsonl files.")],
    model: ModelOption = DEFAULT_PRESET,
    methods: MethodsOption = "snapkv,critical-snapkv",
    budgets: BudgetsOption = "0.2",
    datasets: Annotated[str, typer.Option(help="Comma-separated datasets (default: every one in DATA).")] = "",
    samples: Annotated[int, typer.Option(help="Samples per dataset, the first ones (0: all).")] = 0,
    max_length: Annotated[
        int, typer.Option(help="Prompts longer than this many tokens lose their middle (THUDM's truncation).")
    ] = 3500,
    mode: ModeOption = None,
    question_aware: QuestionAwareOption = False,
    max_new_tokens: Annotated[int, typer.Option(help="Cap on generated tokens (0: THUDM's per dataset).")] = 0,
    out: Annotated[Path | None, typer.Option(help="Results folder (resumes if it has results).")] = None,
    batch_answers: Annotated[bool, typer.Option(help=_BATCH_HELP)] = False,
    dtype: DtypeOption = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    chunk_size: ChunkSizeOption = None,
    cap: CapOption = None,
    compress_every: CompressEveryOption = None,
    guide_chunks: GuideChunksOption = False,
    full_from: FullFromOption = None,
    shard: ShardOption = None,
) -> None:
    """LongBench v1 (English and code) from local files: THUDM's prompts, truncation and metrics, every method and
    budget against the full cache."""
    from criticalkv.eval import longbench as longbench_data
    from criticalkv.eval import longbench_run

    try:
        at_least(samples, 0, "--samples")
        part = Shard.parse(shard)
        at_least(max_length, 1, "--max-length")
        at_least(max_new_tokens, 0, "--max-new-tokens")
        groups = longbench_run.read_datasets(data, split_items(datasets, "--datasets"))
        bounded = Bounded(chunk_size, cap, compress_every, guide_chunks)
        parsed = bounded.budgets(_budgets(budgets))
        names, built = _methods(methods)
        regime = regime_of(mode, question_aware)
        bounded.check_guide(regime)
        bounded.check_full_from(full_from)
        if launch.is_main_process():
            console.print(regime_line(regime))
        folder = out or Path("results") / f"longbench-{Path(model).name}-{max_length}-{regime}{_suffix(part)}"
        check_out_folder(folder)
        items: list = []

        def prepare(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
            with console.status(f"truncating and encoding the prompts of {len(groups)} dataset(s)"):
                items.extend(longbench_run.longbench_items(tokenizer, groups, samples, max_length))
            if part is not None:
                items[:] = part.take(items)
            for item in items:  # every prompt fits the model
                check_length(config, len(item.prefix_ids) + len(item.suffix_ids), f"{item.task} prompt length")

        loaded, tokenizer = _load(model, dtype, device, built, prepare)

        budget_of = _capped(lambda item: longbench_data.max_new_tokens(item.sample.dataset), max_new_tokens)
        with _resume_hint(folder):
            run_sweep(
                loaded,
                tokenizer,
                items,
                longbench_run.score_item,
                names,
                parsed,
                regime,
                folder,
                budget_of,
                total=len(items),
                batch_answers=batch_answers,
                bounded=bounded.options,
                guide_chunks=bounded.guide_chunks,
                full_from=full_from,
                settings={
                    **bounded.setting,
                    "benchmark": "longbench",
                    # 2: ids of the whole prompt, samsum ends at a line break; 3: other datasets end at the
                    # model's end-of-sequence tokens; a folder of another protocol is not resumed (its rows would
                    # mix with these)
                    "protocol": longbench_run.PROTOCOL,
                    "model": model,
                    "data": str(data.resolve()),
                    "max_length": max_length,
                    "max_new_tokens": max_new_tokens,
                    **_dtype_setting(folder, loaded, dtype),
                },
                encode=lambda item: (item.prefix_ids, item.suffix_ids),
                stop=partial(longbench_run.stop_rule, tokenizer, loaded.generation_config.eos_token_id),
                raw_predictions=True,  # THUDM scores the decoded text as it is (a code line's indentation counts)
            )
    except CriticalKVError as error:
        _fail(error)
    if launch.is_main_process():
        console.print(f"wrote {write_report(folder)}")


__all__ = ["REGIMES", "app"]
