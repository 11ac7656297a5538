"""Fine-tuning under SDC: the six QA tasks' prompts (appendix E.2), padding and loss masks
(E.3), the batch order, TA and DP, and `experiment.mode: finetune` end to end from an sdcstudy
run folder and from a Hugging Face Llama folder."""

import json

import numpy as np
import pandas as pd
import pytest

from sdcstudy.core import config as C
from sdcstudy.core import tokenizer as TK
from sdcstudy.finetune import qa
from sdcstudy.core.config import UserError

# --- each task's own schema -> the E.2 prompt ----------------------------------------------

FIXTURES = {
    "cosmosqa": ("validation", "jsonl", [
        {"id": "3Q9(", "context": "Good Old War and person L : I saw both of these bands.",
         "question": "In the future , will this person go to see other bands play ?",
         "answer0": "None of the above choices .", "answer1": "This person likes music .",
         "answer2": "This person only likes Good Old War .", "answer3": "Other Bands is bad .",
         "label": 1}]),
    "mathqa": ("test", "jsonl", [
        {"Problem": "a train runs at 54 km / hr . how fast in m / s ?",
         "Rationale": "\"54 * 5 / 18 = 15 answer : b\"",
         "options": "a ) 12 , b ) 15 , c ) 18.5 , d ) data inadequate , e ) none",
         "correct": "b", "annotated_formula": "multiply(54, const_0_2778)",
         "linear_formula": "multiply(n0,const_0_2778)|", "category": "physics"}]),
    "scienceqa": ("test", "parquet", [
        {"image": {"bytes": b"\x89PNG", "path": None}, "question": "Which image is red?",
         "choices": ["left", "right"], "answer": 0, "hint": "Look.", "task": "closed choice",
         "grade": "grade2", "subject": "natural science", "topic": "colors",
         "category": "x", "skill": "y", "lecture": "", "solution": ""},
        {"image": None, "question": "Which tense does the sentence use?",
         "choices": ["past tense", "present tense", "future tense"], "answer": 2,
         "hint": "Mona will print her name.", "task": "closed choice", "grade": "grade4",
         "subject": "language science", "topic": "verbs", "category": "Verb tense",
         "skill": "Is the sentence in the past, present, or future tense?",
         "lecture": "Present tense verbs tell you about something that is happening now.",
         "solution": "The sentence is in future tense."}]),
    "openbookqa": ("test", "jsonl", [
        {"id": "7-980", "question_stem": "The sun is responsible for",
         "choices": {"text": ["puppies learning new tricks", "plants sprouting",
                              "children growing up", "flowers wilting"],
                     "label": ["A", "B", "C", "D"]},
         "answerKey": "B", "fact1": "the sun is the source of energy for physical cycles",
         "humanScore": 1.0, "clarity": 2.0, "turkIdAnonymized": "b356d338b7"}]),
    "boolq": ("validation", "jsonl", [
        {"question": "does ethanol take more energy make that produces",
         "answer": False, "passage": "All biomass goes through at least some of these steps."}]),
    "race": ("test", "jsonl", [
        {"example_id": "high19432.txt", "article": "The rain had continued for a week.",
         "answer": "D", "question": "What did Nancy try to do before she fell over?",
         "options": ["Measure the depth", "Look for a tree", "Protect her cows",
                     "Run away from the flood"]}]),
}

EXPECTED = {
    "cosmosqa": (
        "### QUESTION\nIn the future , will this person go to see other bands play ?\n\n"
        "### CONTEXT\nGood Old War and person L : I saw both of these bands.\n\n"
        "### CHOICES\nA: None of the above choices .\nB: This person likes music .\n"
        "C: This person only likes Good Old War .\nD: Other Bands is bad .\n\n"
        "### CORRECT ANSWER\nB: This person likes music ."),
    "mathqa": (
        "### QUESTION\na train runs at 54 km / hr . how fast in m / s ?\n\n"
        "### CONTEXT\nphysics\n\n"
        "### CHOICES\nA: 12\nB: 15\nC: 18.5\nD: data inadequate\nE: none\n\n"
        "### CORRECT ANSWER\nB: 15"),
    "scienceqa": (
        "### QUESTION\nWhich tense does the sentence use?\n\n"
        "### CONTEXT\nMona will print her name.\n\n"
        "### CHOICES\nA: past tense\nB: present tense\nC: future tense\n\n"
        "### CORRECT ANSWER\nC: future tense"),
    "openbookqa": (
        "### QUESTION\nThe sun is responsible for\n\n"
        "### CONTEXT\nthe sun is the source of energy for physical cycles\n\n"
        "### CHOICES\nA: puppies learning new tricks\nB: plants sprouting\n"
        "C: children growing up\nD: flowers wilting\n\n"
        "### CORRECT ANSWER\nB: plants sprouting"),
    "boolq": (
        "### QUESTION\ndoes ethanol take more energy make that produces\n\n"
        "### CONTEXT\nAll biomass goes through at least some of these steps.\n\n"
        "### CHOICES\nA: yes\nB: no\n\n"
        "### CORRECT ANSWER\nB: no"),
    "race": (
        "### QUESTION\nWhat did Nancy try to do before she fell over?\n\n"
        "### CONTEXT\nThe rain had continued for a week.\n\n"
        "### CHOICES\nA: Measure the depth\nB: Look for a tree\nC: Protect her cows\n"
        "D: Run away from the flood\n\n"
        "### CORRECT ANSWER\nD: Run away from the flood"),
}


@pytest.fixture(scope="module")
def task_folders(tmp_path_factory):
    """One folder per task holding its split file in the dataset's own schema and format."""
    folders = {}
    for task, (split, fmt, rows) in FIXTURES.items():
        folder = tmp_path_factory.mktemp(task)
        if fmt == "jsonl":
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            pd.DataFrame(rows).to_parquet(folder / f"{split}.parquet")
        folders[task] = folder
    return folders


@pytest.mark.parametrize("task", list(FIXTURES))
def test_each_task_fixture_gives_the_e2_prompt_exactly(task_folders, task):
    """A wrong column mapping, choice parsing or template changes this text."""
    split = FIXTURES[task][0]
    records = qa.load_records(task, str(task_folders[task]), split)
    assert len(records) == 1  # ScienceQA's question with an image is left out (E.1)
    assert qa.training_text(records[0]) == EXPECTED[task]
    # Evaluation sees everything up to and including the answer header, nothing after (E.2).
    assert qa.prompt(records[0]) == EXPECTED[task][:EXPECTED[task].index("### CORRECT ANSWER")
                                                   ] + "### CORRECT ANSWER\n"


def test_missing_split_file_is_one_sentence(task_folders):
    with pytest.raises(UserError, match="holds no train.jsonl"):
        qa.load_records("race", str(task_folders["race"]), "train")


def test_unlabelled_rows_are_refused(tmp_path):
    """CosmosQA's hub test split has label -1: TA on it would be meaningless."""
    row = dict(FIXTURES["cosmosqa"][2][0], label=-1)
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="not one of the 4 choices"):
        qa.load_records("cosmosqa", str(tmp_path), "test")


# --- padding and the loss mask (E.3) ------------------------------------------------------


def test_padding_is_masked_out_and_answer_mask_covers_the_answer():
    tokenizer = TK.ByteTokenizer()
    records = qa.synthetic_records(6)
    seq_len = 176
    full = qa.encode_training(records, tokenizer, seq_len, "all")
    answer = qa.encode_training(records, tokenizer, seq_len, "answer")
    assert full.tokens.shape == (6, seq_len + 1) and full.truncated == 0
    for i, record in enumerate(records):
        text = qa.training_text(record).encode()
        n = len(text)
        assert bytes(full.tokens[i, :n].tolist()) == text
        assert (full.tokens[i, n:] == qa.pad_id(tokenizer)).all()  # right padding
        # "all": every target that is a real token counts, no padding target does.
        assert full.mask[i, :n - 1].all() and not full.mask[i, n - 1:].any()
        # "answer": exactly the targets that spell "X: choice" after the answer header.
        targets = full.tokens[i, 1:]
        assert bytes(targets[answer.mask[i] == 1].tolist()).decode() == qa.answer_text(record)


def test_rows_longer_than_seq_len_are_cut_and_counted():
    records = qa.synthetic_records(4)
    rows = qa.encode_training(records, TK.ByteTokenizer(), 32)
    assert rows.truncated == 4 and rows.mask.all()
    evals = qa.encode_eval(records, TK.ByteTokenizer(), 32)
    assert evals.truncated == 4 and (evals.position == 31).all()
    # The prefix keeps its end: the answer position still follows "### CORRECT ANSWER\n".
    assert bytes(evals.inputs[0].tolist()).decode().endswith(qa.ANSWER_HEADER)


def test_seq_len_that_cuts_off_every_answer_is_one_sentence_not_a_nan_loss():
    """Under loss_on: answer, rows cut before their answer count nothing; when that is every
    row the loss is 0/0 and the run used to die as "the loss became nan at step 1"."""
    records = qa.synthetic_records(4)
    with pytest.raises(UserError, match="data.seq_len 32 cuts off every training answer"):
        qa.encode_training(records, TK.ByteTokenizer(), 32, "answer")
    # One answer token left is something to learn from: no error, exactly that token counts.
    need = min(len(qa.prompt(r).encode()) for r in records) + 1
    rows = qa.encode_training(records, TK.ByteTokenizer(), need - 1, "answer")
    assert rows.mask.sum() >= 1 and rows.truncated == 4


def test_batches_are_a_function_of_step_and_seed():
    rows = qa.encode_training(qa.synthetic_records(20), TK.ByteTokenizer(), 176)
    a, b = qa.QABatches(rows, 4, 2, seed=0), qa.QABatches(rows, 4, 2, seed=0)
    other = qa.QABatches(rows, 4, 2, seed=1)
    assert a.batch(3)["tokens"].shape == (2, 4, 177) and a.batch(3)["mask"].shape == (2, 4, 176)
    np.testing.assert_array_equal(a.batch(7)["tokens"], b.batch(7)["tokens"])
    assert not np.array_equal(a.batch(0)["tokens"], other.batch(0)["tokens"])
    # Each epoch (20 rows = 2.5 steps of 8) visits every row once, then a new order starts.
    numbered = qa.TrainingRows(np.repeat(np.arange(20, dtype=np.int32)[:, None], 9, 1),
                               np.ones((20, 8), np.float32), 0)
    order = np.concatenate([qa.QABatches(numbered, 4, 2, seed=0).batch(s)["tokens"][..., 0]
                            .reshape(-1) for s in range(5)])
    assert sorted(order[:20]) == list(range(20)) and sorted(order[20:40]) == list(range(20))
    assert not np.array_equal(order[:20], order[20:40])


def test_synthetic_task_is_balanced_and_deterministic():
    records = qa.synthetic_records(400, "test")
    assert records == qa.synthetic_records(400, "test")
    counts = np.bincount([r.answer for r in records], minlength=3)
    assert counts[1] == 200 and counts[0] > counts[2] > 0
    train = {r.context for r in qa.synthetic_records(400, "train")}
    assert len(train & {r.context for r in records}) < 40  # drawn apart from the test questions


# --- TA and DP --------------------------------------------------------------------------


def test_predictions_ta_and_dp_against_a_direct_recomputation():
    rng = np.random.default_rng(0)
    n, letters = 200, 5
    letter_ids = np.asarray([65, 66, 67, 68, 69])
    logp = rng.normal(size=(n, letters))
    n_choices = rng.integers(2, letters + 1, n)
    top = np.where(rng.random(n) < 0.7, letter_ids[rng.integers(0, letters, n)], 32)
    scored, generated = qa.predictions(logp, top, letter_ids, n_choices)
    for i in range(n):
        assert scored[i] == max(range(n_choices[i]), key=lambda k: logp[i, k])
        hit = [k for k in range(n_choices[i]) if letter_ids[k] == top[i]]
        assert generated[i] == (hit[0] if hit else -1)
    answers = rng.integers(0, 2, n)
    assert qa.test_accuracy(scored, answers) == pytest.approx(
        100 * sum(int(s == a) for s, a in zip(scored, answers)) / n, abs=1e-12)
    assert qa.disagreement(generated, scored) == pytest.approx(
        100 * sum(int(g != s) for g, s in zip(generated, scored)) / n, abs=1e-12)


def test_config_errors_are_one_sentence():
    from sdcstudy.finetune.trainer import FinetuneTrainer

    with pytest.raises(UserError, match="finetune.task 'cosmos'"):
        FinetuneTrainer.from_config(C.from_dict({"experiment": {"mode": "finetune"},
                                                 "finetune": {"task": "cosmos"}}))
    with pytest.raises(UserError, match="neither a Hugging Face model folder"):
        FinetuneTrainer.from_config(C.from_dict({"experiment": {"mode": "finetune"},
                                                 "finetune": {"init": "/nonexistent"}}))
    with pytest.raises(UserError, match="needs data.source"):
        FinetuneTrainer.from_config(C.from_dict({"experiment": {"mode": "finetune"},
                                                 "finetune": {"task": "race"}}))
    # A split the synthetic task has no use for was silently ignored.
    with pytest.raises(UserError, match="finetune.test_split 'test' names a split of a dataset"):
        FinetuneTrainer.from_config(C.from_dict({"experiment": {"mode": "finetune"},
                                                 "finetune": {"test_split": "test"}}))


def test_init_from_a_run_folder_of_a_pair_is_one_sentence(tmp_path):
    """A free or finetune run's checkpoint holds two nodes; it used to fail as a checkpoint
    "damaged or does not match this model"."""
    from sdcstudy.finetune.trainer import initial_model

    (tmp_path / "config.yaml").write_text("experiment: {mode: finetune}\n")
    with pytest.raises(UserError, match="is a finetune run, whose checkpoint holds a "
                                        "healthy/suspect pair, not one model"):
        initial_model(C.from_dict({"experiment": {"mode": "finetune"},
                                   "finetune": {"init": str(tmp_path)}}))


# --- end to end ----------------------------------------------------------------------------

TINY = {"n_layers": 1}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from sdcstudy import runner

    out = tmp_path_factory.mktemp("pre") / "run"
    cfg = C.from_dict({"experiment": {"mode": "train", "steps": 2, "batch_size": 4,
                                      "checkpoint_every": 0},
                       "model": TINY, "data": {"seq_len": 32, "synthetic_tokens": 20_000}})
    runner.run(cfg, out, progress=False)
    return out


def _finetune_cfg(init, **finetune):
    return C.from_dict({
        "experiment": {"mode": "finetune", "steps": 2, "batch_size": 4, "checkpoint_every": 0},
        "model": TINY, "mesh": {"tp": 2}, "suspect": {"profile": "exponent-flip"},
        "optim": {"name": "adam", "lr": 1e-3, "warmup_steps": 1, "min_lr_ratio": 1.0},
        "data": {"seq_len": 176},
        "finetune": {"init": str(init), "synthetic_train": 16, "synthetic_test": 12,
                     "eval_batch_size": 8, **finetune}})


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    from sdcstudy import runner

    out = tmp_path_factory.mktemp("ft") / "run"
    summary = runner.run(_finetune_cfg(pretrained), out, progress=False)
    return out, summary


def test_finetune_run_writes_ta_and_dp_that_match_its_predictions(finetuned):
    """The summary's TA and DP are what predictions.parquet says, recomputed with pandas."""
    import sdcstudy

    out, summary = finetuned
    run = sdcstudy.load_run(out)
    frame = pd.read_parquet(out / "predictions.parquet")
    final = frame[frame["stage"] == "final"]
    healthy = final[final["node"] == 0].sort_values("question")
    suspect = final[final["node"] == 1].sort_values("question")
    initial = frame[frame["stage"] == "initial"].sort_values("question")
    assert len(healthy) == len(suspect) == len(initial) == 12
    assert summary["qa/test_questions"] == 12 and run.summary["qa/task"] == "synthetic"
    for key, preds in (("qa/ta/healthy", healthy), ("qa/ta/suspect", suspect),
                       ("qa/ta/initial", initial)):
        assert run.summary[key] == pytest.approx(
            100 * np.mean(preds["prediction"].to_numpy() == preds["answer"].to_numpy()),
            abs=1e-12)
    assert run.summary["qa/dp/suspect"] == pytest.approx(100 * np.mean(
        healthy["prediction"].to_numpy() != suspect["prediction"].to_numpy()), abs=1e-12)
    assert (final["prediction"] == final["generated"]).all()  # predict: generate (E.2)
    assert len(run.metrics) == 2 and "loss/suspect" in run.metrics
    assert run.summary["qa/chance"] == pytest.approx(100 / 3)


def test_finetune_run_writes_only_fields_docs_config_md_documents(finetuned):
    # If this fails, summary.json or metrics.jsonl has a field the finetune mode's tables
    # (modes/finetune.py, rendered into docs/config.md) do not name.
    from sdcstudy import reference

    out, _ = finetuned
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert reference.undocumented("finetune", summary, rows) == []
    assert reference.undocumented("finetune", {"finetune/disagreement": 0.0}, rows) == [
        "finetune/disagreement"]  # a field no table names is found


def test_finetune_starts_from_the_run_folders_parameters_and_scores_like_numpy(pretrained):
    """Both nodes start bitwise from the pretrained checkpoint; the sharded evaluation (tp=2)
    gives the letters' log-probabilities of a direct unsharded forward pass."""
    import jax

    from sdcstudy.core import hf
    from sdcstudy.finetune.trainer import FinetuneTrainer
    from sdcstudy.core.train import final_params

    trainer = FinetuneTrainer.from_config(_finetune_cfg(pretrained))
    state = trainer.init_state()
    expected = final_params(pretrained)
    params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
    for node in (0, 1):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[node], b), params, expected)
    got = trainer.initial_predictions
    rows = trainer.eval_rows
    logits = hf.logits(trainer.dims, expected, rows.inputs)
    at = logits[np.arange(len(rows.inputs)), rows.position]
    logp = at - np.log(np.sum(np.exp(at - at.max(-1, keepdims=True)), -1, keepdims=True)) \
        - at.max(-1, keepdims=True)
    # Sharded (sequence-parallel) and unsharded float32 sums differ in order: ~1e-6 relative.
    np.testing.assert_allclose(got["letter_logp"][0], logp[:, trainer.letter_ids],
                               rtol=1e-5, atol=1e-5)
    scored, generated = qa.predictions(logp[:, trainer.letter_ids], at.argmax(-1),
                                       trainer.letter_ids, rows.n_choices)
    np.testing.assert_array_equal(got["scored"][0], scored)
    np.testing.assert_array_equal(got["generated"][0], generated)


def test_finetune_starts_from_a_hugging_face_llama_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from sdcstudy.core import hf
    from sdcstudy.finetune.trainer import FinetuneTrainer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    trainer = FinetuneTrainer.from_config(_finetune_cfg(tmp_path))
    dims, params = hf.load_hf_checkpoint(tmp_path, max_length=176)
    assert trainer.dims == dims and trainer.dims.d_model == 32
    import jax

    state = jax.tree.map(np.asarray, jax.device_get(trainer.init_state()["params"]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[1], np.asarray(b)), state, params)
    assert trainer.initial_predictions["scored"].shape == (2, 12)


# --- Table 3 in sdcstudy report -------------------------------------------------------------


def _fake_finetune_run(folder, profile, seed, healthy, suspect, spikes=(), steps=5):
    """A finetune run folder as the runner leaves it (summary, metrics of 5 steps,
    predictions); `steps` more than 5 makes it a run stopped early (`--stop-after`)."""
    from sdcstudy.core import runfolder as RF

    answers = np.zeros(len(healthy), int)
    folder.mkdir()
    (folder / "config.yaml").write_text(
        f"experiment: {{mode: finetune, steps: {steps}}}\nsuspect: {{profile: {profile}}}\n")
    RF.atomic_write_json(folder / "summary.json", {
        "qa/task": "synthetic", "qa/shuffle_seed": seed, "loss_spikes": list(spikes),
        "qa/ta/initial": 10.0, "qa/dp/initial": 90.0,
        "qa/ta/healthy": qa.test_accuracy(healthy, answers),
        "qa/ta/suspect": qa.test_accuracy(suspect, answers),
        "qa/dp/suspect": qa.disagreement(suspect, healthy)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss/healthy": 1.0, "loss/suspect": 9.0 if s in spikes else 1.0}) + "\n"
        for s in range(1, 6)))
    pd.DataFrame([{"stage": "final", "node": n, "question": i, "prediction": int(p)}
                  for n, preds in enumerate((healthy, suspect)) for i, p in enumerate(preds)]
                 ).to_parquet(folder / "predictions.parquet")


def test_report_table3_rows_dp_of_the_other_seed_and_spike_flags(tmp_path):
    """DP of the other-seed baseline comes from both runs' healthy predictions; a run with a
    loss spike is starred and named; the reference seed is the one most runs share."""
    from sdcstudy.report import writer as report

    ref = np.array([0, 0, 1, 2, 0, 1, 1, 0])
    other = np.array([0, 1, 1, 2, 0, 2, 1, 0])  # differs on 2 of 8 questions
    late = np.array([2, 2, 2, 2, 2, 2, 2, 2])
    _fake_finetune_run(tmp_path / "a", "healthy", 0, ref, ref)
    _fake_finetune_run(tmp_path / "b", "paper-node-6", 0, ref, late, spikes=(4, 5))
    _fake_finetune_run(tmp_path / "c", "healthy", 7, other, other)
    # One flagged step is a corrupted reading, not a loss spike (core/metrics.py): no star.
    _fake_finetune_run(tmp_path / "d", "paper-node-4", 0, ref, ref, spikes=(3,))
    result = report.write_report([tmp_path / d for d in "abcd"], tmp_path / "report")
    assert {"table3_finetune.csv", "finetune_loss_spikes.csv",
            "fig7_finetune_loss.png"} <= set(result["files"])
    md = result["markdown"]
    assert "| Healthy Node | 50.00 (-) |" in md
    assert "| Healthy Node (seed=7) | 37.50 (25.00) |" in md
    assert "| Unhealthy Node 6 | 0.00 (87.50) * |" in md
    assert "| without fine-tuning | 10.00 (90.00) |" in md
    assert "LOSS SPIKE: Node 6 at steps 4-5" in md
    assert "| Unhealthy Node 4 | 50.00 (0.00) |" in md and "Node 4 at steps" not in md
    table = pd.read_csv(tmp_path / "report" / "table3_finetune.csv", index_col=0)
    assert table.loc["Healthy Node (seed=7)", "synthetic DP"] == pytest.approx(25.0)


def test_report_table3_marks_the_cells_of_a_run_stopped_early(tmp_path):
    """A run stopped by --stop-after is evaluated at the step it stopped at: its cells (the
    suspect's, and the healthy node's where it is the reference run) carry a dagger, where
    they read as full fine-tuning before."""
    from sdcstudy.report import writer as report

    ref = np.array([0, 0, 1, 2, 0, 1, 1, 0])
    _fake_finetune_run(tmp_path / "a", "paper-node-6", 0, ref, ref, steps=9)
    _fake_finetune_run(tmp_path / "b", "paper-node-4", 0, ref, ref)
    md = report.write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "report")["markdown"]
    assert "| Unhealthy Node 6 | 50.00 (0.00) † |" in md
    assert "| Unhealthy Node 4 | 50.00 (0.00) |" in md
    assert "| without fine-tuning | 10.00 (90.00) |" in md
    assert "† a run stopped before its last step" in md


def test_report_table3_keeps_runs_that_would_share_a_row(tmp_path):
    """Two runs of one node and seed (other fault seeds, or a node and its flip model) used to
    share one row, the later hiding the earlier; each now has its row, named by its folder,
    and the rows keep the paper's node order."""
    from sdcstudy.report import writer as report

    ref = np.array([0, 0, 1, 2, 0, 1, 1, 0])
    late = np.array([2, 2, 2, 2, 2, 2, 2, 2])
    _fake_finetune_run(tmp_path / "one", "paper-node-1", 0, ref, ref)
    _fake_finetune_run(tmp_path / "two", "paper-node-1", 0, ref, late, spikes=(4, 5))
    _fake_finetune_run(tmp_path / "flip", "paper-node-1-flip", 0, ref, ref[::-1])
    _fake_finetune_run(tmp_path / "six", "paper-node-6", 0, ref, ref)
    result = report.write_report([tmp_path / d for d in ("six", "one", "two", "flip")],
                                 tmp_path / "report")
    md = result["markdown"]
    assert "| Unhealthy Node 1 (one) | 50.00 (0.00) |" in md
    assert "| Unhealthy Node 1 (two) | 0.00 (87.50) * |" in md
    flipped = qa.disagreement(ref[::-1], ref)
    assert f"| Unhealthy Node 1 (flip) | 50.00 ({flipped:.2f}) |" in md
    table = pd.read_csv(tmp_path / "report" / "table3_finetune.csv", index_col=0)
    assert list(table.index) == ["without fine-tuning", "Healthy Node",
                                 "Unhealthy Node 1 (flip)", "Unhealthy Node 1 (one)",
                                 "Unhealthy Node 1 (two)", "Unhealthy Node 6"]
