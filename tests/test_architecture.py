"""The code's shape, checked: the import structure follows the data flow (no module imports one that
imports it back), one concern per module (none over ~500 lines outside the kernels, whose files
hold a kernel, its launcher and its reference by design), no class defined inside a function, no
private name (`_x`) imported from another module, and no measurement dated or filed in the library's
comments (the reason stays in one line; the figures and their history live in bench/results)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"accelc": "accelc", "passes": "accelc.passes", "kernels": "accelc.kernels", "models": "accelc.models"}
MAX_LINES = 500


def _modules() -> dict:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _module_imports(path: Path) -> list:
    """(module imported, names) for every accelc import at the module's top level."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accelc"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("accelc")]
    return out


def _graph() -> dict:
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for module, names in _module_imports(path):
            for n in names or [None]:
                full = f"{module}.{n}" if n else module
                deps.add(full if full in MODULES else module)
        graph[name] = {d for d in deps if d in MODULES and d != name}
    return graph


def test_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not circles, circles


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if not p.is_relative_to(ROOT / "kernels")))
def test_one_concern_per_module(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines; split what it holds"


def test_no_class_defined_in_a_function():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(ROOT)}:{c.lineno} {c.name} in {node.name}" for c in ast.walk(node)
                          if isinstance(c, ast.ClassDef)]
    assert not found, found


def test_no_private_name_imported_from_another_module():
    found = [f"{path.relative_to(ROOT)}: {module}.{n}" for path in MODULES.values()
             for module, names in _module_imports(path) for n in names
             if n.startswith("_") and not n.endswith("__")]
    assert not found, found


# a date, a results file or run folder: stale at the next run (the figures' record is bench/results)
DATED = re.compile(r"20\d\d-\d\d-\d\d|bench/results|results/|runs/|\brun\d+[a-z]?\b|\bprofile\d+-")


def test_no_measurement_dated_or_filed_in_library_comments():
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in MODULES.values()
             for i, line in enumerate(path.read_text().splitlines(), 1) if DATED.search(line)]
    assert not found, "\n".join(found)


def test_generation_declares_its_contract_instead_of_attribute_hooks():
    """optimize reads a step module's race through its declared base (accelc.step_module), not by hasattr; the
    OptimizedLM holds its generation parts as one declared record, not attributes forced past nn.Module."""
    api = (ROOT / "accelc" / "api.py").read_text()
    generation = (ROOT / "accelc" / "generation.py").read_text()
    assert "hasattr(job.model" not in api
    assert "object.__setattr__" not in generation and 'getattr(self, "step"' not in generation
    from accelc.step_module import StepModule

    for module, name in (("accelc.static_cache", "CacheStep"), ("accelc.paged_cache", "PagedStep")):
        pytest.importorskip("transformers")
        cls = getattr(__import__(module, fromlist=[name]), name)
        assert issubclass(cls, StepModule)
        missing = [m for m in ("race_inputs", "reset", "describe", "begin", "prefill_inputs", "decode_inputs",
                               "shell_inputs") if getattr(cls, m) is getattr(StepModule, m)]
        assert not missing, (name, missing)


def test_optimize_stages_read_no_attribute_hooks():
    """optimize's route (accelc/api.py, accelc/stages.py, accelc/warmup.py) reads what a stage hands it through
    declared records and types, never an attribute looked up by name (hasattr / getattr with a string): the
    hooks the issue found (warm-up hooks on the model) stay gone, and a model's one documented declaration
    (`replayable_state = True`) is read by runner.declares_replayable_state alone."""
    found = []
    for name in ("api.py", "stages.py", "warmup.py"):
        path = ROOT / "accelc" / name
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)):
                found.append(f"accelc/{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_optimize_stages_hand_on_records():
    """accelc.stages' settle -> finish -> module each take the record the stage before returns."""
    import inspect

    from accelc import stages

    assert list(inspect.signature(stages.finish).parameters) == ["s"]
    assert list(inspect.signature(stages.module).parameters)[0] == "f"
    assert inspect.signature(stages.settle).return_annotation in ("Settled", stages.Settled)
    assert inspect.signature(stages.finish).return_annotation in ("Finished", stages.Finished)


def test_kernel_primitives_have_one_home():
    """What the kernel families share (tile order, SM count, TMA views, the online softmax's steps) is defined in
    kernels/primitives.py and nowhere else; a family's candidate tables live beside its kernels, not in them
    (kernels/gemm_configs.py, kernels/conv_configs.py)."""
    shared = {"tile_coords", "sm_count", "tma_ok", "tma_view", "log2_units", "softmax_update"}
    where = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in shared:
                where.setdefault(node.name, []).append(name)
    assert where == {n: ["accelc.kernels.primitives"] for n in shared}, where
    for family in ("gemm", "conv"):
        tree = ast.parse((ROOT / "kernels" / f"{family}.py").read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert not defined & {"config", "rect_config", "rows_config", "prune_configs", "default_config", "gemv_config",
                              "gluon_config", "interpreter_config"}, (family, defined)


def test_the_call_contract_is_read_only():
    """InputShapes is the call contract: capture settles it, and what a later stage learns of it (the guard's
    narrower ranges, a loaded program's notes) is a new contract; the sizes the guard checked are its own
    record (capture.shapes.CHECKED_AT), not fields written into the contract."""
    import dataclasses

    from accelc.capture.shapes import InputShapes

    assert InputShapes.__dataclass_params__.frozen
    assert "checked" not in {f.name for f in dataclasses.fields(InputShapes)}


def test_no_statement_after_the_raising_call_in_a_pytest_raises_block():
    """A `with pytest.raises(...)` block holds the one call that raises: a statement after it never runs (a
    tensor-parallel test's refusal checks sat there, passing without running)."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.With) and len(node.body) > 1 and any(
                    isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Attribute)
                    and item.context_expr.func.attr == "raises" for item in node.items):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def test_gluon_partitions_take_one_aggregate():
    """Every function a Gluon kernel hands to gl.warp_specialize takes its kernel's one aggregate of shared
    arguments (kernels/hopper_args.py) and at most three constants (its index, counts), not a positional
    bundle of descriptors, buffers, sizes and flags."""
    found = {}
    for path in sorted((ROOT / "kernels").glob("*_hopper.py")):
        tree = ast.parse(path.read_text())
        defs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "warp_specialize":
                for pair in call.args[0].elts:
                    name = pair.elts[0].id
                    found[f"{path.name}:{name}"] = len(defs[name].args.args)
    assert len(found) >= 8, found     # the GEMM's, the cooperative GEMM's, the conv's and the attention's
    too_many = {k: n for k, n in found.items() if n > 4}
    assert not too_many, too_many


def _nested_targets(tree) -> list:
    """Assignment and loop targets of a tuple inside a tuple (`(a, b), c = ...`)."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.For) else []
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)) and any(isinstance(e, (ast.Tuple, ast.List)) for e in t.elts):
                out.append(node.lineno)
    return out


def test_no_nested_unpacking_in_kernels():
    """Triton 3.6 (the device's) computes a kernel's cache key by walking its source and every function it calls, and
    that walk fails (`unhashable type: 'list'`) on a tuple target inside a tuple: `(a, b), c = f()` in a jit
    function failed every first compile of the Hopper GEMM and conv there, where Triton 3.9 compiles it. Kernel
    functions unpack one level a statement."""
    found = {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in f.decorator_list):
                if lines := _nested_targets(f):
                    found[f"{path.name}:{f.name}"] = lines
    assert not found, found
    assert _nested_targets(ast.parse("(a, b), c = f()\nfor x, (y, z) in g(): pass")) == [1, 2]
