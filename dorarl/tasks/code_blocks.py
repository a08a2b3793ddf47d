"""The program a response gives: its last closed fenced code block in the task's language.

Strict: only a block opened by three backticks and the language's name (```python, or its
alias ```py) at a line's start and closed by three backticks on a line of their own counts;
prose, an unclosed block or a block in another language gives no program.
"""

from __future__ import annotations

import re

LANGUAGES = {"python": ("python", "py", "python3")}

_BLOCK = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]+)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def final_code_block(text: str, language: str = "python") -> str | None:
    """The code of the last closed ```language block in `text`, or None."""
    names = LANGUAGES.get(language, (language,))
    found = None
    for match in _BLOCK.finditer(text):
        if match.group(1).lower() in names:
            found = match.group(2)
    if found is None or not found.strip():
        return None
    return found
