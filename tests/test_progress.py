"""Step progress: a rich bar in a terminal, one plain line per step with elapsed time and ETA in a log file."""

from __future__ import annotations

import io

from rich.console import Console

from criticalkv.progress import step_progress


def _log_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=200), buffer


def test_log_file_gets_one_line_per_step_with_eta_and_skipped_steps_are_silent():
    console, buffer = _log_console()
    with step_progress("sweep", 4, console=console) as advance:
        advance("qa_1 #0 (on disk)", skipped=True)
        advance("qa_1 #1")
        advance("qa_1 #2")
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("sweep: 2/4 qa_1 #1 (elapsed 0:00:")
    assert lines[1].startswith("sweep: 3/4 qa_1 #2 (elapsed 0:00:")
    assert all(", ETA 0:00:" in line for line in lines)


def test_unknown_total_has_no_eta_and_disabled_progress_prints_nothing():
    console, buffer = _log_console()
    with step_progress("run", None, console=console) as advance:
        advance()
    assert buffer.getvalue().strip().startswith("run: 1/? (elapsed 0:00:")
    assert "ETA" not in buffer.getvalue()
    console, buffer = _log_console()
    with step_progress("run", 3, enabled=False, console=console) as advance:
        advance("x")
    assert buffer.getvalue() == ""


def test_terminal_gets_a_bar_that_counts_every_step():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with step_progress("sweep", 2, console=console) as advance:
        advance("a", skipped=True)
        advance("qa_1 #7")
    assert "2/2" in buffer.getvalue() and "sweep: qa_1 #7" in buffer.getvalue()
