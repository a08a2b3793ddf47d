"""Write the code task's shipped problems, assets/code/problems.jsonl: about 200 short Python
problems in families (stdin/stdout programs and functions checked by asserts), each test's
expected output computed by a reference solution here, the families' rows shuffled
together, seeded so the file is reproducible.

    python scripts/make_code_problems.py [--out assets/code/problems.jsonl] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

TAIL = (
    "Read with input() and print only the answer, with no other text. "
    "Give your whole program in one ```python code block."
)
FN_TAIL = "Give the function in one ```python code block; do not read input or print."
TESTS = 5

Problem = dict


def io_problem(task: str, reads: str, solve: Callable[[str], str], inputs: list[str]) -> Problem:
    prompt = (
        f"Write a Python program that reads {reads} from standard input and prints {task}. {TAIL}"
    )
    tests = [{"stdin": text, "stdout": solve(text) + "\n"} for text in inputs]
    return {"prompt": prompt, "language": "python", "tests": tests}


def fn_problem(signature: str, task: str, fn: Callable, args: list[tuple]) -> Problem:
    name = signature.split("(")[0]
    prompt = f"Write a Python function `{signature}` that returns {task}. {FN_TAIL}"
    tests = [{"assert": f"assert {name}{_call(a)} == {fn(*a)!r}"} for a in args]
    return {"prompt": prompt, "language": "python", "tests": tests}


def _call(args: tuple) -> str:
    return "(" + ", ".join(repr(a) for a in args) + ")"


def ints(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [f"{rng.randint(lo, hi)}\n" for _ in range(TESTS)]


def pairs(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [f"{rng.randint(lo, hi)} {rng.randint(lo, hi)}\n" for _ in range(TESTS)]


def lists(rng: random.Random) -> list[str]:
    return [" ".join(str(rng.randint(-20, 50)) for _ in range(rng.randint(1, 8))) + "\n"
            for _ in range(TESTS)]  # fmt: skip


def words(rng: random.Random) -> list[str]:
    vocab = ["apple", "level", "banana", "radar", "kayak", "python", "noon", "code", "Otto", "sky"]
    return [rng.choice(vocab) + "\n" for _ in range(TESTS)]


def sentences(rng: random.Random) -> list[str]:
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again"]
    return [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 7))) + "\n" for _ in range(TESTS)
    ]


def nums(text: str) -> list[int]:
    return [int(x) for x in text.split()]


def arithmetic(rng: random.Random) -> list[Problem]:
    out = []
    for k in range(2, 21):
        out.append(
            io_problem(
                f"the integer times {k}",
                "one integer",
                lambda t, k=k: str(int(t) * k),
                ints(rng, -100, 100),
            )
        )
        out.append(
            io_problem(
                f"the integer plus {k * 7}",
                "one integer",
                lambda t, k=k: str(int(t) + k * 7),
                ints(rng, -100, 100),
            )
        )
    for k in range(1, 16):
        out.append(
            io_problem(
                f"the integer minus {k}",
                "one integer",
                lambda t, k=k: str(int(t) - k),
                ints(rng, -100, 100),
            )
        )
    for k in range(2, 13):
        out.append(
            io_problem(
                f"the remainder of the integer divided by {k}",
                "one non-negative integer",
                lambda t, k=k: str(int(t) % k),
                ints(rng, 0, 1000),
            )
        )
    ops = {
        "their sum": lambda a, b: a + b, "their difference (first minus second)": lambda a, b: a - b,
        "their product": lambda a, b: a * b, "the larger of the two": max, "the smaller of the two": min,
        "the absolute value of their difference": lambda a, b: abs(a - b),
        "their greatest common divisor": math.gcd, "the sum of their squares": lambda a, b: a * a + b * b,
    }  # fmt: skip
    for task, op in ops.items():
        out.append(
            io_problem(
                task,
                "two integers on one line, separated by a space",
                lambda t, op=op: str(op(*nums(t))),
                pairs(rng, 1, 99),
            )
        )
    return out


def list_problems(rng: random.Random) -> list[Problem]:
    reads = "a line of integers separated by spaces"
    tasks = {
        "their sum": lambda xs: sum(xs), "the largest of them": max, "the smallest of them": min,
        "how many of them are even": lambda xs: sum(x % 2 == 0 for x in xs),
        "how many of them are negative": lambda xs: sum(x < 0 for x in xs),
        "them sorted in increasing order, separated by spaces": lambda xs: " ".join(map(str, sorted(xs))),
        "them in reverse order, separated by spaces": lambda xs: " ".join(map(str, xs[::-1])),
        "the sum of the positive ones": lambda xs: sum(x for x in xs if x > 0),
        "the difference between the largest and the smallest": lambda xs: max(xs) - min(xs),
        "how many distinct values there are": lambda xs: len(set(xs)),
        "each number doubled, separated by spaces": lambda xs: " ".join(str(2 * x) for x in xs),
        "the first number": lambda xs: xs[0], "the last number": lambda xs: xs[-1],
        "the number of values": len, "the sum of the squares": lambda xs: sum(x * x for x in xs),
    }  # fmt: skip
    return [
        io_problem(task, reads, lambda t, f=f: str(f(nums(t))), lists(rng))
        for task, f in tasks.items()
    ]


def string_problems(rng: random.Random) -> list[Problem]:
    word_tasks = {
        "the word reversed": lambda w: w[::-1], "the word in upper case": str.upper,
        "the number of vowels (a, e, i, o, u, either case) in the word": lambda w: str(sum(c in "aeiouAEIOU" for c in w)),
        "YES if the word reads the same backwards (case-insensitive), else NO": lambda w: "YES" if w.lower() == w[::-1].lower() else "NO",
        "the length of the word": lambda w: str(len(w)), "the first letter of the word": lambda w: w[0],
        "the word with its first letter in upper case and the rest in lower case": str.capitalize,
        "the word twice, with no space between": lambda w: w * 2,
    }  # fmt: skip
    out = [
        io_problem(t, "one word", lambda s, f=f: f(s.strip()), words(rng))
        for t, f in word_tasks.items()
    ]
    line_tasks = {
        "the number of words in the line": lambda s: str(len(s.split())),
        "the words of the line in reverse order, separated by single spaces": lambda s: " ".join(s.split()[::-1]),
        "the longest word of the line (the first one if several are as long)": lambda s: max(s.split(), key=len),
        "the line with every word capitalised": lambda s: " ".join(w.capitalize() for w in s.split()),
        "the number of letters in the line, spaces not counted": lambda s: str(len(s.replace(" ", ""))),
    }  # fmt: skip
    out += [
        io_problem(t, "a line of words", lambda s, f=f: f(s.strip()), sentences(rng))
        for t, f in line_tasks.items()
    ]
    for ch in "aeiotnrs":
        out.append(
            io_problem(
                f"how many times the letter '{ch}' occurs in the line",
                "a line of words",
                lambda s, ch=ch: str(s.count(ch)),
                sentences(rng),
            )
        )
    return out


def loop_problems(rng: random.Random) -> list[Problem]:
    out = []
    for fizz, buzz in [
        (3, 5),
        (2, 7),
        (3, 4),
        (4, 6),
        (5, 7),
        (2, 3),
        (3, 7),
        (4, 5),
        (5, 6),
        (6, 9),
    ]:

        def fb(t: str, fizz: int = fizz, buzz: int = buzz) -> str:
            rows = []
            for i in range(1, int(t) + 1):
                word = ("Fizz" if i % fizz == 0 else "") + ("Buzz" if i % buzz == 0 else "")
                rows.append(word or str(i))
            return "\n".join(rows)

        task = f"the numbers 1 to n, one per line, but Fizz for multiples of {fizz}, Buzz for multiples of {buzz} and FizzBuzz for multiples of both"
        out.append(io_problem(task, "one integer n", fb, ints(rng, 1, 30)))
    for step in range(1, 9):
        out.append(
            io_problem(
                f"the numbers from 0 up to n (inclusive) in steps of {step}, one per line",
                "one integer n",
                lambda t, s=step: "\n".join(map(str, range(0, int(t) + 1, s))),
                ints(rng, 0, 25),
            )
        )
    out.append(
        io_problem(
            "the squares of 1 to n, one per line",
            "one integer n",
            lambda t: "\n".join(str(i * i) for i in range(1, int(t) + 1)),
            ints(rng, 1, 15),
        )
    )
    out.append(
        io_problem(
            "a right triangle of n rows of '*' (row i has i stars)",
            "one integer n",
            lambda t: "\n".join("*" * i for i in range(1, int(t) + 1)),
            ints(rng, 1, 8),
        )
    )
    out.append(
        io_problem(
            "the sum 1 + 2 + ... + n",
            "one integer n",
            lambda t: str(int(t) * (int(t) + 1) // 2),
            ints(rng, 0, 1000),
        )
    )
    out.append(
        io_problem(
            "the number of digits of n",
            "one non-negative integer n",
            lambda t: str(len(t.strip())),
            ints(rng, 0, 10**9),
        )
    )
    out.append(
        io_problem(
            "n! (n factorial)",
            "one integer n",
            lambda t: str(math.factorial(int(t))),
            ints(rng, 0, 15),
        )
    )
    out.append(
        io_problem(
            "the sum of the digits of n",
            "one non-negative integer n",
            lambda t: str(sum(map(int, t.strip()))),
            ints(rng, 0, 10**6),
        )
    )
    return out


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def function_problems(rng: random.Random) -> list[Problem]:
    def r(lo: int, hi: int) -> list[tuple]:
        return [(rng.randint(lo, hi),) for _ in range(TESTS)]

    def pair(lo: int, hi: int) -> list[tuple]:
        return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(TESTS)]

    def lst() -> list[tuple]:
        return [([rng.randint(-9, 30) for _ in range(rng.randint(1, 7))],) for _ in range(TESTS)]

    def text() -> list[tuple]:
        return [(s.strip(),) for s in sentences(rng)]

    out = [
        fn_problem("is_prime(n)", "True if n is a prime number, else False", _is_prime, r(0, 100)),
        fn_problem("fib(n)", "the n-th Fibonacci number (fib(0) = 0, fib(1) = 1)", _fib, r(0, 30)),
        fn_problem("factorial(n)", "n! for n >= 0", math.factorial, r(0, 12)),
        fn_problem("gcd(a, b)", "the greatest common divisor of two positive integers", math.gcd, pair(1, 200)),
        fn_problem("lcm(a, b)", "the least common multiple of two positive integers", lambda a, b: a * b // math.gcd(a, b), pair(1, 50)),
        fn_problem("digit_sum(n)", "the sum of the decimal digits of a non-negative integer", lambda n: sum(map(int, str(n))), r(0, 10**6)),
        fn_problem("count_divisors(n)", "how many positive integers divide n", lambda n: sum(n % d == 0 for d in range(1, n + 1)), r(1, 200)),
        fn_problem("is_even(n)", "True if n is even, else False", lambda n: n % 2 == 0, r(-50, 50)),
        fn_problem("collatz_steps(n)", "how many steps of the Collatz map (n/2 if even, 3n+1 if odd) take n to 1", _collatz, r(1, 60)),
        fn_problem("reverse_number(n)", "the digits of a non-negative integer reversed, as an integer", lambda n: int(str(n)[::-1]), r(0, 99999)),
        fn_problem("to_binary(n)", "the binary digits of a non-negative integer as a string, without prefix", lambda n: bin(n)[2:], r(0, 500)),
        fn_problem("power(a, b)", "a to the power b, for small non-negative integers", lambda a, b: a**b, pair(0, 9)),
        fn_problem("second_largest(xs)", "the second largest distinct value of a list with at least two distinct values", lambda xs: sorted(set(xs))[-2], [([1, 5, 3],), ([9, 9, 2, 4],), ([-1, -7],), ([10, 20, 30, 40],), ([3, 3, 8, 1],)]),
        fn_problem("count_words(s)", "the number of space-separated words in the string", lambda s: len(s.split()), text()),
        fn_problem("capitalize_words(s)", "the string with each word's first letter in upper case", lambda s: " ".join(w.capitalize() for w in s.split()), text()),
        fn_problem("remove_vowels(s)", "the string with the letters a, e, i, o, u removed", lambda s: "".join(c for c in s if c not in "aeiou"), text()),
        fn_problem("mean(xs)", "the arithmetic mean of a non-empty list of numbers as a float", lambda xs: sum(xs) / len(xs), lst()),
        fn_problem("unique_sorted(xs)", "the distinct values of a list in increasing order, as a list", lambda xs: sorted(set(xs)), lst()),
        fn_problem("running_sum(xs)", "the list of running totals of a list (element i is the sum of xs[0..i])", _running, lst()),
        fn_problem("count_positive(xs)", "how many elements of a list are greater than zero", lambda xs: sum(x > 0 for x in xs), lst()),
        fn_problem("max_gap(xs)", "the largest difference between two neighbouring elements of a list with at least two elements (later minus earlier), or 0 for a shorter list", _max_gap, lst()),
        fn_problem("celsius_to_fahrenheit(c)", "c * 9 / 5 + 32", lambda c: c * 9 / 5 + 32, r(-40, 100)),
    ]  # fmt: skip
    for k in range(2, 8):
        out.append(
            fn_problem(f"power_{k}(n)", f"n to the power {k}", lambda n, k=k: n**k, r(-9, 9))
        )
    for base in range(2, 10):
        out.append(
            fn_problem(
                f"digits_base_{base}(n)",
                f"the number of digits of a positive integer written in base {base}",
                lambda n, b=base: _digits(n, b),
                r(1, 5000),
            )
        )
    for k in range(2, 16):
        out.append(
            fn_problem(
                f"multiples_of_{k}(n)",
                f"the list of the positive multiples of {k} up to and including n",
                lambda n, k=k: list(range(k, n + 1, k)),
                r(0, 40),
            )
        )
        out.append(
            fn_problem(
                f"count_multiples_of_{k}(xs)",
                f"how many elements of a list of integers are divisible by {k}",
                lambda xs, k=k: sum(x % k == 0 for x in xs),
                lst(),
            )
        )
    return out


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _digits(n: int, base: int) -> int:
    count = 0
    while n:
        n, count = n // base, count + 1
    return count


def _running(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _max_gap(xs: list[int]) -> int:
    return max((b - a for a, b in zip(xs, xs[1:], strict=False)), default=0)


def problems(seed: int) -> list[Problem]:
    rng = random.Random(seed)
    families = (arithmetic, list_problems, string_problems, loop_problems, function_problems)
    rows = [p for family in families for p in family(rng)]
    # A run takes its training problems in the file's order: shuffled, its first steps see
    # every family (in family order a short run saw nothing but arithmetic).
    rng.shuffle(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "assets/code/problems.jsonl",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = problems(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps({"id": f"code-{i:03d}", **row}) + "\n")
    print(f"{len(rows)} problems -> {args.out}")


if __name__ == "__main__":
    main()
