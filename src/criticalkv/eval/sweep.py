"""The sweep runner: every (method, budget) pair answers every sample, with one prefill per sample.

Results are appended per sample to ``results.jsonl`` in the output folder, so an interrupted run resumes where it
stopped. ``criticalkv.eval.report`` turns the file into tables and plots.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Protocol, TextIO

import torch
from filelock import FileLock, Timeout

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache
from criticalkv.core.layout import ParallelLayout
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.eval import method_record
from criticalkv.eval.bounded import Bounded
from criticalkv.files import read_json, write_atomic, write_json
from criticalkv.progress import step_progress
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill

REGIMES = ("agnostic", "aware")
FULL_PAIR = ("full", "full", Budget(1.0))  # (label, method, budget): the reference every sweep answers
SETTINGS_FILE = "sweep.json"  # a sweep folder's settings (``run_sweep``'s ``settings``)
LOCK_FILE = ".sweep.lock"  # held by the sweep writing to the folder (``_lock_folder``)


class IncompleteRowWarning(UserWarning):
    """A results.jsonl whose last line was cut short (a run killed while writing it): the line is dropped."""


class Sample(Protocol):
    """What the runner needs of a sample: its key in results.jsonl."""

    task: str
    index: int


class ChatSample(Sample, Protocol):
    """A sample the default encoder turns into a chat prompt (``encode_prompt``): RULER's and needle's."""

    context: str
    question: str
    answer_prefix: str


Encoder = Callable[[Sample], tuple[list[int], list[int]]]  # sample -> (context ids, question ids)


@dataclass(frozen=True)
class StopRule:
    """Where a sample's greedy answer ends: at its first token of ``token_ids`` (None: at none), which the first
    ``min_new_tokens`` tokens cannot be (``ContextSession.ask``)."""

    token_ids: int | list[int] | None
    min_new_tokens: int = 0


@dataclass
class Row:
    """One answer of one (method, budget) pair to one sample."""

    task: str
    index: int
    regime: str  # "agnostic": context compressed before the question; "aware": with it
    method: str
    budget: float | int
    score: float
    prediction: str
    prompt_tokens: int
    kept_fraction: float
    batched: bool = False  # answered as a row of a batched decode (``batch_answers``), not alone
    # the full cache's row of the same sample in another sweep, copied (``run_sweep``'s ``full_from``), not answered
    copied: bool = False

    def record(self) -> dict:
        """The row as results.jsonl stores it (``copied`` only where true: the rows of before it stay as they were)."""
        fields = asdict(self)
        if not self.copied:
            del fields["copied"]
        return fields


def is_count(budget: float | int) -> bool:
    """Whether a row's budget counts entries per KV head (an int in results.jsonl) rather than a fraction (a float),
    as ``Budget`` reads it."""
    return not Budget(budget).is_fraction


def budget_id(budget: float | int) -> tuple[bool, float | int]:
    """A row's budget as a key: a count apart from a fraction (the count 1 is not the fraction 1.0, though 1 == 1.0)."""
    return is_count(budget), budget


def pair_label(method: str, budget: Budget) -> str:
    return "full" if method == "full" else f"{method}@{budget.value}"


def run_sweep(
    model,
    tokenizer,
    samples: Iterable[Sample],
    score: Callable[[Sample, str], float],
    methods: list[str],
    budgets: list[Budget],
    regime: str,
    out_dir: Path,
    max_new_tokens: Callable[[Sample], int],
    total: int | None = None,
    batch_answers: bool = False,
    settings: dict | None = None,
    encode: Encoder | None = None,
    stop: Callable[[Sample], StopRule] | None = None,
    raw_predictions: bool = False,
    bounded: dict | None = None,
    guide_chunks: bool = False,
    full_from: Path | None = None,
) -> list[Row]:
    """Answer every sample with the full cache and every (method, budget) pair; append rows to results.jsonl.

    ``settings`` (JSON values: model, prompt length, seed, ...) are what makes a (task, index) the same sample
    across runs; they are kept in the folder's ``sweep.json``, and a run that resumes a folder with other settings
    is refused, so its rows never mix with another sweep's. Methods, budgets, the sample count and
    ``batch_answers`` may change between runs (each row records its pair and whether it was batched); a run
    answers each sample only with the pairs that have no row for it yet.

    Each pair answers on its own by default: exactly the answers of separate runs. With ``batch_answers`` the
    compressed pairs of a sample answer together, as the rows of one batched decode (``ContextSession.stacked``;
    the full cache still answers alone, on the model's own dense attention): the rows read the same entries as
    separate runs, but the batched products round differently, so in bfloat16 a long answer can drift to other
    tokens (docs/benchmarks.md: 1.2-2.7x less CPU time; 53 of 60 and 91 of 108 answers identical).

    ``encode`` gives a sample's prompt as (context ids, question ids): the question-agnostic regime prefills the
    first alone, the question-aware one both. By default it is ``encode_prompt`` on a ``ChatSample``'s fields.

    ``stop`` gives a sample's ``StopRule``; by default every answer ends at the tokenizer's end-of-sequence token.

    ``bounded`` (``chunk_size``, ``compress_every``; ``ContextSession``'s options): every pair, the full cache
    included, prefills its own session in chunks instead of sharing one prefill, and compresses while answering;
    with ``guide_chunks`` (question-aware), every chunk but the last is scored by the question's queries
    (``ContextSession.prefill``'s ``guide_ids``).

    ``full_from`` (with ``bounded``): a sweep folder of the same samples (its settings are this run's but for
    ``bounded``), whose full-cache rows this folder takes, marked ``copied``, instead of prefilling the full cache in
    chunks and answering again: the full cache evicts nothing, so chunks change only its rounding (RULER-4k,
    Qwen2.5-0.5B: the same score on all 260 samples, docs/results.md). A sample it lacks is answered here; the
    compressed pairs' kept fractions count what the full cache would hold (``CompressedCache.full_entries``).

    A prediction is the decoded answer with its surrounding whitespace stripped (RULER's and the needle's scorers
    strip it too); with ``raw_predictions`` as decoded (LongBench: THUDM scores the raw text, and the indentation of
    a code line counts in ``code_sim_score``).
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    Bounded(**(bounded or {}), guide_chunks=guide_chunks).check_guide(regime)  # a guide needs chunks and the question
    described = method_record.describe(methods)  # each built: unknown names fail before any work
    if batch_answers and not CompressedCache(model.config).stackable():
        raise UnsupportedModelError(
            "--batch-answers needs every attention layer compressible; this model has sliding-window layers, "
            "whose caches cannot be stacked: run without it"
        )
    reference = _full_rows(full_from, settings, regime, bounded) if full_from is not None else {}
    pairs = [FULL_PAIR] + [(pair_label(m, b), m, b) for m in methods if m != "full" for b in budgets]
    labels = [label for label, _, _ in pairs]
    if len(set(labels)) < len(labels):
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        raise CriticalKVError(f"(method, budget) pairs given twice: {', '.join(repeated)}")
    layout = ParallelLayout.of(model)  # under torchrun every rank answers every sample; rank 0 writes
    problem, lock = None, None
    try:
        if layout.is_main:
            problem = _out_folder_problem(out_dir)
            if problem is None:
                lock, problem = _lock_folder(out_dir)
            problem = problem or _settings_conflict(out_dir, settings) or method_record.conflict(out_dir, described)
        conflict = layout.from_main(problem)
        if conflict:
            raise CriticalKVError(conflict)
        path = out_dir / "results.jsonl"
        done = layout.from_main(_answered(path, regime) if layout.is_main else None)
        unrecorded = settings if layout.is_main and stored_settings(out_dir) is None else None  # until the first row
        rows: list[Row] = []
        encode = encode or partial(_chat_ids, tokenizer)
        stop = stop or (lambda sample: StopRule(tokenizer.eos_token_id))
        if layout.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        description = f"{regime} sweep, {len(pairs)} pairs"
        with step_progress(description, total, enabled=layout.is_main) as advance, _sink(path, layout.is_main) as sink:
            for sample in samples:
                answered = done.get((sample.task, sample.index), set())
                todo = [pair for pair in pairs if pair[0] not in answered]  # a resumed sweep's new pairs only
                if not todo:
                    advance(f"{sample.task} #{sample.index} (on disk)", skipped=True)
                    continue
                ids = encode(sample)
                copied = reference.get((sample.task, sample.index))
                if copied is not None and any(label == "full" for label, _, _ in todo):
                    _check_copied(copied, ids, full_from)
                    todo = [pair for pair in todo if pair[0] != "full"]
                sample_rows = [] if copied is None or "full" in answered else [copied]
                if todo:
                    sample_rows += _answer(
                        model,
                        tokenizer,
                        sample,
                        ids,
                        score,
                        todo,
                        regime,
                        max_new_tokens(sample),
                        stop(sample),
                        layout,
                        batch_answers,
                        raw_predictions,
                        bounded,
                        guide_chunks,
                        with_full=copied is None,
                    )
                try:
                    if unrecorded is not None:  # with the first row: a run that fails before leaves no settings
                        _record_settings(out_dir, unrecorded)
                        unrecorded = None
                    if layout.is_main and not rows:  # what each method name means, with this run's first rows
                        method_record.record(out_dir, described)
                    for row in sample_rows:
                        sink.write(json.dumps(row.record()) + "\n")
                    sink.flush()
                except OSError as error:  # a full disk: the rows written before are whole (a cut line is dropped)
                    raise CriticalKVError(
                        f"cannot write {error.filename or path}: {error.strerror}; the rows written so far are kept: "
                        "make room and run the same command again to resume"
                    ) from None
                rows.extend(sample_rows)
                advance(f"{sample.task} #{sample.index}")
        return rows
    finally:
        if lock is not None:
            lock.release()


def _full_rows(folder: Path, settings: dict | None, regime: str, bounded: dict | None) -> dict[tuple[str, int], Row]:
    """The full cache's rows of sweep ``folder`` in ``regime``, by (task, index), marked copied; refused unless this
    sweep is bounded and the folder's settings are this sweep's but for the bounded options."""
    Bounded(**(bounded or {})).check_full_from(folder)
    theirs = stored_settings(folder)
    if theirs is None:
        raise CriticalKVError(f"--full-from {folder}: no {SETTINGS_FILE} there, so its samples cannot be checked")
    ours = json.loads(json.dumps(settings or {}))  # as stored: tuples become lists
    listed = _differences(theirs, ours, skip="bounded")
    if listed:
        raise CriticalKVError(f"--full-from {folder} holds other samples or answers ({listed})")
    return {
        (row.task, row.index): dataclasses.replace(row, copied=True)
        for row in load_rows(folder / "results.jsonl")
        if row.method == "full" and row.regime == regime
    }


def _check_copied(row: Row, ids: tuple[list[int], list[int]], folder: Path) -> None:
    """Refuse a copied row whose prompt is not this sample's (the settings matched, so the code generating the
    samples changed between the two sweeps)."""
    tokens = len(ids[0]) + len(ids[1])
    if row.prompt_tokens != tokens:
        raise CriticalKVError(
            f"--full-from {folder}: {row.task} #{row.index} had {row.prompt_tokens} prompt tokens there, {tokens} "
            "here: the samples differ"
        )


def _lock_folder(out_dir: Path) -> tuple[FileLock | None, str | None]:
    """The folder's lock, held, or why it cannot be had: another sweep on the folder holds it (two sweeps on one
    folder each answered every sample and wrote every row twice). A second sweep fails at once rather than wait:
    resuming after the first one ends answers only what is left."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out_dir / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return None, (
            f"another sweep is writing to {out_dir} (it holds {out_dir / LOCK_FILE}): wait for it to end, then run "
            "this command again to answer what it left, or use another --out"
        )
    return lock, None


def _chat_ids(tokenizer, sample: ChatSample) -> tuple[list[int], list[int]]:
    return encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)


@torch.no_grad()
def _answer(
    model,
    tokenizer,
    sample: Sample,
    ids: tuple[list[int], list[int]],
    score,
    pairs,
    regime: str,
    max_new_tokens: int,
    stop: StopRule,
    layout: ParallelLayout,
    batch_answers: bool,
    raw_predictions: bool,
    bounded: dict | None = None,
    guide_chunks: bool = False,
    with_full: bool = True,
) -> list[Row]:
    """The rows of ``pairs`` for one sample of prompt ``ids`` (context ids, question ids); the full cache is
    prefilled in any case (the kept fractions' base), unless ``with_full`` is False (a chunked sweep whose full rows
    are copied: the base is then counted, ``CompressedCache.full_entries``)."""
    prefix_ids, suffix_ids = ids
    prompt = prefix_ids + suffix_ids if regime == "aware" else prefix_ids
    device = next(model.parameters()).device
    listed = any(label == "full" for label, _, _ in pairs)
    targets = pairs if listed or not with_full else [FULL_PAIR, *pairs]
    if bounded:  # each pair prefills in chunks on its own: no shared forward
        sessions = {label: ContextSession(model, method, budget, **bounded) for label, method, budget in targets}
        guide = torch.tensor([suffix_ids], device=device) if guide_chunks else None  # aware: run_sweep checked
        for session in sessions.values():
            session.prefill(torch.tensor([prompt], device=device), guide_ids=guide)
    else:
        sessions = SharedPrefill(model, targets).prefill(torch.tensor([prompt], device=device))
    if "full" in sessions:  # the whole model's, every rank's part counted
        full_entries = layout.total(sessions["full"].kv_entries())
    else:  # what the full cache would hold: every token in every layer (bounded: each session has its own cache)
        full_entries = layout.total(next(iter(sessions.values())).cache.full_entries())
    kept = {label: layout.total(session.kv_entries()) / full_entries for label, session in sessions.items()}
    texts, batched = {}, {}
    for group in _answer_groups([label for label, _, _ in pairs], batch_answers):
        session = sessions[group[0]] if len(group) == 1 else ContextSession.stacked([sessions[g] for g in group])
        question = None if regime == "aware" else torch.tensor([suffix_ids], device=device).expand(len(group), -1)
        generation = session.ask(
            question, max_new_tokens=max_new_tokens, eos_token_id=stop.token_ids, min_new_tokens=stop.min_new_tokens
        )
        for label, tokens in zip(group, generation.tokens, strict=True):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            texts[label] = text if raw_predictions else text.strip()
            batched[label] = len(group) > 1
    return [
        Row(
            sample.task,
            sample.index,
            regime,
            method,
            budget.value,
            score(sample, texts[label]),
            texts[label],
            len(prefix_ids) + len(suffix_ids),
            kept[label],
            batched[label],
        )
        for label, method, budget in pairs
    ]


def _answer_groups(labels: list[str], batch_answers: bool) -> list[list[str]]:
    """Labels that answer together: the full cache alone, then every compressed pair in one batch (each alone
    without ``batch_answers``)."""
    full = [["full"]] if "full" in labels else []
    compressed = [label for label in labels if label != "full"]
    if not batch_answers:
        return full + [[label] for label in compressed]
    return full + ([compressed] if compressed else [])


@contextmanager
def _sink(path: Path, writes: bool) -> Iterator[TextIO]:
    """``path`` opened for appending, or a sink that drops everything on a rank that does not write."""
    if not writes:
        yield io.StringIO()
        return
    with path.open("a") as sink:
        yield sink


def check_out_folder(path: Path) -> None:
    """Refuse an --out that cannot be a folder (a file, or inside one) before any work, such as loading a model.

    A folder that does not exist yet is fine: the sweep creates it.
    """
    problem = _out_folder_problem(path)
    if problem:
        raise CriticalKVError(problem)


def _out_folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a folder criticalkv writes; None when it can. The nearest existing path must
    be a folder this process may write in."""
    for existing in (path, *path.parents):
        if not existing.exists():
            continue
        if existing.is_dir():
            if not os.access(existing, os.W_OK | os.X_OK):
                return f"--out {path}: cannot write in {existing} (permission denied): give a folder you can write to"
            return None
        if existing == path:
            return f"--out {path} is a file, not a folder: give a folder (new, or a sweep's to resume it)"
        return f"--out {path} is inside {existing}, which is a file, not a folder: give another --out"
    return None


def _settings_conflict(out_dir: Path, settings: dict | None) -> str | None:
    """Why the folder's ``sweep.json`` forbids resuming with ``settings``; None when it allows it.

    A folder without ``sweep.json`` takes the settings of its first run that writes a row (``_record_settings``),
    unless it holds rows already: those were answered under settings nobody recorded (a folder of before
    ``sweep.json``, or one whose file was removed), which cannot be checked against these.
    A setting recorded on one side only (an option left at the default that records nothing) conflicts too.
    """
    if settings is None:
        return None
    settings = json.loads(json.dumps(settings))  # as stored: tuples become lists
    stored = stored_settings(out_dir)
    results = out_dir / "results.jsonl"
    if stored is None and results.is_file() and load_rows(results):
        return (
            f"{out_dir} holds results but no {SETTINGS_FILE}: under which settings its rows were answered is not "
            "recorded, so they cannot be checked against this run's; use another --out"
        )
    if stored is not None:
        listed = _differences(stored, settings)
        if listed:
            return (
                f"{out_dir} holds a sweep with other settings ({listed}): its rows would mix with this run's; "
                "use another --out"
            )
    return None


def _record_settings(out_dir: Path, settings: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / SETTINGS_FILE, settings, indent=2)


def _differences(stored: dict, settings: dict, skip: str | None = None) -> str:
    """The settings that differ between a folder's ``stored`` ones and this run's (``skip`` aside), one
    ``name: stored there, given now`` each; empty where none do."""
    changed = [k for k in stored | settings if k != skip and stored.get(k) != settings.get(k)]
    return "; ".join(f"{k}: {stored.get(k)!r} there, {settings.get(k)!r} now" for k in changed)


def stored_settings(folder: Path) -> dict | None:
    """The settings a sweep folder records in its ``sweep.json``; None for a folder without one."""
    path = folder / SETTINGS_FILE
    if not path.exists():
        return None
    remedy = "the file is damaged (a run stopped while writing it, or a full disk): restore it, or use another --out"
    return read_json(path, remedy)


def _answered(path: Path, regime: str) -> dict[tuple[str, int], set[str]]:
    """The pairs (labels) that answered each sample of this regime on disk: a resumed run answers only the rest.

    Makes the file ready for appending: an incomplete last line (a killed run's) is cut off, and a missing final
    newline added, so the next row starts a line of its own.
    """
    if not path.exists():
        return {}
    rows, cut = _read_results(path)
    if cut is not None:
        write_atomic(path, cut)
    seen: dict[tuple[str, int], set[str]] = {}
    for row in rows:
        if row["regime"] == regime:
            label = pair_label(row["method"], Budget(row["budget"]))  # as stored: Budget(1) too
            seen.setdefault((row["task"], row["index"]), set()).add(label)
    return seen


def load_rows(path: Path) -> list[Row]:
    """Rows of a results.jsonl file (without an incomplete last line: ``_read_results``)."""
    rows, _ = _read_results(path)
    return [Row(**row) for row in rows]


def _read_results(path: Path) -> tuple[list[dict], str | None]:
    """The rows of a results.jsonl as dicts, and the text to rewrite it with before appending (None: as it is).

    A last line without its newline that is not JSON is what a run killed mid-write leaves: it is dropped with an
    ``IncompleteRowWarning`` (resuming answers that pair again). Any other line that is not JSON is corruption.
    """
    text = path.read_text()
    *complete, last = text.split("\n")  # last: "" when the file ends with a newline, else its unfinished line
    rows = []
    for number, line in enumerate(complete, 1):
        if line.strip():
            rows.append(_parse_row(path, number, line))
    if not last.strip():
        return rows, None
    try:
        rows.append(json.loads(last))
    except json.JSONDecodeError:
        warnings.warn(
            f"{path}: line {len(complete) + 1} is incomplete (a run stopped while writing it); it is dropped, and "
            "that sample will be answered again when the sweep resumes",
            IncompleteRowWarning,
            stacklevel=3,
        )
        return rows, text[: len(text) - len(last)]
    return rows, text + "\n"  # a complete last row without its newline: the next row must not join its line


def _parse_row(path: Path, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise CriticalKVError(
            f"{path}: line {number} is not a JSON row ({error.msg}): the file is corrupted; fix or delete that "
            "line (the sweep answers its sample again), or use another --out"
        ) from None
