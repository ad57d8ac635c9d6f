"""Writes docs/api.md from the code: every public name, its signature and the first paragraph of its docstring.

python docs/make_api.py          # rewrites docs/api.md; tests/test_api_docs.py checks it is up to date
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from pathlib import Path

API = Path(__file__).resolve().parent / "api.md"
#: (section title, module whose ``__all__`` it documents, further dotted names users call)
SECTIONS = (
    ("Compressing a model", "criticalkv", ("criticalkv.Budget.entries_for",)),
    (
        "Sessions: one context, many questions",
        None,
        (
            "criticalkv.runtime.session.ContextSession",
            "criticalkv.runtime.session.ContextSession.prefill",
            "criticalkv.runtime.session.ContextSession.ask",
            "criticalkv.runtime.session.ContextSession.stream",
            "criticalkv.runtime.session.ContextSession.save",
            "criticalkv.runtime.session.ContextSession.load",
            "criticalkv.runtime.session.ContextSession.rewind",
            "criticalkv.runtime.session.ContextSession.kv_bytes",
            "criticalkv.runtime.session.ContextSession.kv_entries",
            "criticalkv.runtime.session.Generation",
            "criticalkv.runtime.shared_prefill.SharedPrefill",
            "criticalkv.runtime.shared_prefill.SharedPrefill.prefill",
        ),
    ),
    ("Prompts", None, ("criticalkv.prompts.encode_prompt_parts", "criticalkv.eval.needle.build_needle_sample")),
    ("Models", "criticalkv.models", ()),
    (
        "Scorers",
        "criticalkv.scorers",
        (
            "criticalkv.scorers.Scorer.score",
            "criticalkv.scorers.Scorer.protected",
            "criticalkv.scorers.Scorer.score_after_prefill",
            "criticalkv.scorers.Scorer.check_config",
            "criticalkv.scorers.Scorer.check_model",
        ),
    ),
    (
        "Allocators",
        "criticalkv.allocators",
        (
            "criticalkv.allocators.Allocator.allocate",
            "criticalkv.allocators.Allocator.allocate_layers",
            "criticalkv.allocators.Allocator.settle",
        ),
    ),
    (
        "Selectors",
        "criticalkv.selectors",
        ("criticalkv.selectors.Selector.select", "criticalkv.selectors.Selector.rank"),
    ),
    (
        "The cache",
        "criticalkv.cache",
        (
            "criticalkv.cache.CompressedCache.nbytes",
            "criticalkv.cache.CompressedCache.entries",
            "criticalkv.runtime.persist.save_cache",
            "criticalkv.runtime.persist.load_cache",
        ),
    ),
    ("Errors", "criticalkv.errors", ()),
    ("Perturbation analysis", "criticalkv.analysis", ()),
    ("Tensor and pipeline parallelism", "criticalkv.distributed", ()),
)
HEADER = """# Python API reference

Generated from the code by `python docs/make_api.py`: every public name with its signature and the first paragraph
of its docstring (`help(name)` gives the rest). Shapes: `b` batch rows, `t` context entries, `h_kv` KV heads, `h_q`
query heads, `d` head size. The README shows these pieces working together; [extending.md](extending.md) the
contracts of a scorer, allocator and selector of your own.
"""


def resolve(dotted: str) -> object:
    """The object a dotted name names, attributes first (``criticalkv.analysis.capture`` is the function the package
    exports, not the module of the same name)."""
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
        return json.dumps(value, ensure_ascii=False)  # double quotes; a newline shows as \n
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


def has_signature_block(obj: object) -> bool:
    """Callables get a signature block; values, exceptions and protocols do not."""
    if not callable(obj):
        return False
    return not (isinstance(obj, type) and (issubclass(obj, Exception) or getattr(obj, "_is_protocol", False)))


def error_names() -> list[str]:
    import criticalkv.errors

    return [
        f"criticalkv.errors.{name}"
        for name, value in vars(criticalkv.errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == "criticalkv.errors"
    ]


def names_of(module: str | None) -> list[str]:
    if module is None:
        return []
    if module == "criticalkv.errors":
        return error_names()
    return [f"{module}.{name}" for name in importlib.import_module(module).__all__]


def _summary(obj: object) -> str:
    """The docstring's first paragraph, or a value's own description."""
    doc = inspect.getdoc(obj) if (callable(obj) or inspect.ismodule(obj)) else None
    if not doc:
        return f"A value: `{type(obj).__name__}`." if not callable(obj) else ""
    return " ".join(doc.split("\n\n")[0].split())


def render() -> str:
    lines = [HEADER]
    for title, module, extra in SECTIONS:
        lines.append(f"## {title}\n")
        for dotted in [*names_of(module), *extra]:
            obj = resolve(dotted)
            lines.append(f"### `{dotted}`\n")
            if has_signature_block(obj):
                lines.append(f"```python\n{rendered_signature(dotted.rsplit('.', 1)[1], obj)}\n```\n")
            summary = _summary(obj)
            if summary:
                lines.append(summary + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    API.write_text(render())
    print(f"wrote {API}")
