"""zrw's imports run one way: each module imports only modules of a lower level, and
no zrw module is imported inside a function or class body.

LEVELS is the module map (docs/design.md §1). A module missing from it fails the test: place
it when you add it. Read from the sources with `ast`, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "zrw"

# Lower imports from higher, never the other way. The package root `zrw` is the public API:
# the applications (demo, bench, testing) above it drive it; nothing below may import it.
LEVELS: Dict[str, int] = {
    "zrw._C": 0,
    "zrw.ops": 1,
    "zrw._fake": 2,
    "zrw._autograd": 2,
    "zrw.reference": 2,
    "zrw._released_queries": 2,
    "zrw.memory": 2,
    "zrw.backends": 2,
    "zrw.write_check": 2,
    "zrw.config": 3,
    "zrw.planes": 3,
    "zrw._dtensor": 3,
    "zrw.record": 3,
    "zrw.verify": 3,
    "zrw.lifecycle": 4,
    "zrw.frozen": 5,
    "zrw.cache": 6,
    "zrw.weights": 7,
    "zrw.state_dict": 7,
    "zrw.boundary": 7,
    "zrw.nn.functional": 8,
    "zrw.master_groups": 8,
    "zrw.master_weights": 9,
    "zrw.optim": 10,
    "zrw.fsdp": 8,
    "zrw.nn.linear": 10,
    "zrw.nn.grouped": 11,
    "zrw.nn.convert": 12,
    "zrw.nn": 13,
    "zrw._safetensors": 12,
    "zrw.mx_export": 13,
    "zrw.parallel": 14,
    "zrw.checkpoint": 14,
    "zrw.telemetry": 14,
    "zrw.rfc": 14,
    "zrw": 15,
    "zrw.demo": 16,
    "zrw.testing": 16,
    "zrw.bench._timing": 17,
    "zrw.bench": 18,
    "zrw.bench.cache": 18,
    "zrw.bench.fsdp": 18,
    "zrw.bench.hf": 18,
    "zrw.bench.accuracy": 18,
    "zrw.bench.linear": 18,
    "zrw.bench.quant": 18,
    "zrw.bench.report": 18,
    "zrw.bench.seed_2d": 18,
    "zrw.bench.step": 18,
    "zrw.bench.seed": 19,
    "zrw.bench.__main__": 20,
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_package: bool, node: ast.AST) -> List[str]:
    """The zrw modules an import statement of module `mod` names (the most specific that
    exist in LEVELS: `from zrw import ops` is zrw.ops, `from zrw import MXWeight` is zrw)."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "zrw" or alias.name.startswith("zrw."):
                out.append(alias.name)
        return out
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if is_package else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
        if not (target == "zrw" or target.startswith("zrw.")):
            return out
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in LEVELS else target)
    return out


def _enclosing_scope(tree: ast.AST) -> Dict[ast.AST, Optional[ast.AST]]:
    """Each import node -> the function or class it sits in (None at module level)."""
    scope: Dict[ast.AST, Optional[ast.AST]] = {}

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                scope[child] = owner
            inner = (
                child
                if isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
                )
                else owner
            )
            visit(child, inner)

    visit(tree, None)
    return scope


def violations(mod: str, source: str, is_package: bool) -> List[str]:
    """Every upward, same-level or function-local zrw import of module `mod` in `source`."""
    if mod not in LEVELS:
        return [f"{mod}: not in the module map (tests/docs/test_layering.py LEVELS): place it"]
    level = LEVELS[mod]
    found = []
    tree = ast.parse(source)
    for node, owner in _enclosing_scope(tree).items():
        for target in _resolve(mod, is_package, node):
            where = f"{mod}:{node.lineno}"
            if owner is not None:
                found.append(
                    f"{where}: imports {target} inside "
                    f"{getattr(owner, 'name', 'a lambda')}() (import it at the top)"
                )
                continue
            if target not in LEVELS:
                found.append(f"{where}: imports {target}, which is not in the module map")
            elif LEVELS[target] >= level:
                found.append(
                    f"{where}: imports {target} (level {LEVELS[target]}) from level "
                    f"{level}: imports must go to lower levels only"
                )
    return found


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path, PACKAGE), path


def test_every_import_goes_down():
    found = []
    for mod, path in _sources():
        found += violations(mod, path.read_text(), path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_every_module_is_on_the_map():
    on_disk = {mod for mod, _ in _sources()}
    compiled = {"zrw._C"}
    assert not (set(LEVELS) - on_disk - compiled), set(LEVELS) - on_disk - compiled


@pytest.mark.parametrize(
    "source, why",
    [
        ("from .nn import linear\n", "upward"),
        ("from . import weights\n", "upward"),
        ("from .state_dict import materialize\n", "same level"),
        ("def f():\n    from . import ops\n", "function-local"),
        ("import zrw\n", "the package root from below it"),
    ],
)
def test_the_check_fails_on_a_bad_import(source, why):
    """The check itself: an upward, same-level or function-local import added to zrw.weights
    is reported, naming the module and the line."""
    found = violations("zrw.weights", source, False)
    assert found and all(f.startswith("zrw.weights:") for f in found), (why, found)


def _error_labels(tree: ast.AST):
    """(line, module part, function) of every string that starts with an error label
    `zrw.<module>.<function>` (alone or followed by ': ')."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.match(r"(zrw(?:\.[A-Za-z_]+)*)\.([A-Za-z_]+)(?:: |$)", node.value)
            if m:
                yield node.lineno, m.group(1), m.group(2)


def test_error_labels_name_the_module_that_defines_the_function():
    """An error label is the module that defines the function (grep the message, find the
    def): a label `zrw.a.b.f` written in a module that defines `f` must be that module's own
    name. Names exported from the package root (`zrw.convert`) are their own home, and so is
    a public module that re-exports the function from where it is defined (`zrw.optim.attach`,
    defined in zrw.boundary)."""
    root_names = set()
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom):
            root_names |= {a.asname or a.name for a in node.names}
    reexports = {}  # (public module, name) -> the module it is imported from
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path, PACKAGE)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                for target in _resolve(mod, path.name == "__init__.py", node):
                    for a in node.names:
                        reexports[(mod, a.asname or a.name)] = target
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path, PACKAGE)
        tree = ast.parse(path.read_text())
        defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for line, label_mod, fn in _error_labels(tree):
            if fn not in defs or label_mod == mod:
                continue
            if label_mod == "zrw" and fn in root_names:
                continue
            if reexports.get((label_mod, fn)) == mod:
                continue
            wrong.append(
                f"{path.relative_to(PACKAGE.parent)}:{line}: {label_mod}.{fn} (defined in {mod})"
            )
    assert not wrong, "error labels naming another module:\n" + "\n".join(wrong)


# ---- the lifecycle is the only writer of weight state ------------------------------------------

RECORD_WRITERS = {"zrw.record", "zrw.lifecycle"}
_RECORD_SOURCES = {"record_of", "find_record", "records", "WeightRecord"}
_MUTATORS = {"add", "discard", "append", "extend", "clear", "pop", "remove", "update", "insert"}


def _record_fields() -> set:
    """The fields of zrw.record.WeightRecord, read from its class body."""
    tree = ast.parse((PACKAGE / "record.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "WeightRecord":
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise AssertionError("zrw.record.WeightRecord not found")


def _is_record_expr(node: ast.AST, names: set) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Call):
        f = node.func
        called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return called in _RECORD_SOURCES
    return False


def record_writes(mod: str, source: str) -> List[str]:
    """Every write to a weight record's field in `source` (module `mod`): an assignment to
    `<record>.<field>`, a mutating call on one (`rec.owners.add(...)`), or `rec.set_master(...)`,
    where <record> is a call of record_of / find_record or a name bound to one."""
    fields = _record_fields()
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):  # names bound to a record anywhere in the module
        if isinstance(node, ast.Assign) and _is_record_expr(node.value, set()):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.For) and _is_record_expr(node.iter, set()):
            names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr in fields
                    and _is_record_expr(sub.value, names)
                ):
                    found.append(f"{mod}:{node.lineno}: assigns record field {sub.attr!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "set_master" and _is_record_expr(f.value, names):
                found.append(f"{mod}:{node.lineno}: calls set_master on a record")
            elif (
                f.attr in _MUTATORS
                and isinstance(f.value, ast.Attribute)
                and f.value.attr in fields
                and _is_record_expr(f.value.value, names)
            ):
                found.append(f"{mod}:{node.lineno}: mutates record field {f.value.attr!r}")
    return found


def test_only_the_lifecycle_writes_weight_records():
    """docs/design.md §5: zrw.lifecycle's events are the only writers of a weight's record
    (and of its native state); every other module reads records and calls the events."""
    found = []
    for mod, path in _sources():
        if mod not in RECORD_WRITERS:
            found += record_writes(mod, path.read_text())
    assert not found, "record fields written outside zrw.lifecycle:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "def f(w):\n    record_of(w).hold = True\n",
        "def f(w):\n    rec = find_record(w)\n    rec.tied = None\n",
        "def f(w, o):\n    record_of(w).owners.add(o)\n",
        "def f(w, m):\n    rec = record_of(w)\n    rec.set_master(None, m)\n",
        "def f():\n    for w, rec in records():\n        rec.digest = None\n",
    ],
)
def test_the_record_check_fails_on_a_planted_write(source):
    """The check itself: a record-field write planted in zrw.weights is reported."""
    found = record_writes("zrw.weights", source)
    assert found and all(f.startswith("zrw.weights:") for f in found), found


def test_the_record_check_leaves_reads_and_other_objects_alone():
    source = (
        "def f(w, p, g):\n"
        "    rec = find_record(w)\n"
        "    x = rec.tied\n"
        "    p.main_grad = g\n"
        "    self.masters = []\n"
    )
    assert record_writes("zrw.weights", source) == []


_NATIVE_WRITES = re.compile(
    r"torch\.ops\.zrw\.(quant_and_release|restore|restore_weights|restore_all|assign_weights"
    r"|cache_invalidate|cache_clear|next_step)\b"
)


def test_only_the_lifecycle_changes_native_state():
    """The native ops that change a weight's state are called from zrw.lifecycle only."""
    found = [
        f"{mod}: {m.group(0)}"
        for mod, path in _sources()
        if mod not in RECORD_WRITERS and not mod.startswith("zrw.bench")  # (benches time the ops)
        for m in _NATIVE_WRITES.finditer(path.read_text())
    ]
    assert not found, "native state changed outside zrw.lifecycle:\n" + "\n".join(found)
