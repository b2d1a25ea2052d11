"""The embedded demo corpus' content: arithmetic word problems with short mechanical reasoning, a few plain
sentences, and the problems held out of training for the end of a run's accuracy (evaluation.py), all a pure
function of a seed. data.py builds it into a corpus (`data.build_demo_corpus`, `python data.py --demo`).
"""

from __future__ import annotations

import itertools
import random

DEMO_EVAL_FILE = "eval/arithmetic.jsonl"
DEMO_VOCAB_SIZE = 512
DEMO_SEED = 1234  # the demo corpus' generator (data.py --seed)
DEMO_BUILD_DEFAULTS = {"vocab_size": DEMO_VOCAB_SIZE, "val_fraction": 0.05, "test_fraction": 0.05}


ADDITION_PROMPTS = (
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "What do you get when you add {a} and {b}?",
    "Compute {a} + {b}.",
    "What is the sum of {a} and {b}?",
)
SUBTRACTION_PROMPTS = ("What is {a} minus {b}?", "What is {a} - {b}?", "Subtract {b} from {a}.")
APPLE_PROMPTS = (
    "If a box has {a} rows of {b} {thing}, how many {thing} are there?",
    "A tray holds {a} rows with {b} {thing} in each row. How many {thing}?",
    "There are {a} rows of {thing} and each row has {b} {thing}. How many {thing} in total?",
    "A box has {a} rows of {b} {thing}. How many {thing} are in the box?",
    "How many {thing} are in {a} rows of {b} {thing}?",
    "If there are {a} rows and every row has {b} {thing}, how many {thing} are there?",
)
APPLE_THINGS = ("apples", "pears", "eggs", "cups", "coins", "books", "stones", "shells")
DEMO_ROWS, DEMO_PER_ROW = range(2, 5), range(2, 13)  # at most 4 rows: every document fits 128 tokens
SENTENCE_PARTS = {
    "name": ("Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kai", "Lea"),
    "verb": ("likes", "reads", "paints", "finds", "draws", "counts", "keeps", "sees"),
    "thing": (
        "red apples",
        "old books",
        "small boats",
        "green leaves",
        "blue stones",
        "white clouds",
        "yellow pears",
        "tiny shells",
        "round coins",
        "bright stars",
    ),
    "place": (
        "in the garden",
        "by the river",
        "at school",
        "on the hill",
        "near the shop",
        "at home",
        "under the tree",
        "in the park",
    ),
}
DEMO_EVAL_COUNTS = {"addition": 200, "subtraction": 50, "multiplication": 10}


def addition_reasoning(a: int, b: int) -> str:
    """Column addition, units first: '8 + 7 = 15' / '4 + 3 + 1 = 8' / '48 + 37 = 85'."""
    units = a % 10 + b % 10
    tens = a // 10 + b // 10 + units // 10
    return f"{a % 10} + {b % 10} = {units}\n{a // 10} + {b // 10} + {units // 10} = {tens}\n{a} + {b} = {a + b}"


def subtraction_reasoning(a: int, b: int) -> str:
    """Column subtraction, units first, borrowing: '15 - 7 = 8' / '9 - 1 - 1 = 7' / '95 - 17 = 78'."""
    borrow = int(a % 10 < b % 10)
    units = a % 10 + 10 * borrow
    tens = a // 10 - b // 10 - borrow
    return f"{units} - {b % 10} = {units - b % 10}\n{a // 10} - {b // 10} - {borrow} = {tens}\n{a} - {b} = {a - b}"


def apples_reasoning(rows: int, per_row: int) -> str:
    """Repeated addition, rows counted so the model knows when to stop:
    '1 row: 4' / '2 rows: 4 + 4 = 8' / '3 rows: 8 + 4 = 12' / '3 x 4 = 12'."""
    lines = [f"1 row: {per_row}"]
    lines += [f"{row + 1} rows: {per_row * row} + {per_row} = {per_row * (row + 1)}" for row in range(1, rows)]
    return "\n".join(lines + [f"{rows} x {per_row} = {rows * per_row}"])


def demo_problem(task: str, a: int, b: int, prompt: str, thing: str = "apples") -> dict:
    """{"prompt", "answer", "task", "reasoning"} for one problem."""
    if task == "addition":
        answer, reasoning = a + b, addition_reasoning(a, b)
    elif task == "subtraction":
        answer, reasoning = a - b, subtraction_reasoning(a, b)
    else:
        answer, reasoning = a * b, apples_reasoning(a, b)
    return {"prompt": prompt.format(a=a, b=b, thing=thing), "answer": str(answer), "task": task, "reasoning": reasoning}


def demo_held_out(rng: random.Random) -> dict[str, set]:
    """The operand pairs kept out of training: two-digit additions (both orders), subtractions, products."""
    additions = set()
    while len(additions) < DEMO_EVAL_COUNTS["addition"]:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in additions and pair[::-1] not in additions:
            additions.add(pair)
    subtractions = set()
    while len(subtractions) < DEMO_EVAL_COUNTS["subtraction"]:
        a = rng.randint(10, 99)
        subtractions.add((a, rng.randint(0, a)))
    products = set()
    while len(products) < DEMO_EVAL_COUNTS["multiplication"]:
        products.add((rng.choice(DEMO_ROWS), rng.choice(DEMO_PER_ROW)))
    return {"addition": additions, "subtraction": subtractions, "multiplication": products}


def demo_data(seed: int = DEMO_SEED) -> tuple[list[dict], list[dict]]:
    """(training records, held-out eval problems), a pure function of `seed`.

    Every addition a + b with a, b in 0..99 appears twice (the canonical 'What is a plus b?' and
    one other phrasing) unless the pair is held out in either order; 60% of the subtractions
    a - b (0 <= b <= a <= 99) appear once; every rows-of-things product (2-4 rows of 2-12) in
    16 of its phrasings; about a tenth of the records are plain sentences.
    """
    rng = random.Random(seed)
    held = demo_held_out(rng)
    held_sums = held["addition"] | {pair[::-1] for pair in held["addition"]}
    eval_problems = []
    for task, prompts in (
        ("addition", ADDITION_PROMPTS),
        ("subtraction", SUBTRACTION_PROMPTS),
        ("multiplication", APPLE_PROMPTS),
    ):
        for a, b in sorted(held[task]):
            problem = demo_problem(task, a, b, prompts[0])
            eval_problems.append({key: problem[key] for key in ("prompt", "answer", "task")})

    problems = []
    for a, b in itertools.product(range(100), range(100)):
        if (a, b) not in held_sums:
            problems.append(demo_problem("addition", a, b, ADDITION_PROMPTS[0]))
            problems.append(demo_problem("addition", a, b, rng.choice(ADDITION_PROMPTS[1:])))
    for a in range(100):
        for b in range(a + 1):
            # Skip a - b = c when c + b is a held-out sum: the eval must test generalization.
            if (a, b) not in held["subtraction"] and (a - b, b) not in held_sums and rng.random() < 0.6:
                problems.append(demo_problem("subtraction", a, b, rng.choice(SUBTRACTION_PROMPTS)))
    for a, b in itertools.product(DEMO_ROWS, DEMO_PER_ROW):
        # The running sums b + b, 2b + b, ... must not spell out a held-out addition either.
        if (a, b) not in held["multiplication"] and not any((b * row, b) in held_sums for row in range(1, a)):
            for prompt, thing in rng.sample(list(itertools.product(APPLE_PROMPTS, APPLE_THINGS)), 16):
                problems.append(demo_problem("multiplication", a, b, prompt, thing))
    records = [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["answer"], "reasoning": p["reasoning"]},
            ]
        }
        for p in problems
    ]
    sentences = {
        f"{name} {verb} {count} {thing} {place}."
        for name, verb, thing, place, count in itertools.product(
            *SENTENCE_PARTS.values(), ("two", "three", "many", "some")
        )
    }
    sentences = sorted(sentences)
    rng.shuffle(sentences)
    for start in range(0, len(records) // 10 * 2, 2):
        records.append({"text": f"{sentences[start]} {sentences[start + 1]}"})
    rng.shuffle(records)
    return records, eval_problems
