"""Several sweep folders of the same samples as one: runs split over processes or machines, or extended later."""

from __future__ import annotations

import json
from pathlib import Path

from criticalkv.errors import CriticalKVError
from criticalkv.eval import method_record
from criticalkv.eval.sweep import SETTINGS_FILE, Row, budget_id, check_out_folder, load_rows, stored_settings
from criticalkv.files import write_atomic, write_json


def merge_sweeps(folders: list[Path], out: Path, methods: list[str] | None = None) -> int:
    """Write the rows of ``folders`` (each with a results.jsonl) into ``out``; returns the number of rows.

    ``methods``: keep only these methods' rows and the full cache's (the loss needs it); each must have rows.

    The folders must hold sweeps with the same settings (their ``sweep.json``: model, length, seed, ...; folders
    without one only among themselves) and the same configuration of each method name (``methods.json``). A
    (regime, task, index, method, budget) answered in several folders is kept once, and only if every folder gave
    the same answer: two answers that differ mean other settings or other code (or, for rows answered with
    ``--batch-answers``, bfloat16 rounding), and the merge refuses them rather than choose.

    ``out`` must be a new or empty folder, or at least one without a sweep: the merge never overwrites results.
    """
    _check_out(folders, out)
    settings = {folder: stored for folder in folders if (stored := stored_settings(folder)) is not None}
    unrecorded = [str(folder) for folder in folders if folder not in settings]
    if settings and unrecorded:
        raise CriticalKVError(
            f"{', '.join(unrecorded)} record no {SETTINGS_FILE} (the sweep's settings), the other folders do: whether "
            "their rows were answered under the same settings cannot be checked"
        )
    if len({json.dumps(s, sort_keys=True) for s in settings.values()}) > 1:
        listed = "; ".join(f"{folder}: {s}" for folder, s in settings.items())
        raise CriticalKVError(f"the folders hold sweeps with other settings ({listed})")
    configurations = method_record.merged(folders)  # a method name meaning two configurations is refused
    rows: dict[tuple, tuple[Row, Path]] = {}
    for folder in folders:
        path = folder / "results.jsonl"
        if not path.is_file():
            raise CriticalKVError(f"no results.jsonl in {folder}")
        for row in load_rows(path):
            if methods is not None and row.method not in methods and row.method != "full":
                continue
            key = (row.regime, row.task, row.index, row.method, budget_id(row.budget))
            if key not in rows:
                rows[key] = (row, folder)
            elif rows[key][0].prediction != row.prediction:
                first, where = rows[key]
                raise CriticalKVError(
                    f"{key} is answered differently in {where} ({first.prediction!r}, batched={first.batched}) and "
                    f"{folder} ({row.prediction!r}, batched={row.batched}): merge folders of the same samples and code"
                )
    missing = sorted(set(methods or ()) - {row.method for row, _ in rows.values()})
    if missing:
        raise CriticalKVError(f"no rows of {missing} in {', '.join(map(str, folders))}")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.jsonl", "".join(json.dumps(row.record()) + "\n" for row, _ in rows.values()))
    if settings:
        write_json(out / SETTINGS_FILE, next(iter(settings.values())), indent=2)
    if configurations:
        method_record.record(out, configurations)
    return len(rows)


def _check_out(folders: list[Path], out: Path) -> None:
    """Refuse an ``out`` that is a file, one of ``folders``, or another sweep's folder (its rows would be lost)."""
    check_out_folder(out)
    if out.resolve() in {folder.resolve() for folder in folders}:
        raise CriticalKVError(f"--out {out} is one of the folders to merge: choose a new folder")
    held = [name for name in ("results.jsonl", SETTINGS_FILE) if (out / name).exists()]
    if held:
        raise CriticalKVError(
            f"--out {out} already holds a sweep ({', '.join(held)}): the merge would overwrite it; "
            "choose a new or empty folder"
        )
