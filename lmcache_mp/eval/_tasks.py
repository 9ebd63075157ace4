"""RULER-style tasks, generated from a seed: nothing to download.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), the benchmark kvpress ranks its presses
on, is synthetic, so its task families can be made offline at any length:

- ``niah_single``: one needle (a key and its 7-digit number) in a haystack
  of filler; the answer is the number (RULER's ``niah_single_1``).
- ``niah_single_2``: the same needle in a haystack of prose (the eval's
  documents, sentence by sentence, where RULER takes Paul Graham's essays).
- ``niah_single_3``: a needle whose value is a UUID, in prose.
- ``niah_multikey``: four needles of different keys; the question names
  one of them.
- ``niah_multivalue``: four numbers for one key; the answer is all four.
- ``niah_multiquery``: four needles of different keys; the question names
  all four, and the answer is their four numbers.
- ``vt``: variable tracking: a chain of assignments ``VAR A = 12345``,
  ``VAR B = VAR A``, ... spread over the filler; the answer is every
  variable that holds the number.
- ``cwe``: common words: a numbered list in which ten words appear many
  times and the others a few; the answer is the ten.
- ``fwe``: frequent words: a coded text whose words follow a Zipf law;
  the answer is the three most frequent.

Each prompt ends with the start of its answer, so that a greedy
continuation of a few tokens states it. A prompt is sized to ``length``
tokens of the model's tokenizer: the haystack grows until one more piece
would pass it. :meth:`Task.score` checks a decoded answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_mp._harness.prompts import DOCUMENTS, FILLER

__all__ = ["TASKS", "Task", "make_tasks"]

#: The task families, in the order the eval reports them.
TASKS = (
    "niah_single",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)

#: Needles of the multi-key and multi-value tasks.
_NEEDLES = 4
#: Hops of the variable-tracking chain (variables holding the number).
_HOPS = 5
#: Words the common-words task asks for, how often each appears, and how
#: often each other word does (fewer than RULER's 30 and 3, so that the
#: list fits prompts of a thousand tokens).
_COMMON, _COMMON_TIMES, _RARE_TIMES = 10, 10, 2
#: Words the frequent-words task asks for.
_FREQUENT = 3
#: Syllables of the made-up words (keys, list words, coded words).
#: A task's builder: the (context, question, answers) of ``n`` pieces of
#: haystack.
_Build = Callable[[int], tuple[str, str, tuple[str, ...]]]
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")

#: The prose haystack's pieces: the documents' sentences, in order.
_SENTENCES = tuple(s + " " for d in DOCUMENTS for s in re.split(r"(?<=[.!?]) ", d) if s)

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Task:
    """One generated prompt and what its answer must state.

    Args:
        name: Its family, one of :data:`TASKS`.
        text: The prompt, ending with the start of the answer.
        answers: What the answer must contain: numbers (the needle tasks)
            or words (``vt``, ``cwe``, ``fwe``).
        tokens: Tokens of ``text`` under the tokenizer it was sized with.
        question: The end of ``text`` that asks for the answer (after the
            haystack; ``text`` without it is the context).
    """

    name: str
    text: str
    answers: tuple[str, ...]
    tokens: int
    question: str = ""

    def score(self, answer: str) -> float:
        """The share of :attr:`answers` that ``answer`` states.

        A number counts only as a whole number (``1234567`` is not in
        ``12345678``), a word only as a whole word, case aside (RULER's
        "string match": each expected answer found in the output).

        Args:
            answer: The model's decoded continuation.

        Returns:
            A fraction in ``[0, 1]``: 1 when every answer is stated.
        """
        # Words, and hyphen-joined runs of them (a UUID whole).
        stated = {
            w.lower()
            for pattern in (r"[A-Za-z0-9]+", r"[A-Za-z0-9]+(?:-[A-Za-z0-9]+)+")
            for w in re.findall(pattern, answer)
        }
        found = sum(a.lower() in stated for a in self.answers)
        return found / len(self.answers)


def _word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _haystack(
    pieces: int, needles: list[str], depths: list[float], prose: bool = False
) -> str:
    """``pieces`` filler lines (or sentences of prose, round and round) with
    each needle at its depth (a fraction)."""
    lines = (
        [_SENTENCES[i % len(_SENTENCES)] for i in range(pieces)]
        if prose
        else [FILLER] * pieces
    )
    for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda x: -x[1]):
        lines.insert(round(depth * pieces), needle + " ")
    return "".join(lines)


def _niah(name: str, rng: random.Random) -> _Build:
    """A needle task: the text for ``n`` pieces of haystack, and its answers."""
    keys = [f"{_word(rng, 2)}-{_word(rng, 2)}" for _ in range(_NEEDLES)]
    kind = "uuid" if name == "niah_single_3" else "number"
    values = [(_uuid if kind == "uuid" else _number)(rng) for _ in range(_NEEDLES)]
    depths = [rng.random() for _ in range(_NEEDLES)]
    if name.startswith("niah_single"):
        keys, values, depths = keys[:1], values[:1], depths[:1]
    if name == "niah_multivalue":
        keys = [keys[0]] * _NEEDLES
    # RULER's multi-query template names the keys "A, B, C and D".
    asked = (
        ", ".join(keys[:-1]) + " and " + keys[-1]
        if name == "niah_multiquery"
        else keys[0]
    )
    needles = [
        f"One of the special magic {kind}s for {k} is: {v}."
        for k, v in zip(keys, values, strict=True)
    ]
    plural = name in ("niah_multivalue", "niah_multiquery")
    answers = tuple(values) if plural else (values[0],)
    intro = (
        f"Some special magic {kind}s are hidden within the following text. "
        f"Make sure to memorize them. I will quiz you about the {kind}s "
        "afterwards.\n"
    )
    question = (
        f"\nWhat are all the special magic {kind}s for {asked} mentioned in "
        f"the provided text? The special magic {kind}s for {asked} mentioned "
        "in the provided text are"
        if plural
        else f"\nWhat is the special magic {kind} for {asked} mentioned in the "
        f"provided text? The special magic {kind} for {asked} mentioned in the "
        "provided text is"
    )
    prose = name in ("niah_single_2", "niah_single_3")

    def build(n: int) -> tuple[str, str, tuple[str, ...]]:
        return intro + _haystack(n, needles, depths, prose), question, answers

    return build


def _vt(rng: random.Random) -> _Build:
    names = [_variable(rng) for _ in range(_HOPS)]
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)
    ]
    # The assignments in order, each later than the one it copies.
    depths = sorted(rng.random() for _ in chain)
    intro = (
        "Memorize and track the chain of variable assignments hidden in the "
        "following text.\n\n"
    )
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} "
        "in the text above. Answer: According to the chain of variable "
        f"assignments in the text above, {_HOPS} variables are assigned the "
        f"value {value}, they are:"
    )

    def build(n: int) -> tuple[str, str, tuple[str, ...]]:
        return intro + _haystack(n, chain, depths), question, tuple(names)

    return build


def _cwe(rng: random.Random) -> _Build:
    words = list(dict.fromkeys(_word(rng) for _ in range(4096)))
    common, rare = words[:_COMMON], words[_COMMON:]
    order = rng.random()
    intro = (
        "Below is a numbered list of words. In these words, some appear more "
        "often than others. Memorize the ones that appear most often.\n"
    )
    question = (
        f"\nQuestion: What are the {_COMMON} most common words in the above "
        f"list? Answer: The top {_COMMON} words that appear most often in the "
        "list are:"
    )

    def build(n: int) -> tuple[str, str, tuple[str, ...]]:
        listed = common * _COMMON_TIMES + rare[:n] * _RARE_TIMES
        random.Random(order).shuffle(listed)
        body = " ".join(f"{i}. {w}" for i, w in enumerate(listed, 1))
        return intro + body, question, tuple(common)

    return build


def _fwe(rng: random.Random) -> _Build:
    words = list(dict.fromkeys(_word(rng, 2) for _ in range(2048)))
    order = rng.random()
    intro = (
        "Read the following coded text and track the frequency of each coded "
        "word. Find the three most frequently appeared coded words.\n"
    )
    question = (
        "\nQuestion: Do not provide any explanation. Please ignore the dots "
        "'....'. What are the three most frequently appeared words in the "
        "above coded text? Answer: According to the coded text above, the "
        "three most frequently appeared words are:"
    )

    def build(n: int) -> tuple[str, str, tuple[str, ...]]:
        # Zipf's law with exponent 2, as RULER draws them: the word of rank
        # r appears n // r^2 times (at least once), so the top three stand
        # apart from the rest.
        ranks = min(n, len(words))
        counts = [max(1, n // (r * r)) for r in range(1, ranks + 1)]
        coded = [w for w, c in zip(words, counts, strict=False) for _ in range(c)]
        random.Random(order).shuffle(coded)
        return intro + " ".join(coded) + " ....", question, tuple(words[:_FREQUENT])

    return build


def _builder(name: str, rng: random.Random) -> _Build:
    if name.startswith("niah"):
        return _niah(name, rng)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[name](rng)


def _fit(build: _Build, encode: Encode, length: int) -> Task | None:
    """The largest ``build(n)`` of at most ``length`` tokens (``None`` when
    even the smallest is longer)."""

    def size(n: int) -> int:
        context, question, _ = build(n)
        return len(encode(context + question))

    if size(1) > length:
        return None
    low, high = 1, 2
    while size(high) <= length:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if size(mid) <= length else (low, mid)
    context, question, answers = build(low)
    return Task("", context + question, answers, size(low), question)


def make_tasks(
    name: str, encode: Encode, length: int, samples: int, seed: int = 0
) -> list[Task]:
    """``samples`` prompts of task ``name``, each of at most ``length`` tokens.

    The same arguments give the same prompts (each sample draws its keys,
    numbers, words and depths from ``seed`` and its index).

    Args:
        name: One of :data:`TASKS`.
        encode: The tokenizer the length counts in (text to token ids, as
            the model will see the prompt).
        length: Most tokens of a prompt.
        samples: How many prompts.
        seed: Seed of the draws.

    Returns:
        The prompts.

    Raises:
        ValueError: If ``name`` is not a task, ``length`` or ``samples`` is
            below 1, or ``length`` is too short for the task's question.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    for field, value in (("length", length), ("samples", samples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    tasks = []
    for index in range(samples):
        rng = random.Random(f"{seed}-{name}-{index}")
        fitted = _fit(_builder(name, rng), encode, length)
        if fitted is None:
            raise ValueError(
                f"task {name}: {length} tokens do not fit its instructions and "
                "question; give a longer length"
            )
        tasks.append(dataclasses.replace(fitted, name=name))
    return tasks
