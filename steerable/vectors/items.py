"""Two-choice evaluation items: a prompt, the answer that shows the behaviour and the one that does
not, turned into token ids and the two answer tokens whose log-probabilities ``evaluate`` reads.

Two forms:

- letters (CAA's A/B protocol): ``{"question": "...\\n(A) ...\\n(B) ...", "matching": "A"}`` (or
  CAA's ``"answer_matching_behavior": "(A)"``). The question becomes a user turn (through the chat
  template when the tokenizer has one) and the answer is opened with ``(``; the answers are the
  letter tokens ``A`` and ``B``.
- completions: ``{"prompt": "The soup was", "matching": " delicious", "other": " bland"}``. The
  prompt is used as raw text; the answers are the first tokens of each completion (they must differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steerable.errors import InvalidRequestError

LETTERS = ("A", "B")


@dataclass(frozen=True)
class ABItem:
    """``prompt`` with the behaviour-matching answer ``matching`` and the other answer ``other``;
    ``letters`` marks CAA's form (``prompt`` is then the question, the answers ``"A"``/``"B"``)."""

    prompt: str
    matching: str
    other: str
    letters: bool = False

    @classmethod
    def parse(cls, value: Any, where: str = "items") -> "ABItem":
        if isinstance(value, ABItem):
            return value
        if isinstance(value, Mapping) and isinstance(value.get("question"), str) and value["question"]:
            letter = value.get("matching", value.get("answer_matching_behavior"))
            letter = letter.strip().strip("()").strip() if isinstance(letter, str) else letter
            if letter not in LETTERS:
                raise InvalidRequestError(f"{where}.matching: expected 'A' or 'B', got {letter!r}")
            return cls(value["question"], letter, LETTERS[1 - LETTERS.index(letter)], letters=True)
        if isinstance(value, Mapping) and all(isinstance(value.get(k), str) and value[k]
                                              for k in ("prompt", "matching", "other")):
            return cls(value["prompt"], value["matching"], value["other"])
        raise InvalidRequestError(f"{where}: expected {{'question': str, 'matching': 'A' | 'B'}} or "
                                  f"{{'prompt': str, 'matching': str, 'other': str}}, got {value!r}")

    def tokens(self, tok: Any, chat: bool, where: str = "items") -> tuple[list[int], int, int]:
        """(prompt token ids, matching answer token, other answer token) under ``tok``."""
        if self.letters:
            if chat:
                ids = list(tok.apply_chat_template([{"role": "user", "content": self.prompt}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False))
                ids += tok("(", add_special_tokens=False).input_ids
            else:
                ids = tok(f"{self.prompt}\nAnswer: (", add_special_tokens=True).input_ids
            answers = [tok(letter, add_special_tokens=False).input_ids for letter in (self.matching, self.other)]
            if any(len(a) != 1 for a in answers):
                raise InvalidRequestError(f"{where}: the letters A and B are not single tokens in this tokenizer")
        else:
            ids = tok(self.prompt, add_special_tokens=True).input_ids
            answers = [tok(text, add_special_tokens=False).input_ids for text in (self.matching, self.other)]
            if not all(answers) or answers[0][0] == answers[1][0]:
                raise InvalidRequestError(f"{where}: the answers {self.matching!r} and {self.other!r} must start "
                                          "with different tokens")
        return ids, answers[0][0], answers[1][0]
