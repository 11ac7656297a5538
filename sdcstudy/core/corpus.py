"""The built-in synthetic corpus (`data.source: synthetic`): documents of sentences in a
pseudo-language with learnable structure, generated here so that training needs no downloads.
The same language gives `qa`'s offline synthetic task its sentences.

This module imports no JAX.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

SYNTHETIC_VERSION = 1  # bump when synthetic_corpus() changes its output
SYNTHETIC_SEED = 0  # the built-in corpus is one fixed text; the experiment seed only shuffles it

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "st", "tr", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "", "n", "r", "s", "l")
_WORDS = 320  # vocabulary of pseudo-words
_STARTERS = 24  # words that may open a sentence; the first _QUESTION_WORDS of them ask
_QUESTION_WORDS = 4
_NAMES = 16  # words that are always capitalized


class _Draws:
    """Uniforms from a numpy Generator in fixed blocks; choices by integer weights only, so the
    text is identical on every platform (no libm calls decide anything)."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.block, self.next = rng, [], 0
        self.nats = 0.0  # -log p of the choices made while counting is on (for measurement)
        self.counting = False

    def uniform(self) -> float:
        if self.next == len(self.block):
            self.block, self.next = self.rng.random(4096).tolist(), 0
        self.next += 1
        return self.block[self.next - 1]

    def choice(self, cumulative: list[int]) -> int:
        """Index i with probability (cumulative[i] - cumulative[i-1]) / cumulative[-1]."""
        i = bisect.bisect_right(cumulative, int(self.uniform() * cumulative[-1]))
        if self.counting:
            weight = cumulative[i] - (cumulative[i - 1] if i else 0)
            self.nats -= math.log(weight / cumulative[-1])
        return i

    def below(self, n: int) -> int:
        """Uniform on 0..n-1."""
        if self.counting:
            self.nats += math.log(n)
        return int(self.uniform() * n)

    def chance(self, numerator: int, denominator: int) -> bool:
        return self.choice([numerator, denominator]) == 0


def _cumulative(weights) -> list[int]:
    out, total = [], 0
    for w in weights:
        total += int(w)
        out.append(total)
    return out


def _language(draws: _Draws):
    """Vocabulary, per-word successor tables (sparse first-order Markov chain), sentence starts."""
    words, seen = [], set()
    syllable_counts = _cumulative([3, 5, 2])
    while len(words) < _WORDS:
        n = draws.choice(syllable_counts) + 1
        word = "".join(_ONSETS[draws.below(len(_ONSETS))] + _VOWELS[draws.below(len(_VOWELS))]
                       for _ in range(n)) + _CODAS[draws.below(len(_CODAS))]
        if word not in seen:
            seen.add(word)
            words.append(word)
    words = [w.capitalize() if i % (_WORDS // _NAMES) == 7 else w for i, w in enumerate(words)]
    zipf = _cumulative((1 << 20) // (rank + 2) for rank in range(_WORDS))
    successors = []
    for _ in range(_WORDS):
        k = 2 + draws.below(6)
        chosen = []
        while len(chosen) < k:
            w = draws.choice(zipf)
            if w not in chosen:
                chosen.append(w)
        successors.append((chosen, _cumulative(k - j for j in range(k))))
    starters = []
    while len(starters) < _STARTERS:
        w = draws.choice(zipf)
        if w not in starters:
            starters.append(w)
    return words, successors, starters


def _sentence(draws: _Draws, words, successors, starters) -> str:
    s = draws.below(len(starters))
    current = starters[s]
    out = [words[current]]
    while len(out) < 16 and (len(out) < 3 or not draws.chance(1, 6)):
        if draws.chance(1, 10):
            out[-1] += ","
        chosen, cumulative = successors[current]
        current = chosen[draws.choice(cumulative)]
        out.append(words[current])
    out[0] = out[0][0].upper() + out[0][1:]
    if s < _QUESTION_WORDS:
        return " ".join(out) + "?"
    return " ".join(out) + ("!" if draws.chance(1, 10) else ".")


def _synthetic(n_bytes: int, seed: int) -> tuple[list[str], float]:
    draws = _Draws(np.random.default_rng(seed))
    language = _language(draws)
    draws.counting = True
    documents, total = [], 0
    while total < n_bytes:
        doc = " ".join(_sentence(draws, *language) for _ in range(1 + draws.below(6)))
        documents.append(doc)
        total += len(doc) + 1  # ASCII only; +1 for the separator
    return documents, draws.nats


def synthetic_corpus(n_bytes: int, seed: int) -> list[str]:
    """Documents of sentences over a fixed vocabulary of pseudo-words made of syllables, chained
    by a sparse first-order Markov chain, with commas, capitalized sentence starts and names,
    and questions that end in "?" when they open with a question word. ASCII only; the
    documents total at least `n_bytes` bytes counting one separator byte each, and a smaller
    `n_bytes` gives a prefix of the same documents. Deterministic given `seed`."""
    return _synthetic(n_bytes, seed)[0]


def synthetic_entropy(n_bytes: int, seed: int) -> float:
    """The generator's own entropy in nats per byte (separators included) over that sample:
    the loss a model that knew the generating process exactly would reach."""
    documents, nats = _synthetic(n_bytes, seed)
    return nats / sum(len(d) + 1 for d in documents)
