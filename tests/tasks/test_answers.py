"""Final-answer extraction: boxed, "answer is", "=", last math; never copied arithmetic, never a
hedge between values."""

import pytest

from dorarl.tasks.answers import extract_final_answer, is_unevaluated_arithmetic, last_boxed


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("\\boxed{158}", "158"),
        ("So 91 + 67 = 158, which is \\boxed{158}. The answer is 157.", "158"),  # boxed first
        ("\\boxed{\\frac{1}{2}}, so \\boxed{x = 5}", "5"),  # the last box; its equation's value
        ("The answer is 158.", "158"),
        ("The answer is 158. Check: 158 - 67 = 91.", "158"),  # "answer is" beats a later "="
        ("The answer is **158**.", "158"),
        ("Answer:\n158", "158"),
        ("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("The answer is 158 apples, since I counted.", "158"),
        ("91 + 67 = 158", "158"),
        ("158 = 91 + 67", "158"),  # a chain's last evaluated side
        ("Thus 158 = 91 + 67.", "158"),
        ("91 + 67 = 158. I hope this helps!", "158"),  # trailing text
        ("So, 91 + 67 = 158 apples.", "158"),
        ("\\[ 91 + 67 = 158 \\]", "158"),
        ("91 + 67 = ?\n158", "158"),  # stated after the restated question
        ("I think 157, no wait, 158", "158"),  # several numbers: the last
        ("The sum of 91 and 67 is 158.", "158"),
        ("The result is $2\\sqrt{2}$, done", "2\\sqrt{2}"),
        ("-5", "-5"),
        ("The answer is 3.5.", "3.5"),
        ("48 / 2 = 24 in May, 24 + 48 = 70 in all.\n#### 72", "72"),  # GSM8K's mark
        ("She has 5 left.\n#### 1,000 dollars", "1,000"),
        ("The answer is 1,234", "1,234"),
        ("5.", "5"),
        ("\\boxed{12}", "12"),
        ("x = 5", "5"),
        ("The answer is 5 km.", "5"),
        ("The answer is 5, 6.", "5, 6"),  # a list in one piece: one answer, for the verifier
        ("The answer is 5 or 5", "5"),  # one value, said twice
        ("\\boxed{5} or \\boxed{5}", "5"),
        ("The answer is 5, not 6.", "5"),
        ("x = 2 and y = 5", "5"),  # values of two things, not two values of one
        ("The answer is 5 or more", "5"),
        ("The answer is 5 because 2 or 3 fail.", "5"),  # a hedge in the working, not the answer
    ],
)
def test_extracts_the_final_answer(response, expected):
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "91 + 67 = ?",  # the question restated: a reward exploit, never a final answer
        "What is 91 plus 67? 91 + 67 = ?",
        "The answer is 91 + 67.",
        "\\boxed{91+67}",
        "\\boxed{3 \\times 4}",
        "The result is $91 + 67$",
        "91+67=150+8",
        "The answer is not obvious.",
        "What is 64 minus 17? Subtract 17 from 64 = ?",
        "",
    ],
)
def test_states_no_answer_when_only_arithmetic_or_prose_is_given(response):
    assert extract_final_answer(response) is None


@pytest.mark.parametrize(
    "response",
    [
        "the answer is 5 or 6",
        "\\boxed{5 \\text{ or } 6}",
        "The answer is between 5 and 6",
        "\\boxed{5 \\vee 6}",
        "The answer is 5 and/or 6",
        "The answer is either 5 or 6.",
        "\\boxed{5 \\lor 6}",
        "The answer is 5 ∨ 6",
        "\\boxed{5} or \\boxed{6}",
        "$\\boxed{5}$, $\\boxed{6}$",
        "The answer is 5 (or maybe 6).",
        "The answer is 3 meters or 4 meters.",
        "The answer is 5 and 6.",
        "x = 5 or x = 6",
        "I think 5 or 6",
        "$\\frac{1}{2} \\text{ or } 0.6$",
        "The answer is 5 or 6. Check: 2 + 3 = 5.",  # a hedge ends the search
    ],
)
def test_an_answer_offering_several_values_states_none(response):
    assert extract_final_answer(response) is None


def test_a_restated_question_without_equals_yields_its_last_operand_not_the_sum():
    assert extract_final_answer("What is 91 plus 67?") == "67"
    assert extract_final_answer("91 + 67") == "67"


@pytest.mark.parametrize(
    ("text", "unevaluated"),
    [
        ("91 + 67", True),
        ("10-2", True),
        ("3 \\times 4", True),
        ("(2+3)*4", True),
        ("-5", False),
        ("1/2", False),
        ("2^{10}", False),
        ("1 + \\sqrt{2}", False),
        ("x + 1", False),
        ("10^{-3}", False),
    ],
)
def test_unevaluated_arithmetic(text, unevaluated):
    assert is_unevaluated_arithmetic(text) is unevaluated


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("no box") is None
