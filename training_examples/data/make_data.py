"""Write the small synthetic JSONL data sets the training examples use (deterministic).

    python -m training_examples.data.make_data            # rewrites sft.jsonl and dpo.jsonl here

* ``sft.jsonl``: 200 ``{"instruction": ..., "response": ...}`` pairs: arithmetic, counting,
  word reversal, spelling out numbers, comparisons.
* ``dpo.jsonl``: 100 ``{"prompt": ..., "chosen": ..., "rejected": ...}`` triples: arithmetic
  questions with the correct answer (chosen) and a worse one (rejected): a wrong result stated
  confidently, a hedged wrong guess, or an unhelpful reply.

All content is generated here from templates (no external data); the answers are correct by
construction, so a model can learn them and the losses of the examples fall.
"""
from __future__ import annotations

import json
import os
import random

WORDS = ["apple", "river", "stone", "garden", "planet", "window", "forest", "silver", "candle", "market",
         "rocket", "pencil", "bridge", "winter", "yellow", "castle", "dragon", "mirror", "orange", "violin"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def spell(n: int) -> str:
    if n < 20:
        return ONES[n]
    t, o = divmod(n, 10)
    return TENS[t] + ("" if o == 0 else "-" + ONES[o])


def arithmetic(rng: random.Random):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.", value, (a, op, b)


def sft_pair(rng: random.Random) -> dict:
    kind = rng.choice(["arith", "arith", "reverse", "spell", "count", "compare"])
    if kind == "arith":
        q, a, _, _ = arithmetic(rng)
    elif kind == "reverse":
        w = rng.choice(WORDS)
        q, a = f"Reverse the word '{w}'.", f"The word '{w}' reversed is '{w[::-1]}'."
    elif kind == "spell":
        n = rng.randint(0, 99)
        q, a = f"Write the number {n} in words.", f"{n} is written '{spell(n)}'."
    elif kind == "count":
        w = rng.choice(WORDS)
        q, a = f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."
    else:
        x, y = rng.sample(range(1, 1000), 2)
        q, a = f"Which is larger, {x} or {y}?", f"{max(x, y)} is larger than {min(x, y)}."
    return {"instruction": q, "response": a}


def dpo_triple(rng: random.Random) -> dict:
    q, good, value, (a, op, b) = arithmetic(rng)
    wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
    style = rng.random()
    if style < 0.3:  # wrong answer, confident
        bad = f"{a} {op} {b} = {wrong}."
    elif style < 0.7:  # wrong answer, hedged
        bad = f"Hmm, maybe {wrong}? I am not sure."
    else:  # unhelpful
        bad = rng.choice(["I cannot do arithmetic.", "Please use a calculator.", "That is a hard question."])
    return {"prompt": q, "chosen": good, "rejected": bad}


def main(out_dir: str = os.path.dirname(os.path.abspath(__file__))) -> None:
    rng = random.Random(1234)
    with open(os.path.join(out_dir, "sft.jsonl"), "w") as f:
        for _ in range(200):
            f.write(json.dumps(sft_pair(rng)) + "\n")
    with open(os.path.join(out_dir, "dpo.jsonl"), "w") as f:
        for _ in range(100):
            f.write(json.dumps(dpo_triple(rng)) + "\n")


if __name__ == "__main__":
    main()
