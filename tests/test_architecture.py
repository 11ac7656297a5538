"""The package's layers, read from the source: `sdcstudy.core` imports no feature subpackage,
`sdcstudy.report` none either (features contribute their report sections through the mode
registry), no two modules import each other (directly or through others, imports inside
functions included), no module is over 400 lines and at most 10 modules sit directly in
`sdcstudy/`; docs/architecture.md's layer diagram is that import graph (each arrow an import,
each import between its boxes an arrow) and its folder table names every subpackage and only
modules that exist; every registered mode is a `Mode` class and the runner names none.

Each check is a function of a source tree, so the tests below also plant a cycle, a
core-to-feature and a report-to-feature import in a copy and show that the checks catch them
(a check that cannot fail is no check). docs/architecture.md explains the layers these checks
keep.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sdcstudy"
MAX_LINES = 400
MAX_TOP_LEVEL = 10


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source (functions too).

    `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`.
    A package's `__init__` that an import passes through is not counted: it only names its
    layer (the root's lazy exports aside, which import nothing at import time).
    """
    known = modules(root)
    top = root.name
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in known and (t == top or t.startswith(top + ".")))
        deps.discard(name)
        graph[name] = deps
    return graph


def core_violations(graph: dict[str, set[str]], top: str = "sdcstudy") -> list[str]:
    """`core` module -> the feature (or top-level) module it imports."""
    core = f"{top}.core"
    return sorted(f"{m} imports {d}" for m, deps in graph.items()
                  if m == core or m.startswith(core + ".")
                  for d in deps if not (d == core or d.startswith(core + ".")))


# What `sdcstudy.report` may reach, through its own imports and theirs: core, itself, the mode
# registry (`sdcstudy.modes`'s __init__, which names the report sections as strings and
# imports only core) and the paper's published numbers (a data module that imports nothing).
REPORT_MAY_REACH = ("core", "report")
REPORT_MAY_IMPORT = ("modes", "faults.published")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def report_violations(graph: dict[str, set[str]], top: str = "sdcstudy") -> list[str]:
    """`report` module -> a feature (or top-level) module it reaches through imports."""
    allowed = {f"{top}.{m}" for m in REPORT_MAY_IMPORT}
    inside = lambda m, pkg: m == f"{top}.{pkg}" or m.startswith(f"{top}.{pkg}.")  # noqa: E731
    return sorted(f"{m} reaches {d}" for m in graph if inside(m, "report")
                  for d in reachable(graph, m)
                  if d not in allowed and not any(inside(d, p) for p in REPORT_MAY_REACH))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path `a -> b -> ... -> a`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def long_modules(root: Path = PACKAGE) -> list[str]:
    return [f"{p.relative_to(root.parent)} ({n} lines)" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]


# The step's topologies (issue 54): a trainer gets its features from the registry
# (`sdcstudy/features.py`), its random streams from `core.step.STREAMS`, and runs the core step
# (`core/compose.py`), which names no feature.
TRAINERS = ("core/train.py", "faults/trainer.py", "paired/trainer.py", "finetune/trainer.py",
            "detect/trainer.py", "paft/trainer.py", "golden/workload.py")
# What reads a step's output: the trainers, the host loop and the rollback.
STEP_READERS = TRAINERS + ("runner.py", "detect/rollback.py")
CORE_STEP = ("core/compose.py", "core/train.py")
# The fault engine's own work, which a trainer leaves to the faults feature.
FEATURE_ONLY_CALLS = ("Injector", "FaultContext", "corrupt_tree", "record_rows")
# Calls that run a step (`x.compiled(...)`, a local `step(...)`): a `StepOut`, read by name.
STEP_METHODS = ("train_step", "compiled", "_step", "_local_step")
STEP_FUNCTIONS = ("train_step", "compiled", "step", "rollback")


def _call_name(node) -> str | None:
    return getattr(node.func, "attr", getattr(node.func, "id", None)) \
        if isinstance(node, ast.Call) else None


def step_violations(root: Path = PACKAGE) -> list[str]:
    """A trainer that does the fault engine's work itself (builds an `Injector` or a
    `FaultContext`, calls `corrupt_tree` or `record_rows`), or folds a literal stream number
    into a key (`fold_in(key, 1)`) instead of naming its stream."""
    found = []
    for rel in TRAINERS:
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            name = _call_name(node)
            if name in FEATURE_ONLY_CALLS:
                found.append(f"{rel}:{node.lineno} calls {name}(...)")
            elif name == "fold_in" and len(node.args) == 2 and \
                    isinstance(node.args[1], ast.Constant):
                found.append(f"{rel}:{node.lineno} folds stream {node.args[1].value} into a key")
    return found


def _runs_step(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute):
        return node.func.attr in STEP_METHODS
    return isinstance(node.func, ast.Name) and node.func.id in STEP_FUNCTIONS


def positional_step_reads(root: Path = PACKAGE) -> list[str]:
    """A step's output unpacked (`state, metrics, records = step(...)`) or indexed
    (`step(...)[0]`) by position instead of read by name."""
    found = []
    for rel in STEP_READERS:
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and \
                    _runs_step(node.value):
                found.append(f"{rel}:{node.lineno} unpacks {_call_name(node.value)}(...)")
            elif isinstance(node, ast.Subscript) and _runs_step(node.value) \
                    and isinstance(node.slice, ast.Constant):
                found.append(f"{rel}:{node.lineno} indexes {_call_name(node.value)}(...)")
    return found


def registered_feature_modules(root: Path = PACKAGE) -> set[str]:
    """The modules the registry imports its features from."""
    tree = ast.parse((root / "features.py").read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__"}


def feature_import_violations(root: Path = PACKAGE) -> list[str]:
    """A trainer importing a registered feature's module instead of taking the feature from
    the registry (`sdcstudy.features`)."""
    graph, features = import_graph(root), registered_feature_modules(root)
    return sorted(f"{rel} imports {dep}" for rel in TRAINERS
                  for dep in graph[module_name(root / rel, root)] if dep in features)


def named_features(root: Path = PACKAGE) -> list[str]:
    """A name, attribute or string of the core step that is a registered feature's name."""
    tree = ast.parse((root / "features.py").read_text())
    names = {key.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
             for key in node.keys if isinstance(key, ast.Constant)}
    found = []
    for rel in CORE_STEP:
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            word = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else \
                node.value if isinstance(node, ast.Constant) else None
            if word in names:
                found.append(f"{rel}:{node.lineno} names the feature {word!r}")
    return found


# --- the package as it is ----------------------------------------------------------------------


def test_core_imports_no_feature():
    assert core_violations(import_graph()) == [], \
        "sdcstudy.core must not import a feature subpackage; move the shared piece into core"


def test_report_imports_no_feature():
    assert report_violations(import_graph()) == [], \
        "sdcstudy.report must not import a feature subpackage; contribute a report section " \
        "(report/sections.py) through sdcstudy.modes.REPORT_SECTIONS instead"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_module_over_400_lines():
    assert long_modules() == [], "split these modules by idea"


def test_at_most_ten_modules_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly in sdcstudy/: {top}"


def test_trainers_take_faults_and_streams_from_the_feature():
    assert step_violations() == [], "use the faults feature and core.step.stream_key"


def test_trainers_take_their_features_from_the_registry():
    assert len(registered_feature_modules()) >= 3
    assert feature_import_violations() == [], "use sdcstudy.features (FEATURES, from_config)"


def test_step_outputs_are_read_by_name():
    assert positional_step_reads() == [], "read a StepOut by name (.state, .metrics, .records)"


def test_the_core_step_names_no_feature():
    assert named_features() == [], "core/compose.py calls the step-feature protocol only"


def test_step_records_keep_the_order_features_added_them():
    # A step's outputs flatten in this order; a plain dict would sort them by name, which
    # reorders the outputs of every step with two features (lock-step's taps, faults, abft).
    import jax

    from sdcstudy.core.step import Records

    leaves, tree = jax.tree.flatten(Records(taps=1, faults=2, abft=3))
    assert leaves == [1, 2, 3]
    assert list(jax.tree.unflatten(tree, [4, 5, 6]).items()) == [("taps", 4), ("faults", 5),
                                                                 ("abft", 6)]


def test_the_graph_sees_the_package():
    # Guards the checks above against passing on an empty or misread graph.
    graph = import_graph()
    assert "sdcstudy.core.train" in graph["sdcstudy.runner"]
    assert "sdcstudy.core.config" in graph["sdcstudy.core.train"]
    assert len(graph) > 50
    assert {"sdcstudy.core.runfolder", "sdcstudy.modes"} <= reachable(graph,
                                                                     "sdcstudy.report.writer")


# --- the checks catch what they are for ---------------------------------------------------------


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "sdcstudy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "sdcstudy"


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n\ndef _planted():\n    " + line + "\n")


def test_a_planted_cycle_is_found_with_its_path(copy):
    # core.config is imported by core.mesh; an import back inside a function closes a circle.
    _append(copy / "core" / "config.py", "from . import mesh")
    cycle = find_cycle(import_graph(copy))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"sdcstudy.core.config", "sdcstudy.core.mesh"} <= set(cycle)


def test_a_planted_core_to_feature_import_is_named(copy):
    _append(copy / "core" / "model.py", "from sdcstudy.faults import inject")
    assert core_violations(import_graph(copy)) == \
        ["sdcstudy.core.model imports sdcstudy.faults.inject"]


def test_a_planted_report_to_feature_import_is_named(copy):
    # Directly, inside a function, as the writer once imported the PAFT tables ...
    _append(copy / "report" / "plots.py", "from sdcstudy.paft import report")
    assert "sdcstudy.report.plots reaches sdcstudy.paft.report" in \
        report_violations(import_graph(copy))
    # ... and through the registry, were it to import a mode (and with it a trainer).
    (copy / "report" / "plots.py").write_text((PACKAGE / "report" / "plots.py").read_text())
    _append(copy / "modes" / "__init__.py", "from sdcstudy.modes import paft")
    found = report_violations(import_graph(copy))
    assert "sdcstudy.report.writer reaches sdcstudy.modes.paft" in found
    assert "sdcstudy.report.writer reaches sdcstudy.paft.trainer" in found


def test_a_planted_long_module_is_named(copy):
    (copy / "core" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(copy) == [f"sdcstudy/core/long.py ({MAX_LINES + 1} lines)"]


def test_a_planted_injector_and_stream_number_are_named(copy):
    _append(copy / "paft" / "trainer.py", "jax.random.fold_in(key, 1)")
    _append(copy / "golden" / "workload.py", "F.Injector(profile, 2)")
    _append(copy / "paired" / "trainer.py", "self.injector.corrupt_tree(g, ctx, 'grad')")
    found = step_violations(copy)
    assert len(found) == 3
    assert found[0].startswith("paired/trainer.py:") and found[0].endswith("corrupt_tree(...)")
    assert found[1].startswith("paft/trainer.py:")
    assert found[1].endswith("folds stream 1 into a key")
    assert found[2].startswith("golden/workload.py:") and found[2].endswith("calls Injector(...)")


def test_a_planted_feature_import_positional_read_and_named_feature_are_found(copy):
    _append(copy / "detect" / "trainer.py", "from sdcstudy.abft.checker import Checker")
    assert feature_import_violations(copy) == \
        ["detect/trainer.py imports sdcstudy.abft.checker"]
    _append(copy / "runner.py", "state, metrics, records = compiled(state, batch)")
    _append(copy / "golden" / "workload.py", "return self.compiled(state, batch)[0]")
    found = positional_step_reads(copy)
    assert len(found) == 2 and "unpacks compiled(...)" in found[1] and \
        "indexes compiled(...)" in found[0]
    _append(copy / "core" / "compose.py", "return self.faults")
    (found,) = named_features(copy)
    assert found.startswith("core/compose.py:") and found.endswith("names the feature 'faults'")


def test_the_feature_registry_names_each_feature_by_its_records_key_in_install_order():
    # Faults first (every later hook sees the corrupted value), then taps, then ABFT; a class
    # whose `name` differed from its key would file its records and sinks under another name.
    from sdcstudy.features import FEATURES

    order = list(FEATURES)
    assert order[0] == "faults" and order.index("taps") < order.index("abft") == len(order) - 1
    assert all(cls.name == name and callable(cls.from_config) for name, cls in FEATURES.items())


def test_the_detector_registry_matches_the_names_the_config_accepts():
    # detect/plan.py validates detect.detectors without JAX; every name must have its class.
    from sdcstudy.detect.detectors import DETECTORS
    from sdcstudy.detect.plan import DETECTORS as NAMES

    assert tuple(DETECTORS) == NAMES
    assert all(cls.name == name for name, cls in DETECTORS.items())


def test_the_core_step_runs_features_it_has_never_heard_of_in_install_order():
    # Two toy features through core/compose.py: the first doubles the value at a site, adds 1
    # to the gradient and records the update it corrupts; the second only observes, so it
    # must see the doubled value. A core that skipped a feature, ran them out of order or
    # filed records under the wrong name fails here. (Traces a three-element program.)
    import jax
    import jax.numpy as jnp
    import optax

    from sdcstudy.core import compose
    from sdcstudy.core.sites import compose as chain
    from sdcstudy.core.step import StepFeature, Where

    class Double(StepFeature):
        name = "double"

        def init_sinks(self, axes=()):
            return {}

        def install(self, hooks, ctx, sinks):
            installed.append(self.name)
            return hooks._replace(full=chain(lambda site, x, layer: 2 * x, hooks.full)), {}

        def transform_grads(self, grads, ctx):
            return jax.tree.map(lambda g: g + 1, grads)

        def transform_updates(self, updates, ctx):
            self.update = updates["w"]
            return updates

    class Observe(StepFeature):
        name = "observe"

        def init_sinks(self, axes=()):
            return {}

        def install(self, hooks, ctx, sinks):
            installed.append(self.name)
            seen = {}

            def look(site, x, layer):
                seen["x"] = x
                return x
            return hooks._replace(full=chain(hooks.full, look)), seen

    installed = []
    features = [Double(), Observe()]
    model_loss = lambda params, batch, hook: (jnp.sum(hook("y", params["w"] * batch["x"], 0)),  # noqa: E731
                                              jnp.float32(3))
    where_of = lambda microstep: Where(jax.random.key(0), 1, microstep)  # noqa: E731
    state = {"params": {"w": jnp.ones(3)}, "opt_state": optax.sgd(1.0).init({"w": jnp.ones(3)}),
             "step": jnp.int32(0)}
    batch = {"x": jnp.arange(3.0)[None]}
    loss, grads, new_state, records = compose.feature_step(
        features, optax.sgd(1.0), state, compose.feature_loss(features, model_loss, where_of),
        batch, compose.init_sinks(features), where_of)
    import numpy as np

    expected = np.float32([0, 2, 4]) / np.float32(3) + np.float32(1)  # 2x / count, then + 1
    assert installed == ["double", "observe"] and list(records) == ["double", "observe"]
    assert records["observe"]["fwd"]["x"].tolist() == [[0.0, 2.0, 4.0]]  # after the doubling
    assert float(loss) == 2.0
    np.testing.assert_array_equal(grads["w"], expected)
    np.testing.assert_array_equal(features[0].update, -expected)
    np.testing.assert_array_equal(new_state["params"]["w"], np.float32(1) - expected)


# --- docs/architecture.md's layer diagram is the import graph ------------------------------------

DOC = PACKAGE.parent / "docs" / "architecture.md"
# Diagram nodes that are not one subpackage each: the command line's box holds the modules
# directly in sdcstudy/ (features.py aside), `registry` is modes/__init__.py, `modes` the mode
# classes beside it, `stepfeatures` sdcstudy/features.py.
TOP_LEVEL_NODE, ARROW = "cli", re.compile(r"^\s*(\w+)\s*(-->|-\.->)\s*(?:\|[^|]*\|\s*)?(\w+)\s*$")


def diagram(text: str) -> tuple[dict[str, set[str]], set[tuple[str, str]], set[tuple[str, str]]]:
    """The layer diagram of docs/architecture.md (its first mermaid block): each subgraph and
    the nodes in it, the import arrows (`-->`) and the by-name arrows (`-.->`)."""
    block = text.split("```mermaid", 1)[1].split("```", 1)[0]
    groups: dict[str, set[str]] = {}
    imports, by_name, inside = set(), set(), None
    for line in block.splitlines():
        if match := re.match(r"^\s*subgraph (\w+)", line):
            inside = match.group(1)
            groups[inside] = set()
        elif line.strip() == "end":
            inside = None
        elif match := ARROW.match(line):
            (imports if match.group(2) == "-->" else by_name).add(
                (match.group(1), match.group(3)))
        elif inside and (match := re.match(r"^\s*(\w+)\[", line)):
            groups[inside].add(match.group(1))
    return groups, imports, by_name


def node_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in ("features", "modes")):
        return TOP_LEVEL_NODE  # the package itself and the modules directly in it
    return {"features": "stepfeatures", "modes": "registry" if len(parts) == 2 else "modes"}.get(
        parts[1], parts[1])


def diagram_problems(graph: dict[str, set[str]], text: str) -> list[str]:
    """Arrows of the diagram that are no import, imports between its nodes that no arrow
    shows (a subgraph's arrow stands for an arrow from or to each node in it), and
    subpackages it lacks."""
    groups, imports, by_name = diagram(text)
    expand = lambda node: groups.get(node, {node})  # noqa: E731
    edges = {(node_of(m), node_of(d)) for m, deps in graph.items() for d in deps
             if node_of(m) != node_of(d)}
    shown = {(a, b) for x, y in imports for a in expand(x) for b in expand(y)}
    nodes = set().union(*groups.values(), *imports, *by_name)
    packages = {node_of(m) for m in graph}
    return ([f"the arrow {x} --> {y} is no import" for x, y in sorted(imports)
             if not {(a, b) for a in expand(x) for b in expand(y)} & edges] +
            [f"{a} imports {b}, which no arrow shows" for a, b in sorted(edges - shown)] +
            [f"no node for {p}" for p in sorted(packages - nodes)])


def test_the_layer_diagram_is_the_import_graph():
    """docs/architecture.md: "Every arrow is an import between subpackages": each arrow of the
    diagram is one, every import between two of its boxes has its arrow, every subpackage its
    box; the registry's by-name arrow leads to the mode classes it names."""
    assert diagram_problems(import_graph(), DOC.read_text()) == []
    _, _, by_name = diagram(DOC.read_text())
    assert by_name == {("registry", "modes")}


def test_a_planted_import_or_arrow_the_diagram_lacks_is_named(copy):
    text = DOC.read_text()
    _append(copy / "fleet" / "montecarlo.py", "from sdcstudy.golden import record")
    assert diagram_problems(import_graph(copy), text) == [
        "fleet imports golden, which no arrow shows"]
    planted = text.replace("    cli --> fleet\n", "    cli --> fleet\n    fleet --> golden\n"
                                                  "    fleet --> paft\n", 1)
    assert diagram_problems(import_graph(copy), planted) == [
        "the arrow fleet --> paft is no import"]


def test_each_subpackage_has_its_row_and_each_module_named_there_exists():
    """The folder table of docs/architecture.md: a row per subpackage; every lowercase `name`
    a row gives is a module of its folder (words that name a function say so in
    `NOT_MODULES`); and `core/`'s row names every module of core."""
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `(\w+)/` \| (.*) \|$", text, re.M))
    assert set(rows) == {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    named = {(folder, name) for folder, row in rows.items()
             for name in re.findall(r"`([a-z_0-9]+)`", row)}
    assert sorted(f"{folder}/{name}" for folder, name in named - NOT_MODULES
                  if not (PACKAGE / folder / f"{name}.py").is_file()) == []
    core = {p.stem for p in (PACKAGE / "core").glob("*.py")} - {"__init__"}
    assert sorted(core - {name for folder, name in named if folder == "core"}) == []


NOT_MODULES = {("faults", "fold_in")}  # a row's words in backticks that name no module


def mode_names_in_runner(root: Path = PACKAGE) -> set[str]:
    """The registered modes' names (`REGISTRY`'s keys, read from the source) that the runner
    spells out: a branch on a mode's name."""
    tree = ast.parse((root / "modes" / "__init__.py").read_text())
    names = {key.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(getattr(t, "id", None) == "REGISTRY" for t in node.targets)
             for key in node.value.keys}
    return {node.value for node in ast.walk(ast.parse((root / "runner.py").read_text()))
            if isinstance(node, ast.Constant) and node.value in names}


def test_every_registered_mode_is_a_mode_class_and_the_runner_names_none():
    """"`experiment.mode` names a class in REGISTRY; each subclasses modes.base.Mode", and
    "the runner calls only these; it has no branch on a mode's name"."""
    from sdcstudy import modes
    from sdcstudy.modes.base import Mode

    for name in modes.REGISTRY:
        cls = modes.get(name)
        assert issubclass(cls, Mode) and cls.name == name, name
    assert mode_names_in_runner() == set()


def test_a_planted_branch_on_a_mode_name_in_the_runner_is_found(copy):
    _append(copy / "runner.py", 'if cfg.experiment.mode == "paft": pass')
    assert mode_names_in_runner(copy) == {"paft"}
