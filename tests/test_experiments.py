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
