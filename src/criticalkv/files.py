"""Files criticalkv rewrites: written whole or not at all, and read back with an error that names the file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

from criticalkv.errors import UnreadableFileError


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace ``path``'s content with ``data`` (text as UTF-8, or bytes), all of it or none.

    The data go to a temporary file in the same folder, flushed to disk, which then takes ``path``'s name
    (``os.replace``, atomic within a file system): a full disk or a kill while writing leaves the old file whole, never
    a truncated or empty one. The new file keeps the old one's permissions (a new one gets the umask's).
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with temporary.open("xb") as out:  # created as a new file is: the umask's permissions
            out.write(data.encode("utf-8") if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        if path.exists():
            shutil.copymode(path, temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself reaches the disk with the folder's entry
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def write_json(path: Path, data: object, **dump: object) -> None:
    """``data`` as JSON (``json.dumps`` with ``dump``), ending with a newline, written by ``write_atomic``."""
    write_atomic(path, json.dumps(data, **dump) + "\n")


def read_json(path: Path, remedy: str) -> object:
    """The JSON value of ``path``; ``UnreadableFileError`` naming the file and ``remedy`` (what the user can do)
    when it cannot be read, is empty, is not UTF-8 or is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: JSONDecodeError and UnicodeDecodeError
        reason = "it is empty" if isinstance(error, json.JSONDecodeError) and not error.doc.strip() else str(error)
        raise UnreadableFileError(f"cannot read {path} ({reason}): {remedy}") from None
