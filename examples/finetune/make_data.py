"""Write the example's small local datasets (deterministic; the outputs are committed):

    data/text.jsonl   short documents about arithmetic, for pretraining the tiny base model
    data/chat.jsonl   conversations (`messages`: system/user/assistant turns), for chat SFT

Run it again only to change them: `python examples/finetune/make_data.py`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def _fact(rng: random.Random) -> tuple[str, str, str]:
    op = rng.choice(sorted(OPS))
    a, b = rng.randrange(10), rng.randrange(10)
    if op == "minus" and b > a:
        a, b = b, a
    r = OPS[op](a, b)
    return f"{WORDS[a]} {op} {WORDS[b]}", str(r), f"{WORDS[a]} {op} {WORDS[b]} is {WORDS[r] if r < len(WORDS) else r}"


def text_documents(n: int, rng: random.Random) -> list[dict[str, str]]:
    docs = []
    for _ in range(n):
        facts = [_fact(rng)[2] for _ in range(rng.randint(2, 12))]
        docs.append({"text": ". ".join(f.capitalize() for f in facts) + "."})
    return docs


def conversations(n: int, rng: random.Random) -> list[dict[str, list[dict[str, str]]]]:
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You answer arithmetic questions in words."}]
        for _ in range(rng.randint(1, 3)):
            question, _, answer = _fact(rng)
            messages.append({"role": "user", "content": f"What is {question}?"})
            messages.append({"role": "assistant", "content": answer.capitalize() + "."})
        out.append({"messages": messages})
    return out


def main() -> None:
    rng = random.Random(14)
    (HERE / "data").mkdir(exist_ok=True)
    for name, rows in (("text.jsonl", text_documents(600, rng)), ("chat.jsonl", conversations(600, rng))):
        with open(HERE / "data" / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
