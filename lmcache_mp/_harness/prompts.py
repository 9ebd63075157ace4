"""The eval's prompts, shipped with the project (no data set download):
prose documents to continue, and passkey haystacks."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DOCUMENTS",
    "FILLER",
    "Passkey",
    "document_prompts",
    "document_tokens",
    "passkey_prompt",
    "passkey_prompts",
]

#: Short plain-prose documents; a prompt joins four in a row, so that it
#: is a few hundred tokens of varied, ordinary text to continue.
DOCUMENTS = (
    "The lighthouse keeper, Marta, kept a logbook for forty years. Every evening "
    "she wrote down the weather, the ships that passed and the birds that rested "
    "on the rail. In the winter of the great storm she counted eleven ships "
    "seeking shelter in the bay, and she kept the lamp burning for three nights "
    "without sleep. When the harbour master came to thank her, she showed him the "
    "logbook and said that the lamp had done the work, not her.",
    "Bread is made from flour, water, salt and yeast. The yeast eats the sugars in "
    "the flour and releases gas, which makes the dough rise. A baker kneads the "
    "dough to build gluten, lets it rest, shapes it and bakes it in a hot oven, "
    "where the crust browns. Slow fermentation gives the bread more flavour, so "
    "many bakers leave the dough in a cool room overnight before they bake it in "
    "the morning.",
    "The small village of Arden sits between two rivers. Its market opens on "
    "Tuesdays and Saturdays, and farmers bring cheese, apples and honey from the "
    "hills. The old stone bridge was built in 1742 and repaired after the flood "
    "of 1901. Children cross it every morning on their way to the school, which "
    "has one classroom, a garden and a bell that the oldest pupil rings at nine.",
    "A computer stores numbers in binary, as long rows of ones and zeros. Eight "
    "bits make a byte, and a byte can hold any whole number from zero to two "
    "hundred and fifty five. Text is stored by giving every letter a number, so "
    "the word cat becomes three bytes. Pictures are grids of small dots, and each "
    "dot holds numbers for its red, green and blue light.",
    "Honey bees live in colonies of many thousands. The queen lays the eggs, the "
    "workers gather nectar and pollen, and the drones mate with queens of other "
    "colonies. A worker that finds flowers returns to the hive and dances: the "
    "angle of the dance shows the direction of the flowers from the sun, and its "
    "length shows how far away they are.",
    "The train left the city at dawn and climbed slowly into the mountains. "
    "Through the window the passengers watched the fields give way to pine "
    "forests and then to bare rock and snow. At the highest station a man sold "
    "hot tea from a cart, and a dog slept beside the stove in the waiting room. "
    "By noon the train was rolling down the other side towards the sea.",
    "Good soup starts with a good stock. Cover bones or vegetables with cold "
    "water, bring it slowly to a simmer and skim the foam from the top. Add an "
    "onion, a carrot, some celery and a few peppercorns, and let it cook gently "
    "for hours. Strain it, taste it and add salt only at the end, because the "
    "stock becomes stronger as it reduces.",
    "The library of the old university holds more than a million books. Some "
    "were written by hand before printing was invented, and they are kept in a "
    "cold, dark room where the air is always dry. Readers must wash their hands, "
    "use a pencil instead of a pen and turn the pages slowly. The librarians know "
    "where every book is, even the ones that have not been read for a century.",
)

#: The haystack's filler: the passkey test's standard text (Mohtashami and
#: Jaggi, 2023, "Landmark Attention"), repeated.
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There "
    "and back again. "
)
_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it "
    "and memorize it. I will quiz you about the important information there.\n\n"
)
_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Passkey:
    """A passkey-retrieval prompt.

    Args:
        text: The prompt: the instruction, the haystack with the needle,
            the question.
        key: The 5-digit number hidden in it.
        depth: Where the needle is, as a fraction of the haystack's filler
            lines before it (0: first, 1: last).
    """

    text: str
    key: int
    depth: float

    def found_in(self, answer: str) -> bool:
        """Whether ``answer`` states the key (as a whole number).

        Args:
            answer: The model's decoded answer.

        Returns:
            True if the key appears in it, not as part of a longer number.
        """
        return str(self.key) in re.findall(r"\d+", answer)


def document_prompts(count: int) -> list[str]:
    """``count`` texts to continue, each four documents in a row.

    Args:
        count: How many (at least 1; the documents repeat, shifted, after
            :data:`DOCUMENTS` prompts).

    Returns:
        The texts.
    """
    n = len(DOCUMENTS)
    return [
        "\n\n".join(DOCUMENTS[(i + j) % n] for j in range(4))
        + ("" if i < n else f"\n\n({i // n})")
        for i in range(count)
    ]


def document_tokens(
    encode: Callable[[str], list[int]], count: int, tokens: int
) -> list[list[int]]:
    """``count`` prompts of exactly ``tokens`` tokens of prose (the bench's
    prompts on a trained model).

    Prompt ``i`` runs through :data:`DOCUMENTS` from document ``i`` on,
    round and round, and is cut at ``tokens``; so prompts differ from their
    first token and share no cached prefix.

    Args:
        encode: Text to token ids.
        count: How many prompts.
        tokens: Tokens of each (at least 1).

    Returns:
        The prompts' token ids.
    """
    n = len(DOCUMENTS)
    prompts = []
    for i in range(count):
        # The whole text encoded at once: a tokenizer may add special tokens
        # (BOS) to each text it encodes.
        text, ids, j = DOCUMENTS[i % n], encode(DOCUMENTS[i % n]), i + 1
        while len(ids) < tokens:
            text += "\n\n" + DOCUMENTS[j % n]
            ids, j = encode(text), j + 1
        prompts.append(ids[:tokens])
    return prompts


def passkey_prompt(key: int, depth: float, lines: int) -> Passkey:
    """One haystack of ``lines`` filler lines, the needle at ``depth``.

    Args:
        key: The number to hide.
        depth: Fraction of the filler lines before the needle, in ``[0, 1]``.
        lines: Filler lines in the haystack.

    Returns:
        The prompt.
    """
    before = round(depth * lines)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    text = _INTRO + FILLER * before + needle + FILLER * (lines - before) + _QUESTION
    return Passkey(text, key, before / lines if lines else 0.0)


def passkey_prompts(count: int, lines: int, seed: int) -> list[Passkey]:
    """``count`` haystacks, their needles spread evenly over the depths.

    Args:
        count: How many.
        lines: Filler lines in each haystack.
        seed: Seed of the 5-digit keys.

    Returns:
        The prompts, needle ``i`` at depth ``(i + 0.5) / count``.
    """
    rng = random.Random(seed)
    return [
        passkey_prompt(rng.randint(10_000, 99_999), (i + 0.5) / count, lines)
        for i in range(count)
    ]
