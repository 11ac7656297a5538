"""The docs a user reads (README.md, RESULTS.md, docs/**/*.md) keep their links and commands true,
read from the text: every relative Markdown link names a file of the repository and, with
`#anchor`, a heading of it (GitHub's slugs); every `sdcstudy ...` command of a shell block names
subcommands and options the CLI has (its argparse parser, `sdcstudy.cli.build_parser`, built
without JAX), parses as written, `--set`s config keys that exist and, for `reproduce`, asks for
presets, nodes, modes and shards it knows; every `python experiments/NAME.py` and `python -m
sdcstudy.NAME` names a study or module that exists and, where it declares its options itself,
gives only options it has, a value to each that takes one and the required ones. Inline
commands of the prose (`sdcstudy reproduce --nodes 7 ...` in RESULTS.md's table) may be partial
(`sdcstudy report`): their subcommands, options and keys must exist, and a study's options are
checked where the span gives it one.

Each check is a function of a folder; the last tests plant broken links, misspelled options,
subcommands and keys, a missing value and a missing required option in a copy and show the
checks name each. No subprocess, nothing compiled; about a second.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell", "console")
CLI_WORDS = ("sdcstudy", ".venv/bin/sdcstudy")
# Words in front of a command that are not it, with those of their options that take a value.
WRAPPERS = {"nice": ("-n",), "time": (), "/usr/bin/time": ("-f",), "timeout": (), "srun": (),
            "wait": (), "do": (), "then": (), "exec": (), "$": ()}


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "RESULTS.md", *sorted((root / "docs").rglob("*.md"))]


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


# --- links ------------------------------------------------------------------------------------


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is None:
            out.append((number, re.sub(r"(`+)(?:(?!\1).)+?\1", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (links' text, no code marks, emphasis
    stars), lowercase, every character but letters, digits, `_`, `-` and spaces dropped, each
    space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit `<a id=...>` / `<a name=...>` targets."""
    found, seen = set(), {}
    text = path.read_text()
    fence = None
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is not None:
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def broken_links(root: Path = ROOT) -> list[str]:
    """`file:line: target (why)` for each relative link whose file or anchor does not exist."""
    broken, cache = [], {}
    for doc in doc_files(root):
        for number, line in prose_lines(doc.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                where, _, anchor = target.partition("#")
                path = (doc.parent / where).resolve() if where else doc
                place = f"{_rel(doc, root)}:{number}: {target}"
                if not path.exists():
                    broken.append(f"{place} (no such file)")
                elif anchor and path.suffix == ".md":
                    if path not in cache:
                        cache[path] = anchors(path)
                    if anchor not in cache[path]:
                        broken.append(f"{place} (no heading with that anchor)")
    return broken


# --- commands ---------------------------------------------------------------------------------


def shell_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of the doc's shell blocks: every line of a ```bash (sh,
    shell, console) block, or only its `$ ` lines where it shows a session with output; the `$ `
    lines of an unlabeled block. Continued lines (a trailing backslash) are joined."""
    blocks, fence, block = [], None, None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence, block = stripped[3:].strip().lower(), []
            else:
                blocks.append((fence, block))
                fence = None
            continue
        if fence is not None:
            block.append((number, line))
    out = []
    for language, lines in blocks:
        if language not in SHELL_FENCES + ("",):
            continue
        prompted = any(line.lstrip().startswith("$ ") for _, line in lines)
        if language == "" and not prompted:
            continue
        pending, start = "", 0
        for number, line in lines:
            stripped = line.strip()
            if prompted and not pending:
                if not stripped.startswith("$ "):
                    continue
                stripped = stripped[2:]
            start = start if pending else number
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            command, pending = (pending + stripped).strip(), ""
            if command and not command.startswith("#"):
                out.append((start, command))
    return out


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of a shell line (split at ;, &&, ||, |, &), with
    environment assignments and wrappers (nice -n 5, time, srun --nodes=2, ...) dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    words = list(lexer)
    commands, current = [], []
    for word in words:
        if word and set(word) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    out = []
    for command in commands:
        while command:
            first = command[0]
            if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", first):
                command = command[1:]
            elif first in WRAPPERS:
                command = command[1:]
                while command and command[0].startswith("-"):  # the wrapper's own options
                    takes_value = command[0] in WRAPPERS[first]
                    command = command[2:] if takes_value else command[1:]
                if first == "timeout" and command and re.match(r"\d", command[0]):
                    command = command[1:]
            else:
                break
        if command:
            out.append(command)
    return out


def cli_argv(words: list[str]) -> list[str] | None:
    """The CLI's arguments when the command runs sdcstudy (`sdcstudy`, `.venv/bin/sdcstudy`,
    `python -m sdcstudy`), else None."""
    if words[0] in CLI_WORDS:
        return words[1:]
    if re.match(r"(.*/)?python3?$", words[0]) and words[1:3] == ["-m", "sdcstudy"]:
        return words[3:]
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def argv_problems(parser: argparse.ArgumentParser, argv: list[str], config_keys: set[str],
                  fleet_keys: set[str], parse: bool = True) -> list[str]:
    """What is wrong with `sdcstudy ARGV`: a subcommand or option the parser lacks (spelled in
    full: argparse would take an abbreviation, a reader should not), a `--set` key that is not
    a config key, or, with `parse`, the parser's own error (a value it refuses, a required
    argument)."""
    problems, names, chosen = [], [], parser
    rest = list(argv)
    while _subparsers(chosen):
        words = [w for w in rest if not w.startswith("-")]
        if not words:
            break
        word = words[0]
        if word not in _subparsers(chosen):
            return [f"no subcommand {' '.join(names + [word])!r}"]
        names.append(word)
        rest = rest[rest.index(word) + 1:]
        chosen = _subparsers(chosen)[word]
    synopsis = False
    for word in rest:
        if word.startswith("[") or "|" in word or word == "...":
            synopsis = True  # a usage line: [--set KEY=VALUE ...] [--device h100|h200]
        option = word.strip("[]").split("=", 1)[0]
        if re.match(r"--?[A-Za-z]", option) and option not in _options(chosen):
            problems.append(f"{' '.join(['sdcstudy'] + names)} has no option {option}")
    keys = fleet_keys if names[:1] == ["fleet"] else config_keys
    for i, word in enumerate(rest[:-1]):
        if word == "--set":
            key = rest[i + 1].split("=", 1)[0]
            if "." in key and key not in keys:  # key=value, KEY=VALUE: a usage line's
                problems.append(f"no config key {key!r} (--set {rest[i + 1]})")
    if parse and not problems and not synopsis:
        message = io.StringIO()
        with contextlib.redirect_stderr(message), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = parser.parse_args(argv)
            except SystemExit as stop:
                if stop.code:
                    problems.append(message.getvalue().strip().split("\n")[-1])
                return problems
        if names == ["reproduce"]:
            problems += reproduce_problems(args)
    return problems


def reproduce_problems(args: argparse.Namespace) -> list[str]:
    """The sentence `sdcstudy reproduce` refuses its request with before it runs anything (a
    preset, node, mode, fault model or shard it does not know; --merge with a run's options)."""
    from sdcstudy.core.config import UserError
    from sdcstudy.reproduce import cli as R
    from sdcstudy.reproduce import plan as P

    def given(value, default):
        return default if value is None else value

    try:
        if args.merge:
            extra = [a for a in R.RUN_ARGUMENTS if getattr(args, a) is not None]
            return [f"--merge with --{extra[0].replace('_', '-')}"] if extra else []
        P.request(given(args.preset, R.DEFAULT_PRESET), args.steps,
                  P.parse_nodes(given(args.nodes, R.DEFAULT_NODES)), args.dtype, args.overrides,
                  P.parse_modes(given(args.modes, R.DEFAULT_MODES)),
                  given(args.fault_model, P.DEFAULT_FAULT_MODEL))
        if args.shard is not None and "$" not in args.shard:  # $i: a shell loop's shard
            P.parse_shard(args.shard)
    except UserError as error:
        return [str(error)]
    return []


NO_VALUE = ("store_true", "store_false", "store_const", "count", "help", "version")


def declared_options(path: Path) -> dict[str, dict] | None:
    """The options a study or module declares with `add_argument("--x", ...)`, each with
    whether it takes a value and is required; None where it declares none (it takes a shared
    parser's, e.g. `paft.study.parse`)."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str) and a.value.startswith("-")]
        keywords = {k.arg: k.value.value for k in node.keywords
                    if isinstance(k.value, ast.Constant)}
        takes = keywords.get("action") not in NO_VALUE and keywords.get("nargs") not in ("?", "*")
        for name in names:
            found[name] = {"value": takes, "required": keywords.get("required") is True}
    return found or None


def python_problems(words: list[str], root: Path) -> list[str]:
    """A `python experiments/NAME.py ...` or `python -m sdcstudy.NAME ...` whose file does not
    exist; where it declares its options itself: an option it lacks, one given no value that
    takes one, a required one left out."""
    if not re.match(r"(.*/)?python3?$", words[0]) or len(words) < 2:
        return []
    if words[1] == "-m" and len(words) > 2 and words[2].startswith("sdcstudy."):
        module = root / Path(*words[2].split("."))
        path = module.with_suffix(".py") if module.with_suffix(".py").is_file() else \
            module / "__main__.py"
        name, args = words[2], words[3:]
    elif words[1].startswith("experiments/"):
        path, name, args = root / words[1], words[1], words[2:]
    else:
        return []
    if not path.is_file():
        return [f"no {'module' if name.startswith('sdcstudy.') else 'study'} {name}"]
    options = declared_options(path)
    if options is None:
        return []
    args = [a.strip("[]") for a in args]
    problems = []
    for i, word in enumerate(args):
        option = word.split("=", 1)[0]
        if not re.match(r"--?[A-Za-z]", option):
            continue
        if option not in options:
            problems.append(f"{name} has no option {option}")
        elif options[option]["value"] and "=" not in word and \
                (i + 1 == len(args) or args[i + 1].startswith("--")):
            problems.append(f"{name}: {option} takes a value")
    given = {a.split("=", 1)[0] for a in args}
    problems += [f"{name}: {o} is required" for o, d in options.items()
                 if d["required"] and o not in given]
    return problems


INLINE = re.compile(r"`((?:\.venv/bin/)?(?:sdcstudy|python3?) [^`]+)`")


def inline_problems(root: Path = ROOT) -> list[str]:
    """`file:line: command: problem` for the prose's inline `sdcstudy ...` and `python ...`
    commands, which may be partial (`sdcstudy report`, a study's name in a sentence): of
    sdcstudy, the subcommands and options they name; of a study or module, its file, and, where
    the span gives it an option (a command, not a name), what `python_problems` checks."""
    from sdcstudy.cli import build_parser

    from sdcstudy.core import config as C
    from sdcstudy.fleet import config as FC

    parser, config_keys, fleet_keys = build_parser(), set(C.all_keys()), set(FC.KEYS)
    found = []
    for doc in doc_files(root):
        fence = None
        for number, line in enumerate(doc.read_text().split("\n"), 1):
            if line.strip().startswith("```"):
                fence = None if fence else "open"
                continue
            if fence:
                continue
            for span in INLINE.findall(line):
                try:
                    words = shlex.split(span)
                except ValueError:
                    continue
                argv = cli_argv(words)
                if argv is not None:  # placeholders (COMMAND) and usage marks are no names
                    argv = [w for w in argv if not re.fullmatch(r"[A-Z_]+|\.\.\.", w)]
                    problems = argv_problems(parser, argv, config_keys, fleet_keys, parse=False)
                elif any(w.startswith("-") for w in words[2:] if w != "-m") or \
                        not (root / words[1]).exists() and words[1].startswith("experiments/"):
                    problems = python_problems(words, root)
                else:
                    problems = python_problems(words[:2], root)[:1] if words[1:2] == ["-m"] \
                        else []
                found += [f"{_rel(doc, root)}:{number}: {span}: {p}" for p in problems]
    return found


def command_problems(root: Path = ROOT) -> list[str]:
    """`file:line: command: problem` for every shell-block command of the docs that does not
    parse as written."""
    from sdcstudy.cli import build_parser
    from sdcstudy.core import config as C
    from sdcstudy.fleet import config as FC

    parser, config_keys, fleet_keys = build_parser(), set(C.all_keys()), set(FC.KEYS)
    found = []
    for doc in doc_files(root):
        for number, line in shell_commands(doc.read_text()):
            try:  # a usage line ([--device h100|h200]) is one command, its | no pipe
                commands = [shlex.split(line, comments=True)] if "[-" in line else \
                    simple_commands(line)
            except ValueError as error:  # an unclosed quote
                found.append(f"{_rel(doc, root)}:{number}: {line}: {error}")
                continue
            for words in commands:
                argv = cli_argv(words)
                problems = (python_problems(words, root) if argv is None else
                            argv_problems(parser, argv, config_keys, fleet_keys))
                found += [f"{_rel(doc, root)}:{number}: {' '.join(words)}: {p}"
                          for p in problems]
    return found


# --- the repository's docs --------------------------------------------------------------------


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    assert broken_links() == []


def test_every_command_of_the_docs_shell_blocks_parses_as_written():
    assert command_problems() == []


def test_every_inline_command_of_the_docs_names_what_exists():
    assert inline_problems() == []


def test_the_checks_read_commands_and_links_from_the_docs():
    # A check that reads nothing passes everything: the docs hold many of both.
    commands = [c for doc in doc_files() for _, c in shell_commands(doc.read_text())]
    links = [t for doc in doc_files() for _, line in prose_lines(doc.read_text())
             for t in LINK.findall(line)]
    assert sum("sdcstudy reproduce" in c for c in commands) > 20
    assert sum("#" in t for t in links) > 20


# --- the checks on planted mistakes -----------------------------------------------------------


def test_slugs_follow_githubs_rules():
    assert slug("On one GPU (2026-11-25)") == "on-one-gpu-2026-11-25"
    assert slug("`sdcstudy bench paft`: PAFT-Dyn / data parallel") == \
        "sdcstudy-bench-paft-paft-dyn--data-parallel"
    assert slug("Table 2, [node 10](x.md) **first**") == "table-2-node-10-first"
    assert slug("suspect.fault_seed & co.") == "suspectfault_seed--co"


@pytest.fixture
def copy(tmp_path):
    for name in ("README.md", "RESULTS.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for path in ROOT.iterdir():  # what the docs link to and name, read only
        if not (tmp_path / path.name).exists() and not path.name.startswith("."):
            (tmp_path / path.name).symlink_to(path)
    return tmp_path


def test_a_planted_broken_link_and_anchor_are_named(copy):
    doc = copy / "docs" / "results" / "abft.md"
    doc.write_text(doc.read_text() + "\nSee [gone](../no-such.md), [bad](../golden.md#no-such-"
                   "heading) and [fine](../golden.md).\n")
    found = broken_links(copy)
    assert any(f.startswith("docs/results/abft.md:") and "../no-such.md (no such file)" in f
               for f in found), found
    assert any("../golden.md#no-such-heading (no heading with that anchor)" in f
               for f in found), found
    assert len(found) == 2, found


def test_planted_misspelled_options_subcommands_keys_and_studies_are_named(copy):
    doc = copy / "docs" / "reproduction.md"
    doc.write_text(doc.read_text() + "\n```bash\n"
                   "sdcstudy reproduce --preset tiny --node 1 --out runs/x   # --nodes\n"
                   "nice -n 5 sdcstudy bench paft --worker 4 \\\n    --presets tiny\n"
                   "sdcstudy golden chek goldens/x\n"
                   "sdcstudy run configs/tiny.yaml --set experiment.step=2\n"
                   "sdcstudy reproduce --preset huge --out runs/x\n"
                   "for i in 0 1; do sdcstudy reproduce --nodes 1,99 --shard $i/2 & done; wait\n"
                   "sdcstudy bench faults --repeats many\n"
                   "python experiments/loss_spike.py --out DIR --stepz 3\n"
                   "python experiments/no_such_study.py --out DIR\n"
                   "```\n")
    found = command_problems(copy)
    expected = ["sdcstudy reproduce has no option --node", "sdcstudy bench paft has no option "
                "--worker", "no subcommand 'golden chek'", "no config key 'experiment.step'",
                "--preset 'huge' is not one of", "--nodes '1,99' names '99'",
                "invalid int value: 'many'", "experiments/loss_spike.py has no option --stepz",
                "no study experiments/no_such_study.py"]
    for sentence in expected:
        assert any(f.startswith("docs/reproduction.md:") and sentence in f for f in found), \
            (sentence, found)
    assert len(found) == len(expected), found


def test_planted_inline_mistakes_are_named_and_mentions_are_not(copy):
    doc = copy / "RESULTS.md"
    doc.write_text(doc.read_text() + "\nRun `python -m sdcstudy.dev.mode_bits --compare`, "
                   "`sdcstudy reproduce --node 1 --out DIR`, `python experiments/gone.py`, "
                   "`python experiments/wcnts_scaling.py --presets tiny` and "
                   "`sdcstudy run configs/tiny.yaml --set experiment.step=2`; mentions: "
                   "`sdcstudy report`, `sdcstudy golden`, `python experiments/loss_spike.py`.\n")
    found = inline_problems(copy)
    expected = ["sdcstudy.dev.mode_bits: --compare takes a value",
                "sdcstudy reproduce has no option --node", "no study experiments/gone.py",
                "experiments/wcnts_scaling.py: --out is required",
                "no config key 'experiment.step'"]
    for sentence in expected:
        assert any(f.startswith("RESULTS.md:") and sentence in f for f in found), \
            (sentence, found)
    assert len(found) == len(expected), found
