"""Plain-text prompts for a base model (e.g. gemma3-270m): `python data/prompts/build_base_prompts.py`.

Derived from the fixed splits, so their held-out status carries over:
  base_heldout_general.jsonl  the first 24 of heldout_general, as "Q: <instruction>\\nA:" openings
                              (training.corpus.text.base_opening: the format the Gemma
                              head's corpus uses)
  base_heldout_code.jsonl     the first 24 of heldout_code (HumanEval/124..): the bare HumanEval
                              prompt, a plain-text Python opening (signature + docstring)
  base_val.jsonl              val (model selection, decider traces) as openings
Ids are kept, so a base prompt is traceable to its instruction. Reproducible byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from training.corpus.text import base_opening  # noqa: E402

N_HELDOUT = 24


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def _code_opening(prompt: str) -> str:
    """The HumanEval prompt inside the chat instruction's ```python fence."""
    start = prompt.index("```python\n") + len("```python\n")
    return prompt[start: prompt.rindex("```")].lstrip("\n")


def _write(name: str, rows: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (HERE / f"{name}.jsonl").write_text(text, encoding="utf-8")


def main() -> None:
    as_base = lambda r, text: {**r, "source": f"{r['source']}:base", "prompt": text}  # noqa: E731
    _write("base_heldout_general",
           [as_base(r, base_opening(r["prompt"])) for r in _rows("heldout_general")[:N_HELDOUT]])
    _write("base_heldout_code",
           [as_base(r, _code_opening(r["prompt"])) for r in _rows("heldout_code")[:N_HELDOUT]])
    _write("base_val", [as_base(r, base_opening(r["prompt"])) for r in _rows("val")])


if __name__ == "__main__":
    main()
