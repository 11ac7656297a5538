"""experiments/ holds studies, not a second library (issue 54, item 5), read from the source:
every study is one file whose docstring starts with the command that runs it, none edits
`sys.path` or imports another study, and each uses only public names of sdcstudy that exist
(a name renamed in the package fails here, not at the end of a long study).

Each check is a function of a folder; the last test plants each violation in a copy and shows
the check catches it (a check that cannot fail is no check). Only the sdcstudy modules the
studies import are imported (JAX once); no study runs.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
PACKAGE = "sdcstudy"


def studies(folder: Path = EXPERIMENTS) -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(folder.glob("*.py"))}


def command_violations(folder: Path = EXPERIMENTS) -> list[str]:
    """A study whose docstring does not start with `python experiments/NAME.py` (or
    `.venv/bin/python`, or `python -m experiments.NAME`); a shell script whose first comment
    does not start with `bash experiments/NAME.sh`."""
    found = []
    for name, tree in studies(folder).items():
        stem = name[:-3]
        doc = ast.get_docstring(tree, clean=False) or ""
        pattern = rf"(\.venv/bin/)?python (experiments/{stem}\.py|-m experiments\.{stem})(\s|$)"
        if not re.match(pattern, doc):
            first = doc.splitlines()[0] if doc else "no docstring"
            found.append(f"{name}: docstring starts {first[:60]!r}, not its command")
    for script in sorted(folder.glob("*.sh")):
        comments = [line for line in script.read_text().splitlines()[1:] if line.startswith("#")]
        if not comments or not comments[0].startswith(f"# bash experiments/{script.name}"):
            found.append(f"{script.name}: its first comment is not its command")
    return found


def path_violations(folder: Path = EXPERIMENTS) -> list[str]:
    """Uses of `sys.path` and imports of another study (`import paft_common`)."""
    own = {p.stem for p in folder.glob("*.py")} | {"experiments"}
    found = []
    for name, tree in studies(folder).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and \
                    isinstance(node.value, ast.Name) and node.value.id == "sys":
                found.append(f"{name}:{node.lineno} uses sys.path")
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name}:{node.lineno} imports the study {m!r}" for m in modules
                      if m.split(".")[0] in own]
    return _by_line(found)


def _by_line(found: list[str]) -> list[str]:
    """`STUDY:LINE ...` messages in the order of their studies and lines."""
    return sorted(found, key=lambda m: (m.split(":")[0], int(m.split(":")[1].split()[0])))


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def sdcstudy_uses(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every sdcstudy name a study reaches: `from M import name`,
    `import M`, and `ALIAS.attr` where ALIAS is bound to an sdcstudy module or name."""
    aliases, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    uses.append((node.lineno, a.name, None))
                    aliases[a.asname or PACKAGE] = (a.name if a.asname else PACKAGE, None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").split(".")[0] == PACKAGE:
            for a in node.names:
                uses.append((node.lineno, node.module, a.name))
                aliases[a.asname or a.name] = (node.module, a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in aliases:
            module, name = aliases[node.value.id]
            base = module if name is None else f"{module}.{name}"
            uses.append((node.lineno, base, node.attr))
    return uses


def _exists(module: str, name: str | None) -> bool:
    """Whether `module` (dotted) imports and has `name` (an attribute or a submodule)."""
    try:
        target = importlib.import_module(module)
    except ModuleNotFoundError:
        head, _, last = module.rpartition(".")  # `from M import f` then `f.attr`
        if not head or not _exists(head, last):
            return False
        target = getattr(importlib.import_module(head), last)
    if name is None or hasattr(target, name):
        return True
    return importlib.util.find_spec(f"{module}.{name}") is not None \
        if hasattr(target, "__path__") else False


def name_violations(folder: Path = EXPERIMENTS, check_exists: bool = True) -> list[str]:
    """Private sdcstudy names a study uses, and (with `check_exists`) names that do not exist."""
    found = []
    for study, tree in studies(folder).items():
        for line, module, name in sdcstudy_uses(tree):
            dotted = module if name is None else f"{module}.{name}"
            if _private(dotted):
                found.append(f"{study}:{line} uses the private {dotted}")
            elif check_exists and not _exists(module, name):
                found.append(f"{study}:{line} uses {dotted}, which does not exist")
    return _by_line(found)


# --- experiments/ as it is ---------------------------------------------------------------------


def test_each_study_starts_with_its_command():
    assert command_violations() == []


def test_no_study_edits_sys_path_or_imports_another():
    assert path_violations() == [], \
        "a helper two studies share is product: move it into sdcstudy/ with a public name"


def test_studies_use_only_public_names_that_exist():
    assert name_violations() == [], \
        "make the name public in its module (and update the package's callers)"


def test_the_scorecards_command_is_a_package_entry(capsys):
    # The package points at no study: the command a scorecard prints for its missing Figure 10
    # entries is a module of sdcstudy, and it parses that command's arguments (then refuses
    # --products 0 before measuring anything).
    from sdcstudy.reproduce import scorecard

    words = scorecard.PAPER_SCALE_COMMAND.split()
    assert words[:2] == ["python", "-m"] and words[2].startswith(f"{PACKAGE}."), words
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(words[2]).main([*words[3:], "--products", "0"])
    assert stop.value.code == 2
    assert "--products and --draws must be at least 1" in capsys.readouterr().err


def test_the_checks_catch_each_violation(tmp_path):
    (tmp_path / "helper.py").write_text('"""python experiments/helper.py\n\nShared."""\n')
    (tmp_path / "bad.py").write_text(
        '"""What a study shows.\n\n    python experiments/bad.py\n"""\n'
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "import helper\n"
        "from sdcstudy.report import plots as PL\n"
        "from sdcstudy.faults.corrupt import _corrupt\n"
        "from sdcstudy.faults import no_such_module\n"
        "PL._pyplot()\n"
        "PL.no_such_function()\n")
    (tmp_path / "run.sh").write_text("#!/usr/bin/env bash\n# Runs it.\n")
    assert command_violations(tmp_path) == [
        "bad.py: docstring starts 'What a study shows.', not its command",
        "run.sh: its first comment is not its command"]
    assert path_violations(tmp_path) == ["bad.py:6 uses sys.path",
                                         "bad.py:7 imports the study 'helper'"]
    assert name_violations(tmp_path) == [
        "bad.py:9 uses the private sdcstudy.faults.corrupt._corrupt",
        "bad.py:10 uses sdcstudy.faults.no_such_module, which does not exist",
        "bad.py:11 uses the private sdcstudy.report.plots._pyplot",
        "bad.py:12 uses sdcstudy.report.plots.no_such_function, which does not exist"]


@pytest.mark.parametrize("argv, says", [
    (["--json", "/no/such/folder/cost.json"], "its folder /no/such/folder does not exist"),
    (["--rate", "0"], "--rate in (0, 1]"),
    (["--tokens", "0"], "must be at least 1"),
    (["--preset", "huge"], "unknown model.preset 'huge'"),
])
def test_fault_draw_cost_refuses_bad_arguments_in_one_sentence(argv, says, capsys):
    # Bad input: exit 2 and one sentence, before anything is drawn or written.
    path = Path(__file__).resolve().parents[1] / "experiments" / "fault_draw_cost.py"
    spec = importlib.util.spec_from_file_location("fault_draw_cost", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    with pytest.raises(SystemExit) as stop:
        study.main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err


# --- each study refuses bad input in one sentence, before any JAX work -------------------------


def load_study(name: str):
    """The study experiments/NAME.py as a module (its `main` is called in-process)."""
    spec = importlib.util.spec_from_file_location(f"study_{name}", EXPERIMENTS / f"{name}.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def study_exit(name: str, argv: list[str]) -> int:
    """The exit code of `main(argv)`, whether returned or raised."""
    try:
        return load_study(name).main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.fixture
def folders(tmp_path):
    """{tmp}: `file.txt` (a file), `full/` (a folder holding the files studies write), `nothing`
    (absent)."""
    (tmp_path / "file.txt").write_text("not a folder\n")
    full = tmp_path / "full"
    full.mkdir()
    for name in ("paramsync.yaml", "fault_models.md", "abft_paper_scale.json", "old.txt"):
        (full / name).write_text("a previous result\n")
    return tmp_path


@pytest.mark.parametrize("study, argv, says", [
    ("flip_model_compare", ["table", "{tmp}/file.txt"], "file.txt' is not a run folder"),
    ("flip_model_compare", ["profiles", "{tmp}/full"], "paramsync.yaml' already exists"),
    ("flip_model_compare", ["profiles", "{tmp}/file.txt"], "is a file, not a folder"),
    ("flip_model_compare", [], "required: command"),
    ("exposure_spread", ["{tmp}/full"], "give two or more reproduce folders"),
    ("exposure_spread", ["{tmp}/full", "{tmp}/nothing"], "nothing' is not a folder"),
    ("exposure_spread", ["{tmp}/full", "{tmp}/full"], "no lock-step run"),
    ("compare_fault_models", ["{tmp}/nothing", "{tmp}/nothing"], "nothing' does not exist"),
    ("compare_fault_models", ["{tmp}/file.txt", "{tmp}/file.txt"], "is not a scorecard"),
    ("compare_fault_models", ["a", "b", "--out", "{tmp}/full"],
     "already holds fault_models.md; pass --replace"),
    ("fault_draw_cost", ["--json", "{tmp}/file.txt"], "file.txt already exists"),
    ("abft_eval", ["--repeats", "0", "--out", "{tmp}/new"], "must be at least 1"),
    ("abft_eval", ["--dtypes", "float8", "--out", "{tmp}/new"], "model.dtype must be one of"),
    ("abft_eval", ["--plot", "{tmp}/nothing"], "nothing is not a file"),
    ("abft_eval", ["--out", "{tmp}/file.txt"], "is not an empty folder"),
    ("abft_paper_scale", ["--products", "0", "--out", "{tmp}/new"], "must be at least 1"),
    ("abft_paper_scale", ["--out", "{tmp}/full"], "already holds abft_paper_scale.json"),
    ("bench_scaling", ["--out", "{tmp}/new", "--repeats", "0"], "must be at least 1"),
    ("bench_scaling", ["--out", "{tmp}/file.txt"], "is not an empty folder"),
    ("compiler_options", ["--matmul-form", "--out", "{tmp}/file.txt"], "already exists"),
    ("profile_overheads", ["--out", "{tmp}/file.txt"], "already exists"),
    ("profile_step", ["--out", "{tmp}/file.txt"], "already exists"),
    ("detectors", ["--out", "{tmp}/new", "--steps", "0"], "must be at least 1"),
    ("detectors", ["--out", "{tmp}/full", "--tables-only"], "holds none of the study's run"),
    ("detectors", ["--out", "{tmp}/file.txt"], "is not an empty folder"),
    ("fault_compile_cost", ["--mode", "nope"], "experiment.mode 'nope' is not one of"),
    ("fault_compile_cost", ["--layers", "0"], "model.n_layers must be at least 1"),
    ("finetune_qa", ["--out", "{tmp}/new", "--steps", "0"], "must be at least 1"),
    ("golden_flips", ["--flips", "0", "--out", "{tmp}/new"], "--flips must be at least 1"),
    ("golden_flips", ["--out", "{tmp}/full"], "is not an empty folder"),
    ("loss_spike", ["--out", "{tmp}/full"], "is not an empty folder"),
    ("wcnts_scaling", ["--out", "{tmp}/file.txt"], "is a file, not a folder"),
    ("paft_noise", ["--out", "{tmp}/full"], "already holds files"),
    ("paft_noise", ["--out", "{tmp}/new", "--steps", "0"], "--steps must be at least 1"),
    ("paft_packets", ["--out", "{tmp}/file.txt"], "is a file; give a new or empty folder"),
])
def test_studies_refuse_bad_arguments_in_one_sentence(study, argv, says, folders, capsys):
    # Bad input (a path that is not what the study reads, an --out that holds a result, a number
    # no run can take): exit 2 and one line, before any JAX work; nothing written.
    before = sorted(p.relative_to(folders) for p in folders.rglob("*"))
    code = study_exit(study, [a.replace("{tmp}", str(folders)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, (code, err)
    assert sorted(p.relative_to(folders) for p in folders.rglob("*")) == before


def test_a_crashed_comparison_across_devices_is_no_verdict(monkeypatch, capsys):
    # Exit 1 says the devices differ: a crash ends with 3 and one sentence instead.
    study = load_study("fault_draws_across_devices")

    def crash(*args):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(study, "compare", crash)
    assert study.main(["--kinds", "count", "--quick"]) == 3
    assert "could not run: RuntimeError: the device went away" in capsys.readouterr().err


def test_wcnts_scaling_continues_a_run_it_was_interrupted_in(tmp_path, monkeypatch):
    # "An interrupted study continues where it stopped": a run folder with its config and no
    # summary is resumed (runner.run refuses a non-empty folder without resume); a new one not.
    from sdcstudy import runner

    study, asked = load_study("wcnts_scaling"), {}

    def run(cfg, folder, resume=False, **kwargs):
        asked[folder.name] = resume
        return {}

    monkeypatch.setattr(runner, "run", run)
    (tmp_path / "tiny-node1").mkdir()
    (tmp_path / "tiny-node1" / "config.yaml").write_text("experiment: {}\n")
    study.run_one(tmp_path, "tiny", 1)
    study.run_one(tmp_path, "tiny", 11)
    assert asked == {"tiny-node1": True, "tiny-node11": False}
