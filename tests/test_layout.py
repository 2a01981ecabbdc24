"""The layout of src/zero_offload holds its shape: no import cycle, each module package imports only what lies
below it, the engine composes modules 1-5, `cli/` uses everything and nothing uses it, no loose modules sit
beside the shared leaves, and no class stands on a chain of more than two of the project's classes (what a
later module adds to an earlier one is a part it is given, not another layer to read through).

The source is read with `ast`; nothing is imported. Every import counts: at module level, inside a function and
under `if TYPE_CHECKING`. A function-local import hides a circle from Python, not from the reader of the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "zero_offload"

# The top-level modules everything may use; the rest of the code lives in packages.
SHARED_LEAVES = {"__init__.py", "units.py", "workloads.py", "plots.py"}

# Who may import whom: a package imports only packages of a lower rank (or its own modules). The inputs and the
# device are at the bottom and may use each other; the root package is the engine's front door (`zo.initialize`).
FOUNDATION = {"units", "workloads", "plots", "config", "accelerator"}
RANK = {
    **dict.fromkeys(FOUNDATION, 0),
    "basics": 1,
    "principles": 2,
    "implementation": 3,
    "tuning": 4,
    "practice": 5,
    "engine": 6,
    "zero_offload": 6,
    "cli": 7,
    "deepspeed": 7,  # DeepSpeed's entry points over the engine, for scripts written for it
    "lessons": 8,  # the notebooks' helpers: they run the commands and the experiments
}
# Imports across the ranks that are meant: (importer, imported) -> why.
ALLOWED = {
    ("zero_offload", "engine"): "the root package hands on Engine and initialize",
    ("plots", "basics"): "plot_model_states draws basics.memory's model-state bytes per tier",
}


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own name, not `__init__`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_edges(root: Path) -> dict[str, dict[str, int]]:
    """For each module, the modules of the package it imports, each with the line of its first import."""
    files = module_files(root)
    edges: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in files and "." in target:
                    target = target.rpartition(".")[0]
                if target in files and target != name:
                    found.setdefault(target, node.lineno)
        edges[name] = found
    return edges


def import_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def _package(module: str) -> str:
    """The top-level package (or shared leaf) a module belongs to: zero_offload.tuning.cpu_adam -> tuning."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def rule_breaks(root: Path, edges: dict[str, dict[str, int]]) -> list[str]:
    """Each import that climbs the ranks: 'file:line: importer imports imported (package -> package)'."""
    files = module_files(root)
    breaks = []
    for importer, targets in sorted(edges.items()):
        mine = _package(importer)
        for target, line in sorted(targets.items()):
            theirs = _package(target)
            if mine == theirs or (mine, theirs) in ALLOWED:
                continue
            below = RANK[theirs] < RANK[mine] or (mine in FOUNDATION and theirs in FOUNDATION)
            if not below:
                where = files[importer].relative_to(root.parent)
                breaks.append(f"{where}:{line}: {importer} imports {target} ({mine} -> {theirs})")
    return breaks


def test_every_package_has_a_rank():
    tops = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    tops = {"zero_offload" if t == "__init__" else t for t in tops}
    assert tops <= set(RANK), f"give {sorted(tops - set(RANK))} a rank in tests/test_layout.py"


def test_no_import_cycle():
    edges = import_edges(SRC)
    cycles = import_cycles(edges)
    described = [
        " <-> ".join(cycle)
        + "\n    "
        + "\n    ".join(f"{a} imports {b}" for a in cycle for b in edges[a] if b in cycle)
        for cycle in cycles
    ]
    assert not cycles, "import cycles (move the shared names to the module below both):\n" + "\n".join(
        described
    )


def test_each_package_imports_only_what_lies_below_it():
    breaks = rule_breaks(SRC, import_edges(SRC))
    assert not breaks, (
        "modules 1-5 import only lower-numbered modules and the inputs (config, accelerator, the shared "
        "leaves); engine/ imports modules 1-5; only cli/ and lessons/ import the engine or cli/:\n"
        + "\n".join(breaks)
    )


def loose_modules(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.py") if p.name not in SHARED_LEAVES)


def test_no_loose_modules_beside_the_shared_leaves():
    loose = loose_modules(SRC)
    assert not loose, f"top-level modules beyond the shared leaves {sorted(SHARED_LEAVES)}: {loose}"


def test_every_package_has_an_init():
    missing = sorted(
        str(d.relative_to(SRC))
        for d in SRC.rglob("*")
        if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    )
    assert not missing, f"folders of modules without an __init__.py: {missing}"


# The most project classes one class may stand on: NVMeStates(OffloadedStates(ShardedStates)) is two.
MAX_CLASS_DEPTH = 2


def _relative_base(package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def class_bases(root: Path) -> dict[str, list[str]]:
    """Every class of the package, as 'module.Class', with the project classes it derives from directly.

    A base is found through the names its module defines or imports (`from .zero import ShardedStates`, a
    re-export through a package's __init__ followed to where the class is defined, `module.Class` of an
    imported module); a base from outside the project (torch, the standard library) is left out."""
    files = module_files(root)
    classes: dict[str, dict[str, ast.ClassDef]] = {}
    names: dict[str, dict[str, str]] = {}  # module -> local name -> the dotted thing it is bound to
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        classes[module] = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        bound = names.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _relative_base(package, node)
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else ""

    def resolve(dotted: str, hops: int = 0) -> str | None:
        """'module.Class' where the class `dotted` names is defined, or None if it is not the project's."""
        module, _, name = dotted.rpartition(".")
        if module not in files or hops > 10:
            return None
        if name in classes[module]:
            return dotted
        target = names[module].get(name)
        return resolve(target, hops + 1) if target else None

    out = {}
    for module in files:
        for name, node in classes[module].items():
            found = []
            for base in node.bases:
                dotted = None
                if isinstance(base, ast.Name):
                    dotted = (
                        f"{module}.{base.id}" if base.id in classes[module] else names[module].get(base.id)
                    )
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                    owner = names[module].get(base.value.id)
                    dotted = f"{owner}.{base.attr}" if owner else None
                where = resolve(dotted) if dotted else None
                if where is not None:
                    found.append(where)
            out[f"{module}.{name}"] = found
    return out


def longest_chains(bases: dict[str, list[str]]) -> dict[str, list[str]]:
    """For each class, its longest chain of project base classes, nearest first."""
    chains: dict[str, list[str]] = {}

    def chain(cls: str) -> list[str]:
        if cls not in chains:
            chains[cls] = []  # a cycle cannot be written in Python; this only stops a bad resolution looping
            longest = max(([b, *chain(b)] for b in bases.get(cls, [])), key=len, default=[])
            chains[cls] = longest
        return chains[cls]

    return {cls: chain(cls) for cls in bases}


def test_no_class_stands_on_more_than_two_of_the_projects_classes():
    chains = longest_chains(class_bases(SRC))
    assert chains["zero_offload.practice.nvme.NVMeStates"] == [
        "zero_offload.implementation.offload.OffloadedStates",
        "zero_offload.principles.zero.ShardedStates",
    ]
    deep = sorted(" <- ".join([cls, *chain]) for cls, chain in chains.items() if len(chain) > MAX_CLASS_DEPTH)
    assert not deep, (
        f"classes on more than {MAX_CLASS_DEPTH} project base classes (give the class what varies as a part, "
        "a constructor argument, instead of another subclass):\n" + "\n".join(deep)
    )


def test_the_class_depth_check_follows_imports_and_re_exports(tmp_path):
    root = tmp_path / "zero_offload"
    _write(root / "__init__.py", "")
    _write(root / "base" / "__init__.py", "from .one import One\n")
    _write(root / "base" / "one.py", "class One:\n    pass\n")
    _write(root / "mid.py", "from .base import One\n\nclass Two(One):\n    pass\n")
    _write(
        root / "top.py",
        "import torch\nfrom . import mid\n\nclass Three(mid.Two, torch.nn.Module):\n    pass\n",
    )
    chains = longest_chains(class_bases(root))
    assert chains["zero_offload.top.Three"] == ["zero_offload.mid.Two", "zero_offload.base.one.One"]
    assert chains["zero_offload.base.one.One"] == []


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_checks_see_a_circle_a_climb_and_a_loose_module(tmp_path):
    """A planted cycle (through a function-local and a TYPE_CHECKING import) and a module importing the engine."""
    root = tmp_path / "zero_offload"
    _write(root / "__init__.py", "from .engine import initialize\n")
    _write(root / "engine" / "__init__.py", "from .core import initialize\n")
    _write(root / "engine" / "core.py", "from ..practice import pipeline\n\ndef initialize():\n    pass\n")
    _write(root / "practice" / "__init__.py", "")
    _write(root / "practice" / "pipeline.py", "def run():\n    from .. import initialize\n")
    _write(root / "tuning" / "__init__.py", "")
    _write(
        root / "tuning" / "a.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
    )
    _write(root / "tuning" / "b.py", "from . import a\nB = 1\n")
    _write(root / "bench.py", "")
    edges = import_edges(root)
    assert import_cycles(edges) == [
        ["zero_offload", "zero_offload.engine", "zero_offload.engine.core", "zero_offload.practice.pipeline"],
        ["zero_offload.tuning.a", "zero_offload.tuning.b"],
    ]
    assert rule_breaks(root, edges) == [
        "zero_offload/practice/pipeline.py:2: zero_offload.practice.pipeline imports zero_offload "
        "(practice -> zero_offload)"
    ]
    assert loose_modules(root) == ["bench.py"]


# ------------------------------------------------------------------------------------------ the tests' layout
TESTS = Path(__file__).resolve().parent
TEST_AREAS = ("engine", "modules", "cli", "course", "support")
TESTS_ROOT_FILES = {"__init__.py", "conftest.py", "test_layout.py"}  # the settings, and the shape of it all


def test_no_test_file_sits_loose_in_the_tests_root():
    """Each test lives in its area: engine/ (the engine as a whole), modules/ (one course module's source
    each), cli/ (the commands), course/ (labs, lessons, figures, the site) and support/ (shared helpers, no
    tests). A file at the root would be found by nobody who looks for the tests of one area."""
    loose = sorted(p.name for p in TESTS.iterdir() if p.suffix == ".py" and p.name not in TESTS_ROOT_FILES)
    assert not loose, f"move {loose} into one of tests/{{{','.join(TEST_AREAS)}}}/"
    areas = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and any(p.rglob("*.py")))
    assert areas == sorted(TEST_AREAS), f"tests/ holds the areas {sorted(TEST_AREAS)}, not {areas}"
    # Every folder is a package: tests import tests.support, and two areas may hold files of the same name.
    missing = sorted(
        str(d.relative_to(TESTS))
        for d in [TESTS, *TESTS.rglob("*")]
        if d.is_dir() and any(d.glob("*.py"))
        if not (d / "__init__.py").exists()
    )
    assert not missing, f"test folders without an __init__.py: {missing}"
    assert not list((TESTS / "support").glob("test_*.py")), "support/ holds helpers; its tests go in an area"


# ---------------------------------------------------------------------- names and fields that stay at home
# Each check below has a KNOWN list: today's exceptions, by file, function and expression (no line numbers, so
# an edit elsewhere in the file does not disturb them). A new case fails the check, and so does a listed case
# that is gone: the list only shrinks, and says exactly what is left to clean up.


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defining_module(target: str, files: dict[str, Path]) -> str | None:
    """The project module `target` (a module, or a name inside one) comes from; None outside the project."""
    while target not in files and "." in target:
        target = target.rpartition(".")[0]
    return target if target in files else None


def _short(module: str) -> str:
    """zero_offload.cli.bench.schedules -> cli.bench.schedules (the root package keeps its name)."""
    return module.partition(".")[2] or module


def private_crossings(root: Path) -> list[str]:
    """Each private name used outside the package that defines it: `from <module> import _name` (or a private
    module), and `module._name` where `module` is a project module this file imported."""
    files = module_files(root)
    found = set()
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        mine = _package(name)
        where = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules: dict[str, str] = {}  # a local name bound to a project module -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    defining = _defining_module(alias.name, files)
                    if defining is None:
                        continue
                    if alias.asname or "." not in alias.name:  # `import a.b` binds a, not the module a.b
                        modules[alias.asname or alias.name] = alias.name
                    if (
                        any(_is_private(part) for part in alias.name.split("."))
                        and _package(defining) != mine
                    ):
                        found.add(f"{where}: imports {_short(alias.name)} ({mine} -> {_package(defining)})")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in files:
                        modules[alias.asname or alias.name] = full
                    defining = _defining_module(full, files)
                    if defining and _is_private(alias.name) and _package(defining) != mine:
                        crossing = f"{mine} -> {_package(defining)}"
                        found.add(f"{where}: imports {alias.name} from {_short(defining)} ({crossing})")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and _is_private(node.attr)
                and _package(modules[node.value.id]) != mine
            ):
                module = modules[node.value.id]
                found.add(f"{where}: reads {_short(module)}.{node.attr} ({mine} -> {_package(module)})")
    return sorted(found)


KNOWN_PRIVATE_CROSSINGS: set[str] = set()


def _known_list_holds(found: list[str], known: set[str], name: str, rule: str) -> None:
    new = sorted(set(found) - known)
    gone = sorted(known - set(found))
    assert not new, f"{rule}:\n  " + "\n  ".join(new)
    assert not gone, f"fixed, so remove from {name} in tests/test_layout.py:\n  " + "\n  ".join(gone)


def test_no_private_name_crosses_a_package():
    """A leading underscore says "this package may change it without telling anyone". A module of another
    package that imports `_name`, or reads `module._name`, has quietly made it public: a rename inside the
    defining package then breaks code its authors never look at. Give the name a public spelling in the
    package that owns it (or move the code that needs it there)."""
    _known_list_holds(
        private_crossings(SRC),
        KNOWN_PRIVATE_CROSSINGS,
        "KNOWN_PRIVATE_CROSSINGS",
        "private names used outside their package (make them public where they are defined)",
    )


# Fields of tensors and modules that their holder sets as its own, through torch's API, not another's state.
OWN_FIELDS = {
    "data": "a tensor's storage: torch's way to swap what a parameter holds in place",
    "grad": "a parameter's gradient slot, which torch leaves to whoever computes the gradient",
    "requires_grad": "autograd's flag on a tensor, set by whoever decides what is trained",
    "weight": "a submodule's parameter, replaced to tie weights (torch's idiom for embedding and head)",
}


def _attribute_chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """`a.b.c` -> (the Name a, ["b", "c"])."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return node, chain[::-1]


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets a statement assigns to, tuples unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    else:
        return []
    targets = []
    while pending:
        target = pending.pop(0)
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            targets.append(target)
    return targets


def collaborator_writes(root: Path) -> list[str]:
    """Each assignment to a field of an object the code only holds: `self.a.b = ...` (a field of self's
    collaborator a), and `p.x = ...` where p is a parameter of the function, or of one it is nested in."""
    found = set()

    def walk(node: ast.AST, where: str, qualname: str, params: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            names = {
                a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a
            }
            if not isinstance(node, ast.Lambda):
                qualname = f"{qualname}.{node.name}" if qualname else node.name
            params = params | (names - {"self", "cls"})
        elif isinstance(node, ast.ClassDef):
            qualname = f"{qualname}.{node.name}" if qualname else node.name
        for target in _assigned(node):
            owner, chain = _attribute_chain(target)
            if not chain or not isinstance(owner, ast.Name) or chain[-1] in OWN_FIELDS:
                continue
            if (owner.id in ("self", "cls") and len(chain) >= 2) or owner.id in params:
                found.add(f"{where}: {qualname or '<module>'} sets {ast.unparse(target)}")
        for child in ast.iter_child_nodes(node):
            walk(child, where, qualname, params)

    for path in module_files(root).values():
        walk(
            ast.parse(path.read_text(encoding="utf-8"), str(path)),
            path.relative_to(root).as_posix(),
            "",
            frozenset(),
        )
    return sorted(found)


KNOWN_COLLABORATOR_WRITES = {
    # Activation recomputation replaces a block's forward with its checkpointed run: torch offers no hook
    # that replaces what forward computes, and wrapping the block in another module would rename its weights
    # in the state_dict.
    "principles/recompute.py: _wrap sets block.forward",
}


def test_no_object_sets_the_fields_of_another():
    """An object's fields are its own to change. Code that writes `self.guard.last = x`, or sets a field of
    an object it was handed, reaches past that object's methods: the owner's rules about that field (what must
    change with it, who else must hear of it) are skipped, and a reader of the owner's class cannot see every
    way its state changes. Ask the owner instead, with a method that says what happened. Tensors' and modules'
    own torch fields are exempt (OWN_FIELDS says why, field by field)."""
    _known_list_holds(
        collaborator_writes(SRC),
        KNOWN_COLLABORATOR_WRITES,
        "KNOWN_COLLABORATOR_WRITES",
        "fields set from outside their object (give the owner a method that does it)",
    )


def test_the_checks_see_a_private_crossing_and_a_collaborators_field(tmp_path):
    """Planted cases: each kind is seen, and what the rules allow is not reported."""
    root = tmp_path / "zero_offload"
    _write(root / "__init__.py", "")
    _write(root / "principles" / "__init__.py", "")
    _write(root / "principles" / "comm.py", "_WIRE = 1\n\n\ndef _send():\n    pass\n")
    _write(root / "principles" / "zero.py", "from .comm import _WIRE, _send\n")  # the same package: allowed
    _write(
        root / "engine" / "__init__.py",
        "from ..principles.comm import _send\nfrom ..principles import comm\n\n\ndef wire():\n"
        "    return comm._WIRE + comm.__name__.count('.')\n",
    )
    _write(
        root / "engine" / "states.py",
        "class States:\n    def __init__(self, guard):\n        self.guard = guard\n        self.count = 0\n"
        "        self.guard.last = 0\n        guard.owner = self\n\n    def step(self, param, grad):\n"
        "        param.grad = grad\n        param.data = grad\n        self.count += 1\n\n\n"
        "def hook(module):\n    def inner():\n        module.stored = None\n\n    return inner\n",
    )
    assert private_crossings(root) == [
        "engine/__init__.py: imports _send from principles.comm (engine -> principles)",
        "engine/__init__.py: reads principles.comm._WIRE (engine -> principles)",
    ]
    assert collaborator_writes(root) == [
        "engine/states.py: States.__init__ sets guard.owner",
        "engine/states.py: States.__init__ sets self.guard.last",
        "engine/states.py: hook.inner sets module.stored",
    ]
