"""Every command line the README and docs/ show uses commands, options and methods that exist.

A code block's ``criticalkv ...`` / ``./ckv ...`` / ``torchrun ... -m criticalkv.cli ...`` lines are checked against
the CLI itself (its click commands, without running them); ``python benchmarks/<script>.py`` lines against the
script's own option strings (and those of the benchmark modules it imports); ``--method`` / ``--methods`` values
against the method presets.
"""

import re
import shlex
import textwrap
from pathlib import Path

import pytest
import typer

from criticalkv.cli import app
from criticalkv.methods import build_method

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^ *```[a-z]*\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"^\n(    \S.*\n(?:    .*\n)*)", re.MULTILINE)  # a Markdown code block by indentation
INLINE = re.compile(r"`((?:criticalkv|\./ckv|python benchmarks/)[^`]*)`")  # a command in the prose
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
CLI = typer.main.get_command(app)


def _commands_of(text: str) -> list[list[str]]:
    """The token lists of a page's commands (code blocks, and code spans in the prose that start as a command):
    continuations joined, comments and env settings dropped."""
    commands = []
    blocks = BLOCK.findall(text) + [textwrap.dedent(b) for b in INDENTED.findall(text)]
    blocks += [span.replace("\n", " ") for span in INLINE.findall(text)]
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = _shell_words(line)
            except ValueError:  # not shell (a Python snippet or output)
                continue
            while tokens:
                cut = next((i for i, t in enumerate(tokens) if t in ("&&", "||", "|", ";")), len(tokens))
                words = tokens[:cut]
                while words and ENV.match(words[0]):
                    words = words[1:]
                if words:
                    commands.append(words)
                tokens = tokens[cut + 1 :]
    return commands


def _shell_words(line: str) -> list[str]:
    """``line``'s words as a shell reads them, with ``;`` ``&&`` ``|`` as words of their own even when unspaced."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    return list(lexer)


def _cli_arguments(words: list[str]) -> list[str] | None:
    """The arguments after ``criticalkv`` of a command that runs the CLI, else None."""
    if words[0] in ("criticalkv", "./ckv"):
        return [] if words[1:2] == ["test"] else words[1:]
    if words[0] == "torchrun" and "criticalkv.cli" in words:
        return words[words.index("criticalkv.cli") + 1 :]
    return None


def _option(command, name: str):
    """The parameter of a click command (typer's own copy of click) that ``--name`` sets, or None."""
    return next((p for p in command.params if name in (*p.opts, *p.secondary_opts)), None)


def _cli_problems(arguments: list[str]) -> list[str]:
    """What in ``arguments`` the CLI does not have: unknown commands, options, methods."""
    command, problems, i = CLI, [], 0
    while i < len(arguments):
        word = arguments[i]
        name = word.split("=")[0]
        if hasattr(command, "commands") and (word == "..." or word.startswith("<")):
            break  # a placeholder for a command ("eval ...", "<command>"): its options are unknown here
        if word == "--help":
            pass  # every command has it
        elif word.startswith("--"):
            param = _option(command, name)
            if param is None:
                problems.append(f"{command.name}: no option {name}")
            elif not param.is_flag and "=" not in word and i + 1 < len(arguments):
                i += 1  # the option's value
                problems += _method_problems(arguments[i]) if name in ("--method", "--methods") else []
        elif word in getattr(command, "commands", {}):
            command = command.commands[word]
        elif hasattr(command, "commands"):
            problems.append(f"{command.name}: no command {word}")
        i += 1
    return problems


def _method_problems(value: str) -> list[str]:
    problems = []
    for spec in filter(None, value.split(",")):  # "" asks for the full cache alone
        if spec.startswith("$") or "..." in spec:  # a shell variable or a placeholder
            continue
        try:
            build_method(spec)
        except ValueError as error:
            problems.append(str(error))
    return problems


def _script_problems(words: list[str]) -> list[str]:
    """A ``python benchmarks/...py`` command's missing script or options it does not define."""
    script = next((w for w in words if w.startswith("benchmarks/") and w.endswith(".py")), None)
    if script is None or not words[0].endswith("python"):
        return []
    path = ROOT / script
    if not path.exists():
        return [f"no script {script}"]
    source = path.read_text()
    imported = re.findall(r"^(?:from|import) (\w+)", source, re.MULTILINE)
    source += "".join((path.parent / f"{m}.py").read_text() for m in imported if (path.parent / f"{m}.py").exists())
    options = {w.split("=")[0] for w in words[words.index(script) + 1 :] if w.startswith("--")}
    return [f"{script}: no option {o}" for o in sorted(options) if f'"{o}"' not in source]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_commands_exist(page):
    problems = []
    for words in _commands_of(page.read_text()):
        arguments = _cli_arguments(words)
        found = _cli_problems(arguments) if arguments is not None else _script_problems(words)
        problems += [f"{' '.join(words)[:100]}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands():
    commands = [words for page in PAGES for words in _commands_of(page.read_text())]
    assert sum(_cli_arguments(w) is not None for w in commands) > 20
    assert sum(bool(w) and w[0].endswith("python") and "benchmarks/" in " ".join(w) for w in commands) > 20


def test_a_wrong_option_or_method_is_caught():
    assert _cli_problems(["eval", "ruler", "--methodz", "snapkv"]) == ["ruler: no option --methodz"]
    assert _cli_problems(["run", "--method", "snapkv:windw=3"])
    assert _cli_problems(["evaluate"]) == [": no command evaluate"]
    assert _cli_problems(["eval", "...", "--anything"]) == []  # a placeholder command: nothing known to check
    assert _commands_of("Run `criticalkv evl ruler`; then `./ckv run --methodz x; ./ckv run`.\n") == [
        ["criticalkv", "evl", "ruler"],
        ["./ckv", "run", "--methodz", "x"],
        ["./ckv", "run"],
    ]
    assert _script_problems(["python", "benchmarks/speed_memory.py", "--lenghts", "2048"]) == [
        "benchmarks/speed_memory.py: no option --lenghts"
    ]
