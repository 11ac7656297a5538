"""Fine-tuning under SDC (Ma et al., section 6.1 experiment II; appendix E): `experiment.mode:
finetune`.

A pretrained model (a Hugging Face Llama/Mistral folder, or an sdcstudy run folder's latest
checkpoint) is fine-tuned on a multiple-choice QA task (`finetune/qa.py`) on a healthy node and a
suspect node side by side, free-running (no synchronization, as in `free` mode), with any
fault profile on the suspect. Both nodes see the same batches, in the order set by the shuffle
seed. After the last step both nodes answer the test questions, and so does the model before
fine-tuning; `predictions.parquet` holds every answer and `summary.json` the test accuracy
(TA) and the disagreement percentage (DP) with the healthy node. The healthy baseline with
another shuffle seed is a second run (`finetune.shuffle_seed`); `sdcstudy report` sets the
runs side by side as in Table 3.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.core import tokenizer as TK
from sdcstudy.core import hostarrays
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.finetune import qa
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core.config import Config, UserError
from sdcstudy.paired.trainer import PairedTrainer, tree_specs

PREDICTIONS = "predictions.parquet"
PREDICTION_COLUMNS = ("stage", "node", "question", "answer", "n_choices", "scored", "generated",
                      "prediction", "correct")
STAGES = ("initial", "final")  # before fine-tuning (both nodes alike), after it
# Run folders whose checkpoint holds more than one model: finetune.init could not say which to
# start from, and restoring one model from them fails as a checkpoint that "does not match".
MANY_MODELS = {"lockstep": "a healthy/suspect pair", "paramsync": "a healthy/suspect pair",
               "free": "a healthy/suspect pair", "finetune": "a healthy/suspect pair",
               "paft": "one model per worker"}


def init_dims(cfg: Config) -> C.ModelDims | None:
    """The model `finetune.init` gives, from its config alone (no tensors, no checkpoint): a
    Hugging Face folder's config.json or a run folder's config.yaml, in model.dtype; None for
    "" (the random init) or a folder that is neither (`initial_model` refuses it)."""
    if not cfg.finetune.init:
        return None
    folder = Path(cfg.finetune.init).expanduser()
    if (folder / "config.json").is_file():
        from sdcstudy.core.hf import hf_dims

        return hf_dims(folder, dtype=cfg.model.dtype, max_length=cfg.data.seq_len)
    if (folder / RF.CONFIG).is_file():
        pretrained = C.load(folder / RF.CONFIG)
        return dataclasses.replace(C.model_dims(pretrained.model), dtype=cfg.model.dtype)
    return None


def initial_model(cfg: Config) -> tuple[C.ModelDims, Any]:
    """(dims, params or None) of `finetune.init`: a Hugging Face folder (config.json), an
    sdcstudy run folder (config.yaml + checkpoints), or "" for the seed's random init."""
    source = cfg.finetune.init
    if not source:
        return C.model_dims(cfg.model), None
    folder = Path(source).expanduser()
    if (folder / "config.json").is_file():
        from sdcstudy.core.hf import load_hf_checkpoint

        return load_hf_checkpoint(folder, dtype=cfg.model.dtype, max_length=cfg.data.seq_len)
    if (folder / RF.CONFIG).is_file():
        from sdcstudy.core.train import final_params

        pretrained = C.load(folder / RF.CONFIG)
        mode = pretrained.experiment.mode
        if mode in MANY_MODELS:
            raise UserError(f"finetune.init {source!r} is a {mode} run, whose checkpoint holds "
                            f"{MANY_MODELS[mode]}, not one model; give a train run folder.")
        if pretrained.data.tokenizer != cfg.data.tokenizer:
            raise UserError(f"finetune.init {source!r} was trained with tokenizer "
                            f"{pretrained.data.tokenizer!r}, not data.tokenizer "
                            f"{cfg.data.tokenizer!r}; use the same tokenizer.")
        return init_dims(cfg), final_params(folder, pretrained)
    raise UserError(f"finetune.init {source!r} is neither a Hugging Face model folder "
                    f"(config.json) nor an sdcstudy run folder (config.yaml); give one of those "
                    f"or \"\" for a random init.")


def load_task(cfg: Config, tokenizer):
    """(training rows, evaluation rows) of `finetune.task`, tokenized and padded."""
    f, d = cfg.finetune, cfg.data
    if f.task == "synthetic":
        train = qa.synthetic_records(f.synthetic_train, "train")
        test = qa.synthetic_records(f.synthetic_test, "test")
    else:
        if d.source == "synthetic":
            raise UserError(f"finetune.task {f.task!r} needs data.source: a local folder with "
                            f"its split files, \"hub\", or a Hub dataset name.")
        task = qa.TASKS[f.task]
        train = qa.load_records(f.task, d.source, d.split, d.hub_config, f.max_train)
        test = qa.load_records(f.task, d.source, f.test_split or task.test_split, d.hub_config,
                               f.max_test)
    train, test = train[:f.max_train], test[:f.max_test]
    return (qa.encode_training(train, tokenizer, d.seq_len, f.loss_on),
            qa.encode_eval(test, tokenizer, d.seq_len))


def validate(cfg: Config) -> None:
    f = cfg.finetune
    if f.task not in qa.TASK_NAMES:
        raise UserError(f"finetune.task {f.task!r} is not one of {', '.join(qa.TASK_NAMES)}.")
    if f.loss_on not in ("all", "answer"):
        raise UserError(f"finetune.loss_on must be all or answer, not {f.loss_on!r}.")
    if f.predict not in ("generate", "score"):
        raise UserError(f"finetune.predict must be generate or score, not {f.predict!r}.")
    if f.eval_batch_size < 1 or f.eval_batch_size % cfg.mesh.dp:
        raise UserError(f"finetune.eval_batch_size ({f.eval_batch_size}) must be a positive "
                        f"multiple of mesh.dp ({cfg.mesh.dp}).")
    if f.task == "synthetic" and f.test_split is not None:
        raise UserError(f"finetune.test_split {f.test_split!r} names a split of a dataset task; "
                        f"the synthetic task's test questions are finetune.synthetic_test's.")
    for key in ("synthetic_train", "synthetic_test", "max_train", "max_test"):
        value = getattr(f, key)
        if value is not None and value < 1:
            raise UserError(f"finetune.{key} must be at least 1, not {value}.")


@dataclass
class FinetuneTrainer(PairedTrainer):
    """A free-running healthy/suspect pair that starts from pretrained parameters, trains on
    padded, masked QA rows and answers the test questions at the end."""

    initial_params: Any = None
    tokenizer: Any = None
    train_rows: qa.TrainingRows | None = None
    eval_rows: qa.EvalRows | None = None
    letter_ids: np.ndarray | None = None
    initial_predictions: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Config, mesh=None) -> "FinetuneTrainer":
        validate(cfg)
        dims, params = initial_model(cfg)
        tokenizer = TK.load_tokenizer(cfg.data.tokenizer)
        if len(tokenizer) > dims.vocab_size:
            raise UserError(f"data.tokenizer has {len(tokenizer)} tokens but the model's "
                            f"vocabulary holds {dims.vocab_size}; use the model's tokenizer.")
        free = dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment,
                                                                       mode="free"))
        base = PairedTrainer.from_config(free, mesh=mesh, dims=dims)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(PairedTrainer)}
        train_rows, eval_rows = load_task(cfg, tokenizer)
        letters = int(eval_rows.n_choices.max())
        return cls(**{**fields, "cfg": cfg, "mode": "finetune"}, initial_params=params,
                   tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                   letter_ids=qa.letter_token_ids(tokenizer, letters))

    # --- state and data ----------------------------------------------------------------------

    def init_state(self) -> dict:
        """Both nodes start from the pretrained parameters (or the seed's init)."""
        if self.initial_params is None:
            state = super().init_state()
        else:
            state = self.pair_state(jax.tree.map(jnp.asarray, self.initial_params))
        self.initial_predictions = self._predict(state["params"])
        return state

    @property
    def shuffle_seed(self) -> int:
        f = self.cfg.finetune
        return self.cfg.experiment.seed if f.shuffle_seed is None else f.shuffle_seed

    def data_batches(self) -> qa.QABatches:
        e = self.cfg.experiment
        return qa.QABatches(self.train_rows, e.batch_size, e.microsteps, self.shuffle_seed)

    def batch_shardings(self):
        spec = NamedSharding(self.mesh, P(None, M.DATA, M.TP))
        return {"inputs": spec, "targets": spec, "mask": spec}

    def make_batch(self, rows: dict) -> dict:
        return {**self.split_batch(rows["tokens"]), "mask": rows["mask"]}

    # --- evaluation ---------------------------------------------------------------------------

    def _eval_local(self, params, inputs_BL):
        """Per device: log-probabilities of the answer letters and the greedy token at every
        position of this rank's sequence shard, for this node's parameters."""
        logits_BLV = model.apply(self.graphdef, jax.tree.map(lambda x: x[0], params), inputs_BL,
                                 tp_axis=M.TP)
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        letters_BLN = jnp.take(logp_BLV, jnp.asarray(self.letter_ids), axis=-1)
        top_BL = jnp.argmax(logits_BLV, axis=-1).astype(jnp.int32)
        return letters_BLN[None], top_BL[None]

    def _eval_fn(self, params):
        if not hasattr(self, "_compiled_eval"):
            spec = P(M.NODE, M.DATA, M.TP)
            fn = jax.shard_map(self._eval_local, mesh=self.mesh,
                               in_specs=(tree_specs(params), P(M.DATA, M.TP)),
                               out_specs=(spec, spec), check_vma=True)
            self._compiled_eval = jax.jit(fn)
        return self._compiled_eval

    def _predict(self, params) -> dict:
        """{"scored", "generated"}: (2, N) answer indices of both nodes on the test questions,
        with the letters' log-probabilities {"letter_logp"} (2, N, letters) and the greedy
        next token {"top"} (2, N) they come from."""
        rows, size = self.eval_rows, self.cfg.finetune.eval_batch_size
        n = len(rows.inputs)
        fn = self._eval_fn(params)
        letter_logp = np.zeros((2, n, len(self.letter_ids)), np.float32)
        top = np.zeros((2, n), np.int32)
        sharding = NamedSharding(self.mesh, P(M.DATA, M.TP))
        for start in range(0, n, size):
            chunk = rows.inputs[start:start + size]
            stop = start + len(chunk)
            if len(chunk) < size:  # the last batch is padded with copies of its first row
                chunk = np.concatenate([chunk, np.repeat(chunk[:1], size - len(chunk), 0)])
            batch = hostarrays.put(chunk, sharding) if jax.process_count() > 1 \
                else jax.device_put(chunk, sharding)
            letters, tokens = hostarrays.fetch(fn(params, batch))
            at = rows.position[start:stop]
            index = np.arange(stop - start)
            letter_logp[:, start:stop] = np.asarray(letters)[:, index, at]
            top[:, start:stop] = np.asarray(tokens)[:, index, at]
        scored, generated = zip(*(qa.predictions(letter_logp[k], top[k], self.letter_ids,
                                                 rows.n_choices) for k in range(2)))
        return {"scored": np.stack(scored), "generated": np.stack(generated),
                "letter_logp": letter_logp, "top": top}

    def evaluate(self, state, run_dir: Path | None) -> dict:
        """Both nodes answer the test questions; writes predictions.parquet (when `run_dir`)
        and returns the summary keys `qa/...`."""
        final = self._predict(state["params"])
        pick = "scored" if self.cfg.finetune.predict == "score" else "generated"
        rows = self.eval_rows
        healthy, suspect = final[pick][M.HEALTHY], final[pick][M.SUSPECT]
        initial = self.initial_predictions[pick][M.HEALTHY]
        table = []
        for stage, preds, nodes in (("initial", self.initial_predictions, (M.HEALTHY,)),
                                    ("final", final, (M.HEALTHY, M.SUSPECT))):
            for node in nodes:
                for i in range(len(rows.answers)):
                    table.append({"stage": stage, "node": node, "question": i,
                                  "answer": int(rows.answers[i]),
                                  "n_choices": int(rows.n_choices[i]),
                                  "scored": int(preds["scored"][node, i]),
                                  "generated": int(preds["generated"][node, i]),
                                  "prediction": int(preds[pick][node, i]),
                                  "correct": bool(preds[pick][node, i] == rows.answers[i])})
        if run_dir is not None:
            log = TL.TableLog(Path(run_dir) / PREDICTIONS, PREDICTION_COLUMNS)
            log.extend(table)
            log.flush()
        return {
            "qa/task": self.cfg.finetune.task,
            "qa/predict": self.cfg.finetune.predict,
            "qa/shuffle_seed": self.shuffle_seed,
            "qa/train_questions": int(len(self.train_rows.tokens)),
            "qa/test_questions": int(len(rows.answers)),
            "qa/truncated_train": int(self.train_rows.truncated),
            "qa/truncated_test": int(rows.truncated),
            "qa/chance": float(100.0 * np.mean(1.0 / rows.n_choices)),
            "qa/ta/initial": qa.test_accuracy(initial, rows.answers),
            "qa/ta/healthy": qa.test_accuracy(healthy, rows.answers),
            "qa/ta/suspect": qa.test_accuracy(suspect, rows.answers),
            "qa/dp/initial": qa.disagreement(initial, healthy),
            "qa/dp/suspect": qa.disagreement(suspect, healthy),
        }
