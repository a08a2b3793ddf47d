"""The console a command prints its tables on: fitted to the terminal on one, unbounded off it.

Off a terminal (a pipe, a log file, CI) rich would fit every table to 80 columns and cut
its headers and cells; there no line is too long, so nothing is cut or folded.
"""

from __future__ import annotations

from rich.console import Console

OFF_TERMINAL_WIDTH = 10_000
"""Columns of a console that is not a terminal: wider than any table we print."""


def table_console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that cuts no table off a terminal."""
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.width = OFF_TERMINAL_WIDTH
    return console
