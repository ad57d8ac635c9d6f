"""docs/api.md names every public name of the package, shows each callable's signature as the code has it, and is
what docs/make_api.py generates from the code today."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
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


def resolve(dotted: str) -> object:
    """The object a dotted name names, attributes first: ``criticalkv.analysis.capture`` is the function the
    package exports, not the module of the same name."""
    first, *rest = dotted.split(".")
    obj, path = importlib.import_module(first), first
    for name in rest:
        path += "." + name
        obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(path)
    return obj


def _default(parameter: inspect.Parameter) -> str:
    value = parameter.default
    if value is dataclasses.MISSING or repr(value) == "<factory>":
        return "..."
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # "x", and "\n\n" for a separator as the code writes it
    return repr(value)


def rendered_signature(name: str, obj: object) -> str:
    """``name(a, b=1, *, c="x", **options)``: parameters without annotations, ``self``/``cls`` left out."""
    parts, star = [], False
    for parameter in inspect.signature(obj).parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        if parameter.kind is parameter.VAR_POSITIONAL:
            parts.append("*" + parameter.name)
            star = True
        elif parameter.kind is parameter.VAR_KEYWORD:
            parts.append("**" + parameter.name)
        else:
            if parameter.kind is parameter.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            text = parameter.name
            if parameter.default is not parameter.empty:
                text += "=" + _default(parameter)
            parts.append(text)
    return f"{name}({', '.join(parts)})"


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


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
    obj = resolve(heading)
    block = documented()[heading]
    short = heading.rsplit(".", 1)[1]
    if not callable(obj) or (isinstance(obj, type) and (issubclass(obj, Exception) or _is_protocol(obj))):
        assert block is None, f"{heading} is a value, an exception or a protocol: no signature block"
        return
    if block is None:
        pytest.fail(f"{heading} has no signature block; the code's: {rendered_signature(short, obj)}")
    assert block.splitlines()[0] == rendered_signature(short, obj)


def test_method_names_come_in_the_order_of_the_readme_table():
    """docs/api.md says ``method_names()`` (what ``./ckv methods`` prints) is the README's table of presets."""
    from criticalkv import method_names

    readme = (API.parent.parent / "README.md").read_text()
    assert re.findall(r"(?m)^\| `([a-z-]+)` \|", readme) == method_names()


def test_api_md_is_generated_from_the_code() -> None:
    """A docstring or signature changed since docs/api.md was written: run ``python docs/make_api.py``."""
    spec = importlib.util.spec_from_file_location("make_api", API.parent / "make_api.py")
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    assert API.read_text() == make_api.render(), "docs/api.md is out of date: run python docs/make_api.py"
