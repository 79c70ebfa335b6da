"""The layout's rules, read from the source with `ast` (nothing is imported):
no import circle inside decoding/ and training/ (module-level and function-level imports both
count), and no arrow from inference (`decoding`) up to `training`."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decoding", "training")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module that `name` lies in (`a.b.func` -> `a.b`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Every project module `module` imports anywhere in its source, function bodies included.
    `from pkg import sub` counts as an edge to `pkg.sub` when that is a module, else to `pkg`."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (hit := _resolve(alias.name, modules)) is not None:
                    found.add(hit)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}", modules)
                if target is None or target == base and f"{base}.{alias.name}" not in modules:
                    target = _resolve(base, modules)
                if target is not None:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    modules = set(files)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", modules)
            for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search)."""
    def edges(m):
        return sorted(graph.get(m, ()))
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges(m):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_decoding_and_training_have_no_import_circles():
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_inference_never_imports_training():
    graph = import_graph(ROOT)
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.split(".")[0] == "decoding"
                for t in ts if t.split(".")[0] == "training")
    assert not up, "decoding imports training: " + "; ".join(up)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_sees_circles_in_function_bodies_and_upward_arrows(tmp_path):
    """The checks above can fail: a circle closed only by an import inside a function, a relative
    `from . import x` and an inference -> training arrow are all found."""
    _write(tmp_path, {
        "decoding/__init__.py": "",
        "decoding/a.py": "from decoding.b import f\n",
        "decoding/b.py": "def f():\n    from . import c\n",
        "decoding/c.py": "def g():\n    import decoding.a\n",
        "decoding/d.py": "def h():\n    from training.t import x\n",
        "training/__init__.py": "",
        "training/t.py": "x = 1\n",
    })
    graph = import_graph(tmp_path)
    assert graph["decoding.b"] == {"decoding.c"}
    assert find_cycle(graph) == ["decoding.a", "decoding.b", "decoding.c", "decoding.a"]
    assert graph["decoding.d"] == {"training.t"}
    (tmp_path / "decoding/c.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(tmp_path)) is None


# ---- the rooms: what sits where, and who may import whom ----
ROUND = {"decoding.engine", "decoding.tree_proposer", "decoding.stopping", "decoding.growth", "decoding.acceptance",
         "decoding.strategies", "decoding.api", "decoding.generate"}
"""The round and its front ends: the forward room and model loading sit below them."""
TRAINING_TOP = {"__init__", "config_flags", "logged", "shards", "swap", "demo", "collect", "fit", "retrain", "distill",
                "migrate_fingerprints", "convert_draft"}
"""training/'s top level: the user's commands and the helpers every pipeline shares (`python -m
training.export` is the export room's own __main__)."""
ENTRY_POINTS = {"collect": "training.decider.collect", "fit": "training.decider.fit",
                "retrain": "training.decider.retrain", "distill": "training.draft.distill",
                "export": "training.export.formats"}


def test_decoding_top_level_holds_at_most_15_modules():
    top = sorted(p.stem for p in (ROOT / "decoding").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 15, f"{len(top)} modules at decoding/'s top: {top}"


def test_every_pipeline_has_its_room():
    for room in ("forward", "decider", "models", "drafts", "bench"):
        assert (ROOT / "decoding" / room / "__init__.py").is_file(), room
    for room in ("corpus", "decider", "draft", "head", "export", "bench"):
        assert (ROOT / "training" / room / "__init__.py").is_file(), room
    extra = sorted(p.stem for p in (ROOT / "training").glob("*.py") if p.stem not in TRAINING_TOP)
    assert not extra, f"training/'s top level holds commands and shared helpers only; move {extra} into a room"


BENCH_ROOMS = ("decoding/bench", "training/bench")
"""Where benches live: inference's (engines and strategies compared) and training's (they read
training code, which decoding never imports)."""


def test_benches_live_in_the_bench_rooms_and_each_room_names_its_modules():
    stray = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*bench*")
                   if "__pycache__" not in p.parts and "/".join(p.relative_to(ROOT).parts[:2]) not in BENCH_ROOMS)
    assert not stray, f"a bench outside {' and '.join(BENCH_ROOMS)}: {stray}"
    for room in BENCH_ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / room / "__init__.py").read_text())) or ""
        missing = sorted(p.stem for p in (ROOT / room).glob("*.py")
                         if not p.stem.startswith("__") and not re.search(rf"\b{p.stem}\b", doc))
        assert not missing, f"{room}/__init__ does not say what {missing} are for"


def test_machine_logistics_do_not_ship():
    """Packing files for a leased GPU is a maintainer's tool: tools/, outside the packages the
    wheel installs (pyproject includes decoding* and training*), importable from neither."""
    import importlib.util

    assert (ROOT / "tools" / "gpu_pack.py").is_file() and not (ROOT / "tools" / "__init__.py").exists()
    shipped = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("gpu_pack*"))
    assert not shipped, f"in the package: {shipped}"
    assert importlib.util.find_spec("decoding.bench.gpu_pack") is None


def test_the_forward_room_and_model_loading_never_import_the_round():
    """decoding.models.session is where a loaded pair meets its strategy, so it may."""
    graph = import_graph(ROOT)
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() if m != "decoding.models.session"
                and m.startswith(("decoding.forward", "decoding.models")) for t in ts if t in ROUND)
    assert not up, "below the round, yet importing it: " + "; ".join(up)


def test_the_commands_at_training_s_top_only_start_their_pipeline():
    """`python -m training.fit` and the rest keep working as the README shows them; their code
    lives in the pipeline's room (one import, one call)."""
    for name, target in ENTRY_POINTS.items():
        path = ROOT / "training" / f"{name}.py"
        module = f"training.{name}"
        if not path.is_file():  # a room whose __main__ is the command
            path, module = ROOT / "training" / name / "__main__.py", f"training.{name}.__main__"
        rel = path.relative_to(ROOT)
        found = imports_of(path.read_text(), module, False, set(import_graph(ROOT)))
        assert found == {target}, f"{rel} imports {sorted(found)}, not just {target}"
        assert len(path.read_text().splitlines()) <= 12, f"{rel} is more than an entry point"


def test_tests_live_in_area_folders_and_import_no_other_test_file():
    tests = ROOT / "tests"
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert not flat, f"test files outside an area folder: {flat}"
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[-1].startswith("test_")]
            assert not bad, f"{path.relative_to(ROOT)} imports the test file(s) {bad}: move shared code to tests/support"


def test_layout_doc_names_every_room():
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert "docs/layout.md" in (ROOT / "README.md").read_text(), "the README no longer links docs/layout.md"
    for pkg in ("decoding", "training"):
        for room in sorted(p.parent.name for p in (ROOT / pkg).glob("*/__init__.py")):
            assert f"{room}/" in layout, f"docs/layout.md does not name {pkg}/{room}/"
    for area in sorted(p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        assert f"`{area}`" in layout or f"tests/{area}/" in layout, f"docs/layout.md does not name tests/{area}"


def test_models_init_only_re_exports():
    """decoding/models/__init__.py names what callers import; the logic lives in the modules
    named for what they do (resolve, weights, pair, fingerprint, ...)."""
    tree = ast.parse((ROOT / "decoding" / "models" / "__init__.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defined, f"decoding/models/__init__.py defines {defined}: move them into a module of decoding/models/"



CLI_MODULES = {"decoding.generate", "decoding.serve.__main__"}


def test_no_cli_module_is_imported_as_a_library():
    """Commands share code through the library (decoding.api, decoding.defaults), never through
    each other; decoding/__main__.py runs them by name (runpy), which is not an import."""
    graph = import_graph(ROOT)
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if t in CLI_MODULES)
    assert not bad, "a CLI module imported as a library: " + "; ".join(bad)
