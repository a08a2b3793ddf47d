"""The code task's strict extraction: the last closed ```python block, nothing else."""

import pytest

from dorarl.tasks.code_blocks import final_code_block


@pytest.mark.parametrize(
    "text, code",
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("first\n```python\nx = 1\n```\nthen\n```py\nprint(2)\n```\ndone", "print(2)\n"),
        ("```python\nprint(1)\n```\n```text\nnot code\n```", "print(1)\n"),
        ("```Python \nprint(3)\n```  ", "print(3)\n"),
    ],
)
def test_the_last_closed_python_block_is_the_program(text, code):
    assert final_code_block(text) == code


@pytest.mark.parametrize(
    "text",
    [
        "print(1)",  # prose or bare code
        "```python\nprint(1)\n",  # never closed
        "```\nprint(1)\n```",  # no language
        "```javascript\nconsole.log(1)\n```",
        "```python\n\n```",  # empty
        "text ```python\nprint(1)\n```",  # not at a line's start
    ],
)
def test_anything_else_gives_no_program(text):
    assert final_code_block(text) is None
