"""What each method name of a sweep folder meant: its preset's full configuration, kept in ``methods.json``.

A row records its method as typed (``measured-snapkv``). When the code changes a preset's defaults, rows answered
before and after would average under one name; the folder records each name's configuration (the built method's
``repr``: every piece and option) with its first rows, and a run or a merge whose configuration of a name differs
is refused.
"""

from __future__ import annotations

from pathlib import Path

from criticalkv.errors import CriticalKVError
from criticalkv.files import read_json, write_json
from criticalkv.methods import build_method

METHODS_FILE = "methods.json"


def describe(methods: list[str]) -> dict[str, str]:
    """Each compressing method's configuration, by the name the rows record: {name: repr of the built method}."""
    return {name: repr(build_method(name)) for name in methods if name != "full"}


def recorded(folder: Path) -> dict[str, str]:
    """The configurations a folder records ({} for a folder without ``methods.json``)."""
    path = folder / METHODS_FILE
    if not path.exists():
        return {}
    return read_json(path, "the file is damaged (a run stopped while writing it, or a full disk): delete it to resume")


def changed(stored: dict[str, str], described: dict[str, str]) -> list[str]:
    """The names that ``stored`` and ``described`` configure differently."""
    return sorted(name for name in stored.keys() & described.keys() if stored[name] != described[name])


def conflict(folder: Path, described: dict[str, str]) -> str | None:
    """Why the folder's rows cannot be resumed by a run of ``described`` (a name meaning another configuration
    there); None when they can."""
    stored = recorded(folder)
    names = changed(stored, described)
    if not names:
        return None
    return (
        f"{folder} holds rows of {', '.join(names)} made with another configuration (there: {stored[names[0]]}; now: "
        f"{described[names[0]]}): a preset's defaults changed since, and its rows would mix with this run's under one "
        "name. Use another --out, or name the method with its options (e.g. 'snapkv:window=64')"
    )


def record(folder: Path, described: dict[str, str]) -> None:
    """Add ``described`` to the folder's ``methods.json``."""
    write_json(folder / METHODS_FILE, {**recorded(folder), **described}, indent=2, sort_keys=True)


def merged(folders: list[Path]) -> dict[str, str]:
    """The configurations of several folders together; ``CriticalKVError`` if a name means two of them."""
    union: dict[str, str] = {}
    for folder in folders:
        own = recorded(folder)
        names = changed(union, own)
        if names:
            raise CriticalKVError(
                f"{folder} records another configuration of {', '.join(names)} than the folders before it "
                f"({own[names[0]]} against {union[names[0]]}): their rows would mix under one name"
            )
        union.update(own)
    return union
