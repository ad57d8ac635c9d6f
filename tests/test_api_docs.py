"""docs/api.md names every public name of the package, shows each callable's signature as the code has it, and is
what docs/make_api.py generates from the code today."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import criticalkv.errors

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"
#: the modules whose ``__all__`` docs/api.md must cover, one heading a name
MODULES = (
    "criticalkv",
    "criticalkv.scorers",
    "criticalkv.allocators",
    "criticalkv.selectors",
    "criticalkv.cache",
    "criticalkv.models",
    "criticalkv.analysis",
    "criticalkv.distributed",
)
#: a heading: ### `dotted.name`, then optionally a ```python block whose first line is the signature
HEADING = re.compile(r"^### `([\w.]+)`\n(?:\n```python\n(.*?)\n```)?", re.M | re.S)


def _load_make_api():
    """docs/make_api.py, the generator of docs/api.md (a script, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("make_api", API.parent / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_api = _load_make_api()  # resolve, rendered_signature and has_signature_block: one rendering for both


def documented() -> dict[str, str | None]:
    return {m.group(1): m.group(2) for m in HEADING.finditer(API.read_text())}


def public_names() -> list[str]:
    names = [f"{module}.{name}" for module in MODULES for name in importlib.import_module(module).__all__]
    errors = [
        f"criticalkv.errors.{name}"
        for name, value in vars(criticalkv.errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == "criticalkv.errors"
    ]
    return names + errors


def test_every_public_name_has_a_heading() -> None:
    missing = [name for name in public_names() if name not in documented()]
    assert not missing, f"docs/api.md has no heading for {missing}"


@pytest.mark.parametrize("heading", sorted(documented()))
def test_each_signature_is_the_codes(heading: str) -> None:
    obj = make_api.resolve(heading)
    block = documented()[heading]
    short = heading.rsplit(".", 1)[1]
    if not make_api.has_signature_block(obj):
        assert block is None, f"{heading} is a value, an exception or a protocol: no signature block"
        return
    signature = make_api.rendered_signature(short, obj)
    if block is None:
        pytest.fail(f"{heading} has no signature block; the code's: {signature}")
    assert block.splitlines()[0] == signature


def test_method_names_come_in_the_order_of_the_readme_table():
    """docs/api.md says ``method_names()`` (what ``./ckv methods`` prints) is the README's table of presets."""
    from criticalkv import method_names

    readme = (API.parent.parent / "README.md").read_text()
    assert re.findall(r"(?m)^\| `([a-z-]+)` \|", readme) == method_names()


def test_api_md_is_generated_from_the_code() -> None:
    """A docstring or signature changed since docs/api.md was written: run ``python docs/make_api.py``."""
    assert API.read_text() == make_api.render(), "docs/api.md is out of date: run python docs/make_api.py"
