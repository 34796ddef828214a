"""The package's shape, as README's Architecture section draws it: imports run one way, top down, with
no circles between modules; engine/ is plain Python (its modules import with torch and triton absent);
the device side sees of the engine only its contract, engine/step.py and engine/executor.py; no package
file is over 300 lines. Imports are read from the source (inside functions too), not executed."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanovllm"
# Top to bottom: a module may import from its own layer or from any layer below it.
LAYERS = [
    ("serve", "integrations", "eval"),
    ("__init__", "llm", "text_stream"),
    ("dp",),
    ("engine", "speculative"),
    ("distributed",),
    ("runner",),
    ("models",),
    ("layers",),
    ("attention",),
    ("kernels",),
    # speculative.config: the parsed speculative_config option, a part of Config.
    ("config", "sampling_params", "outputs", "speculative.config"),
    ("utils",),
]
# The engine's interface to the device side: the step record and the Executor protocol. They import
# nothing of the engine beyond each other, so the runner and the workers may import them.
CONTRACT = {"nanovllm.engine.step", "nanovllm.engine.executor"}
MAX_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def layer_of(module: str) -> int:
    """A module's layer: its own entry (`speculative.config`) where LAYERS has one, else its package's."""
    parts = module.split(".")[1:] or ["__init__"]
    for part in (".".join(parts[:2]), parts[0]):
        layer = next((i for i, names in enumerate(LAYERS) if part in names), None)
        if layer is not None:
            return layer
    raise AssertionError(f"module {module} has no layer in LAYERS")


def package_imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (a `from package import module` counts the module)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                         else node.module for alias in node.names]
            else:
                continue
            targets.update(name for name in names if name in modules and name != module)
        graph[module] = targets
    return graph


def test_imports_run_top_down():
    upward = [f"{module} -> {target}" for module, targets in package_imports().items() for target in targets
              if layer_of(target) < layer_of(module) and target not in CONTRACT]
    assert upward == []


def test_the_contract_imports_nothing_else_of_the_engine():
    graph = package_imports()
    for module in CONTRACT:
        assert {t for t in graph[module] if t.startswith("nanovllm.engine")} <= CONTRACT


def test_no_import_circles():
    graph = package_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_engine_imports_without_torch_or_triton():
    engine = sorted(module_name(path) for path in (PACKAGE / "engine").glob("*.py"))
    code = ("import sys\nsys.modules['torch'] = sys.modules['triton'] = None\n"
            + "".join(f"import {module}\n" for module in engine)
            + "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_no_package_file_is_over_300_lines():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
