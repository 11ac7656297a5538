"""Multiple-choice question answering for fine-tuning, as in Ma et al., section 6 and appendix E.

Six tasks (CosmosQA, MathQA, ScienceQA without image questions, OpenbookQA, BoolQ, RACE) are
read through `datasets`, from the Hugging Face Hub or from local files in each dataset's own
schema, and mapped to one record: question, context, choices, index of the correct choice.
A record becomes the prompt of appendix E.2 (Figure 11):

    ### QUESTION
    {question}

    ### CONTEXT
    {context}

    ### CHOICES
    A: {choice 1}
    B: {choice 2}

    ### CORRECT ANSWER
    A: {choice 1}

Training sees the whole text; evaluation cuts it after "### CORRECT ANSWER\\n" (E.2: the model
"continue[s] generating the answer") and reads its greedy next token, the letter it writes first
(our reading: E.2 does not say how an answer becomes a prediction). Training rows are
right-padded and the padding is left out of the loss (E.3). A synthetic task, over the
pre-training corpus's pseudo-language (`corpus.synthetic_corpus`), runs offline.

This module imports no JAX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdcstudy.core import corpus
from sdcstudy.core import tokenizer as TK
from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line

LETTERS = "ABCDEFGH"
ANSWER_HEADER = "### CORRECT ANSWER\n"


@dataclass(frozen=True)
class Record:
    question: str
    context: str
    choices: tuple[str, ...]
    answer: int  # index into choices

    @property
    def letter(self) -> str:
        return LETTERS[self.answer]


def prompt(record: Record) -> str:
    """The evaluation prompt of appendix E.2: everything up to the answer."""
    choices = "".join(f"{LETTERS[i]}: {c}\n" for i, c in enumerate(record.choices))
    return (f"### QUESTION\n{record.question}\n\n### CONTEXT\n{record.context}\n\n"
            f"### CHOICES\n{choices}\n{ANSWER_HEADER}")


def answer_text(record: Record) -> str:
    return f"{record.letter}: {record.choices[record.answer]}"


def training_text(record: Record) -> str:
    """The training prompt of appendix E.2: the evaluation prompt and the correct answer."""
    return prompt(record) + answer_text(record)


# --- the six tasks, each from its own schema ---------------------------------------------------


def _checked(record: Record, where: str) -> Record:
    if not 2 <= len(record.choices) <= len(LETTERS):
        raise UserError(f"{where}: a question needs 2 to {len(LETTERS)} choices, "
                        f"not {len(record.choices)}.")
    if not 0 <= record.answer < len(record.choices):
        raise UserError(f"{where}: the answer index {record.answer} is not one of the "
                        f"{len(record.choices)} choices (unlabelled test split?).")
    return record


def _cosmosqa(row: dict) -> Record:
    return Record(row["question"], row["context"],
                  tuple(row[f"answer{i}"] for i in range(4)), int(row["label"]))


_MATHQA_OPTION = re.compile(r"([a-e])\s*\)\s*(.*?)\s*(?=(?:,\s*[a-e]\s*\))|$)")


def _mathqa(row: dict) -> Record:
    """`options` is one string, "a ) 38 , b ) 27.675 , c ) 30 , ..."; `correct` a letter. The
    rationale gives the answer away, so the context is the problem's category."""
    options = [(m.group(1), m.group(2).strip()) for m in _MATHQA_OPTION.finditer(row["options"])]
    letters = [letter for letter, _ in options]
    return Record(row["Problem"], row.get("category") or "", tuple(t for _, t in options),
                  letters.index(row["correct"].strip()) if row["correct"].strip() in letters
                  else -1)


def _scienceqa(row: dict) -> Record:
    return Record(row["question"], row.get("hint") or "", tuple(row["choices"]),
                  int(row["answer"]))


def _openbookqa(row: dict) -> Record:
    """`main` config; the `additional` config's `fact1` (the open-book fact) is the context."""
    labels = list(row["choices"]["label"])
    return Record(row["question_stem"], row.get("fact1") or "", tuple(row["choices"]["text"]),
                  labels.index(row["answerKey"]) if row["answerKey"] in labels else -1)


def _boolq(row: dict) -> Record:
    return Record(row["question"], row["passage"], ("yes", "no"), 0 if row["answer"] else 1)


def _race(row: dict) -> Record:
    return Record(row["question"], row["article"], tuple(row["options"]),
                  LETTERS.index(row["answer"]) if row["answer"] in LETTERS[:4] else -1)


def _scienceqa_keep(row: dict) -> bool:
    return row.get("image") is None  # appendix E.1: questions with an image context removed


@dataclass(frozen=True)
class Task:
    name: str
    hub: str  # the Hub dataset read when data.source names no local folder
    hub_config: str | None
    test_split: str  # where the labelled test questions are (some test splits are unlabelled)
    to_record: object
    keep: object = None


TASKS = {t.name: t for t in (
    Task("cosmosqa", "allenai/cosmos_qa", None, "validation", _cosmosqa),
    Task("mathqa", "allenai/math_qa", None, "test", _mathqa),
    Task("scienceqa", "derek-thomas/ScienceQA", None, "test", _scienceqa, _scienceqa_keep),
    Task("openbookqa", "allenai/openbookqa", "additional", "test", _openbookqa),
    Task("boolq", "google/boolq", None, "validation", _boolq),
    Task("race", "ehovy/race", "all", "test", _race),
)}
TASK_NAMES = ("synthetic", *TASKS)
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_split(folder: Path, split: str) -> tuple[str, Path] | None:
    for suffix, builder in _LOCAL_FORMATS.items():
        path = folder / f"{split}{suffix}"
        if path.is_file():
            return builder, path
    return None


def load_rows(task: Task, source: str, split: str, hub_config: str | None = None):
    """A `datasets.Dataset` of one split in the task's own schema: from a local folder holding
    `{split}.jsonl`, `.json` or `.parquet`, or from the Hub (`source` "hub" means the task's
    own Hub name)."""
    import datasets

    folder = Path(source).expanduser()
    if source != "hub" and (folder.is_dir() or source.startswith(("/", ".", "~"))):
        found = _local_split(folder, split) if folder.is_dir() else None
        if found is None:
            raise UserError(f"data.source {source!r} holds no {split}.jsonl, {split}.json or "
                            f"{split}.parquet for the {task.name} task; add that file in the "
                            f"dataset's own schema.")
        builder, path = found
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    name = task.hub if source == "hub" else source
    try:
        return datasets.load_dataset(name, hub_config or task.hub_config, split=split)
    except Exception as e:  # offline, unknown name, unknown split: one sentence either way
        reason = first_line(e, 200)
        raise UserError(f"could not load split {split!r} of Hub dataset {name!r} ({reason}); "
                        f"point data.source at a local folder with {split}.jsonl instead.") \
            from None


def load_records(task_name: str, source: str, split: str, hub_config: str | None = None,
                 limit: int | None = None) -> list[Record]:
    """The split's questions as records, in the dataset's order (ScienceQA without images)."""
    if task_name not in TASKS:
        raise UserError(f"finetune.task {task_name!r} is not one of {', '.join(TASK_NAMES)}.")
    task = TASKS[task_name]
    rows = load_rows(task, source, split, hub_config)
    records = []
    for i, row in enumerate(rows):
        if task.keep is not None and not task.keep(row):
            continue
        try:
            record = task.to_record(row)
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"row {i} of the {task.name} {split} split does not have the "
                            f"dataset's schema ({type(e).__name__}: {e}).") from None
        records.append(_checked(record, f"row {i} of the {task.name} {split} split"))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise UserError(f"the {task.name} {split} split has no usable questions.")
    return records


# --- the synthetic task ------------------------------------------------------------------------

SYNTHETIC_QUESTION = "How does the text end?"
SYNTHETIC_CHOICES = (".", "?", "!")
SYNTHETIC_MAX_CONTEXT = 64  # characters: keeps a prompt under about 170 bytes
_SYNTHETIC_SEEDS = {"train": 1, "test": 2}  # the test questions are drawn apart from training


def synthetic_records(n: int, split: str = "train") -> list[Record]:
    """Sentences of the pre-training pseudo-language (`corpus.synthetic_corpus`, same words and
    successor tables) with their final mark removed; the question asks which mark ended it.
    A sentence is a question ("?") exactly when it opens with one of the question words, else
    it ends in "." or, one time in ten, "!"; half the records are questions. So the first word
    decides "?" against "." and nothing in the text predicts "!": the best possible accuracy is
    about 95 %, chance 1/3, always answering "?" 50 % and always "." about 45 %."""
    draws = corpus._Draws(np.random.default_rng(corpus.SYNTHETIC_SEED))
    language = corpus._language(draws)  # the corpus's own words and successors
    draws = corpus._Draws(np.random.default_rng([corpus.SYNTHETIC_SEED, _SYNTHETIC_SEEDS[split]]))
    wanted = {True: (n + 1) // 2, False: n // 2}
    records = []
    while wanted[True] or wanted[False]:
        sentence = corpus._sentence(draws, *language)
        asks = sentence.endswith("?")
        if not wanted[asks] or len(sentence) - 1 > SYNTHETIC_MAX_CONTEXT:
            continue
        wanted[asks] -= 1
        records.append(Record(SYNTHETIC_QUESTION, sentence[:-1], SYNTHETIC_CHOICES,
                              SYNTHETIC_CHOICES.index(sentence[-1])))
    return records


# --- tokens: right-padded training rows, evaluation prefixes ----------------------------------


def letter_token_ids(tokenizer, n: int = len(LETTERS)) -> np.ndarray:
    """The token each answer letter starts with when it follows "### CORRECT ANSWER\\n"."""
    if isinstance(tokenizer, TK.ByteTokenizer):
        return np.asarray([ord(c) for c in LETTERS[:n]], np.int32)
    base = _encode(tokenizer, ANSWER_HEADER)
    ids = []
    for letter in LETTERS[:n]:
        full = _encode(tokenizer, ANSWER_HEADER + letter + ":")
        common = 0
        while common < min(len(base), len(full)) and base[common] == full[common]:
            common += 1
        ids.append(full[common])
    if len(set(ids)) != len(ids):
        raise UserError("the tokenizer does not give each answer letter its own first token.")
    return np.asarray(ids, np.int32)


def _encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, TK.ByteTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [int(bos)]


def pad_id(tokenizer) -> int:
    """E.3 pads with the tokenizer's EOS; the byte tokenizer's document separator stands in."""
    return int(TK.separator_ids(tokenizer)[0]) if TK.separator_ids(tokenizer) else 0


@dataclass
class TrainingRows:
    tokens: np.ndarray  # int32 (N, seq_len + 1): inputs and shifted targets, right-padded
    mask: np.ndarray  # float32 (N, seq_len): 1 where a target counts in the loss
    truncated: int  # rows cut at seq_len + 1 tokens


def encode_training(records: list[Record], tokenizer, seq_len: int,
                    loss_on: str = "all") -> TrainingRows:
    """Rows of BOS (for a tokenizer that has one) + the training prompt, right-padded to
    `seq_len + 1` tokens. The mask is over targets: "all" counts every real token (E.3: only
    the padding is left out), "answer" only the tokens after "### CORRECT ANSWER\\n". Longer
    rows are cut at the right, as a truncating tokenizer would."""
    if loss_on not in ("all", "answer"):
        raise UserError(f"finetune.loss_on must be all or answer, not {loss_on!r}.")
    pad = pad_id(tokenizer)
    tokens = np.full((len(records), seq_len + 1), pad, np.int32)
    mask = np.zeros((len(records), seq_len), np.float32)
    truncated = longest = 0
    for i, record in enumerate(records):
        # The prompt and the answer are encoded apart, so the answer's first token is the one
        # evaluation reads after the prompt's tokens.
        head = _bos(tokenizer) + _encode(tokenizer, prompt(record))
        ids = head + _encode(tokenizer, answer_text(record))
        longest = max(longest, len(ids))
        if len(ids) > seq_len + 1:
            truncated += 1
            ids = ids[:seq_len + 1]
        tokens[i, :len(ids)] = ids
        first = 1 if loss_on == "all" else min(len(head), len(ids))  # first counted token
        mask[i, first - 1:len(ids) - 1] = 1.0
    # No counted token anywhere: the loss would be 0/0, a NaN that reads as a numerical fault.
    if len(records) and not mask.any():
        raise UserError(f"data.seq_len {seq_len} cuts off every training answer: finetune.loss_on "
                        f"{loss_on} learns nothing (every row fits data.seq_len {longest - 1}).")
    return TrainingRows(tokens, mask, truncated)


@dataclass
class EvalRows:
    inputs: np.ndarray  # int32 (N, seq_len), right-padded
    position: np.ndarray  # int32 (N,): the position whose next-token logits give the answer
    answers: np.ndarray  # int32 (N,)
    n_choices: np.ndarray  # int32 (N,)
    truncated: int  # prefixes cut at the left to fit


def encode_eval(records: list[Record], tokenizer, seq_len: int) -> EvalRows:
    """Evaluation prefixes (E.2: the prompt up to "### CORRECT ANSWER\\n"). A prefix longer
    than `seq_len` loses its start, so the answer position is always inside the row."""
    pad = pad_id(tokenizer)
    inputs = np.full((len(records), seq_len), pad, np.int32)
    position = np.zeros(len(records), np.int32)
    truncated = 0
    for i, record in enumerate(records):
        ids = _bos(tokenizer) + _encode(tokenizer, prompt(record))
        if len(ids) > seq_len:
            truncated += 1
            ids = ids[-seq_len:]
        inputs[i, :len(ids)] = ids
        position[i] = len(ids) - 1
    return EvalRows(inputs, position, np.asarray([r.answer for r in records], np.int32),
                    np.asarray([len(r.choices) for r in records], np.int32), truncated)


class QABatches:
    """Training batches of the padded rows in an order shuffled by `seed`, reshuffled each
    epoch: `batch(step)` is a pure function of the step (a checkpoint needs only the step).
    Returns {"tokens": (microsteps, batch, seq_len + 1), "mask": (microsteps, batch, seq_len)}.
    """

    def __init__(self, rows: TrainingRows, batch_size: int, microsteps: int, seed: int):
        self.rows, self.seed = rows, seed
        self.batch_size, self.microsteps = batch_size, microsteps
        self.num_sequences = len(rows.tokens)
        self.seq_len = rows.tokens.shape[1] - 1
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                self.num_sequences)}
        return self._orders[epoch]

    def batch(self, step: int) -> dict:
        per_step = self.batch_size * self.microsteps
        flat = step * per_step + np.arange(per_step)
        epoch, within = np.divmod(flat, self.num_sequences)
        index = np.empty(per_step, np.int64)
        for e in np.unique(epoch):
            index[epoch == e] = self.order(int(e))[within[epoch == e]]
        shape = (self.microsteps, self.batch_size)
        return {"tokens": self.rows.tokens[index].reshape(*shape, -1),
                "mask": self.rows.mask[index].reshape(*shape, -1)}


# --- test accuracy and disagreement ---------------------------------------------------------


def predictions(letter_logp: np.ndarray, top_token: np.ndarray, letter_ids: np.ndarray,
                n_choices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scored, generated) answer indices per question from the next-token log-probabilities
    of the letters (N, letters) and the greedy next token (N,). Scored: the highest-scoring
    letter among the question's choices. Generated: the letter the model would write first
    (E.2), or -1 when its greedy token is no choice's letter."""
    n = letter_logp.shape[1]
    valid = np.arange(n)[None, :] < n_choices[:, None]
    scored = np.argmax(np.where(valid, letter_logp, -np.inf), axis=1).astype(np.int32)
    hit = (top_token[:, None] == letter_ids[None, :n]) & valid
    generated = np.where(hit.any(axis=1), np.argmax(hit, axis=1), -1).astype(np.int32)
    return scored, generated


def test_accuracy(predicted: np.ndarray, answers: np.ndarray) -> float:
    """TA (Ma et al., section 6.1): per cent of test questions answered correctly."""
    return float(100.0 * np.mean(np.asarray(predicted) == np.asarray(answers)))


def disagreement(predicted: np.ndarray, reference: np.ndarray) -> float:
    """DP (Ma et al., section 6.1): per cent of test questions whose prediction differs from
    the reference model's (the model fine-tuned on the healthy node)."""
    return float(100.0 * np.mean(np.asarray(predicted) != np.asarray(reference)))
