"""Built-in templated arithmetic word problems with worked answers, deterministic per seed:
the text tiny models' tokenizers are trained on (tiny.py), and the default data source
(data=synthetic, registered in data/sources.py), so the main job needs no download."""

from __future__ import annotations

import random

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Eva", "Ken", "Zoe"]
ITEMS = ["apples", "books", "coins", "stickers", "pencils", "marbles", "cards", "shells"]


def _add(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 60), r.randint(2, 40)
    q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    ans = (f"{name} starts with {a} {item} and gets {b} more, so {name} has {a} + {b} = {a + b} {item}. "
           f"The answer is {a + b}.")
    return q, ans


def _sub(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(20, 90)
    b = r.randint(1, a - 1)
    q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
    ans = f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b} {item} are left. The answer is {a - b}."
    return q, ans


def _mul(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    boxes, per = r.randint(2, 12), r.randint(2, 12)
    q = f"{name} has {boxes} boxes with {per} {item} in each box. How many {item} are there in total?"
    ans = (f"There are {boxes} boxes with {per} {item} each, so {boxes} * {per} = {boxes * per} {item}. "
           f"The answer is {boxes * per}.")
    return q, ans


def _two_step(r: random.Random):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(5, 50), r.randint(2, 30), r.randint(1, 5)
    total = a + b
    q = (f"{name} has {a} {item} and buys {b} more. Then {name} shares them equally with "
         f"{c} friends, keeping none. How many {item} does each friend get, and how many are left over?")
    ans = (f"First, {a} + {b} = {total} {item}. Then {total} / {c} = {total // c} with "
           f"{total % c} left over. Each friend gets {total // c} {item}. The answer is {total // c}.")
    return q, ans


TEMPLATES = [_add, _sub, _mul, _two_step]


def synthetic_conversations(n: int, seed: int = 0):
    r = random.Random(seed)
    for _ in range(n):
        q, a = r.choice(TEMPLATES)(r)
        yield [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
