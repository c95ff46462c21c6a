"""The package's structure: the type stub matches the extension, the torch
layer reaches the core only through gradhub.api, environment parsing lives in
_env.py, no module imports the lab (lab/gradhub_lab) and no import circle.
Static checks and unit tests; no job is started."""

import ast
import re
from pathlib import Path

import pytest

import gradhub
from gradhub import _core, _env

PKG = Path(gradhub.__file__).parent
STUB = PKG / "_core.pyi"


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    """Top-level public names of the stub, and the public members of each class."""
    tree = ast.parse(STUB.read_text())
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
            } | {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return {n for n in names if not n.startswith("_")}, members


def test_stub_matches_the_extension():
    stub, stub_members = _stub_names()
    ext = {n for n in dir(_core) if not n.startswith("_")}
    assert stub - ext == set(), f"in _core.pyi but not in the extension: {sorted(stub - ext)}"
    assert ext - stub == set(), f"in the extension but not in _core.pyi: {sorted(ext - stub)}"
    for name in sorted(stub_members):
        cls = getattr(_core, name)
        assert isinstance(cls, type), name
        have = {n for n in vars(cls) if not n.startswith("_")}
        want = stub_members[name]
        assert want - have == set(), f"_core.{name}: in the stub only: {sorted(want - have)}"
        assert have - want == set(), f"_core.{name}: in the extension only: {sorted(have - want)}"


def _stub_signatures() -> dict[str, list[tuple[str, object]]]:
    """'func' or 'Class.method' -> [(parameter, default or inspect.Parameter.empty)], from the stub."""
    import inspect

    out = {}

    def params(fn: ast.FunctionDef) -> list[tuple[str, object]]:
        args = [a.arg for a in fn.args.args if a.arg != "self"]
        defaults = [ast.literal_eval(d) if not (isinstance(d, ast.Constant) and d.value is ...) else ...
                    for d in fn.args.defaults]
        padded = [inspect.Parameter.empty] * (len(args) - len(defaults)) + defaults
        return list(zip(args, padded))

    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and not any(
                        isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list):
                    if f.name == "__init__" or not f.name.startswith("_"):
                        out[f"{node.name}.{f.name}"] = params(f)
    return out


def test_stub_signatures_match_the_extension():
    import inspect

    for qual, want in sorted(_stub_signatures().items()):
        obj = _core
        for part in qual.split("."):
            # A constructor's signature is the class's own.
            obj = obj if part == "__init__" else getattr(obj, part)
        sig = inspect.signature(obj)
        have = [(p.name, p.default) for p in sig.parameters.values()
                if p.name not in ("self", "cls", "$self", "$cls", "type")]
        assert [n for n, _ in have] == [n for n, _ in want], f"{qual}: extension {have}, stub {want}"
        for (name, d_have), (_, d_want) in zip(have, want):
            # The extension shows non-literal defaults (e.g. -1, constants) as "...".
            if d_want is not ... and d_have is not inspect.Parameter.empty and d_have is not ...:
                assert d_have == d_want, f"{qual}({name}=...): extension default {d_have!r}, stub {d_want!r}"


def test_package_ships_the_stub():
    assert STUB.is_file() and (PKG / "py.typed").is_file()


def _sources(sub: str = "") -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def test_torch_layer_uses_only_the_api():
    # No private client access, no raw pointers into the core, no _core import.
    bad = re.compile(r"_client\b|_require\b|\b_core\b|push_pull_async\(.*data_ptr")
    hits = [f"{p.name}:{i}: {line.strip()}" for p in _sources("torch")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mods.update(f"{node.module or ''}.{a.name}".strip(".") for a in node.names)
            mods.add(node.module or "")
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_api_does_not_import_the_cli():
    for name in ("api.py", "roles.py", "_env.py", "buffers.py"):
        mods = _imports(PKG / name)
        assert not any(m == "cli" or m.endswith(".cli") or m == "gradhub.cli" for m in mods), (name, mods)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in _sources()}
# Compiled modules (gradhub._core, typed by its stub): importable, nothing of the package's inside.
COMPILED = {_module_name(p.with_suffix(".py")) for p in PKG.rglob("*.pyi")} - set(MODULES)
# The lab (lab/gradhub_lab) and the modules it was made of, once in the package.
LAB = ("gradhub_lab",) + tuple(f"gradhub.bench.{m}" for m in (
    "netns", "runner", "emulate", "goodput", "cluster", "experiments", "suite", "report", "tenancy", "faults",
    "elastic_faults", "elastic_loop", "torch_options", "profiles")) + tuple(
    f"gradhub.plan.{m}" for m in ("validate", "check", "netcal", "plots"))


def _imported(module: str, path: Path) -> set[str]:
    """Every name `module` imports, absolute, at module level or inside a
    function: `import a.b` names a.b; `from a import b` names a.b where that
    is a module of the package, else a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES or sub in COMPILED else base)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (a name
    resolved to the closest enclosing module)."""
    graph = {}
    for m, p in MODULES.items():
        deps = set()
        for name in _imported(m, p):
            while name and name not in MODULES and name not in COMPILED:
                name = name.rpartition(".")[0]
            if name in MODULES and name != m:
                deps.add(name)
        graph[m] = deps
    return graph


def test_the_package_never_imports_the_lab():
    """The lab depends on gradhub, never the reverse: no import of it (nor of
    a module it was made of) anywhere in the package, nor code that a child
    process runs naming it (`-m gradhub_lab...`, `import gradhub_lab`)."""
    hits = [f"{p.relative_to(PKG)}: imports {name}" for m, p in MODULES.items() for name in sorted(_imported(m, p))
            if any(name == lab or name.startswith(lab + ".") for lab in LAB)]
    code = re.compile(r"(-m\s+|import\s+|from\s+)gradhub_lab\b")
    hits += [f"{p.relative_to(PKG)}:{i}: {line.strip()}" for p in MODULES.values()
             for i, line in enumerate(p.read_text().splitlines(), 1) if code.search(line)]
    assert hits == []
    assert not [m for m in LAB if m in MODULES], "a module of the lab is back in the package"


def test_the_lab_uses_only_the_public_surface_and_gradhub_tools():
    """The lab (lab/gradhub_lab) imports nothing private of the package: no
    `gradhub._*` module and no `_`-name from it; what it needs beyond the
    public API comes from the one documented internal module, gradhub.tools."""
    hits = []
    for path in sorted((PKG.parent.parent / "lab" / "gradhub_lab").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradhub"):
                parts = (node.module or "").split(".")
                names = [a.name for a in node.names]
                if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                    hits.append(f"{path.name}:{node.lineno}: from {node.module} import {', '.join(names)}")
            elif isinstance(node, ast.Import):
                hits += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names
                         if a.name.startswith("gradhub.") and any(p.startswith("_") for p in a.name.split("."))]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    isinstance(node.value, ast.Name) and node.value.id in ("gradhub", "api", "tools"):
                hits.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert hits == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module
    (Tarjan's algorithm), each as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_circle(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One circle through a strongly connected component: from its first
    module, breadth first, back to it."""
    start = min(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return sorted(comp)


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    """No module of the package imports one that imports it back, directly
    or through others, counting imports inside functions too."""
    graph = _import_graph()
    assert {"gradhub.api", "gradhub.plan.sim", "gradhub.torch.ops"} <= set(graph)
    assert "gradhub.plan.costs" in graph["gradhub.plan.sim"] and "gradhub._core" not in graph["gradhub.api"]
    cycles = _cycles(graph)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _private_torch_imports(module: str, path: Path, outside: str, text: str | None = None) -> set[tuple[str, str, str]]:
    """(module, name, from) for each name starting with "_" that `module`
    takes from a gradhub.torch module not under `outside`: imported by name
    (`from ..ops import _x`, `from .. import _mod`), or read off a module it
    imported (`from .. import ops` then `ops._x`). `text`: the module's
    source, if not the file's."""
    tree = ast.parse(path.read_text() if text is None else text)
    hits, bound = set(), {}

    def foreign(name: str) -> bool:
        return (name == "gradhub.torch" or name.startswith("gradhub.torch.")) and not (
            name == outside or name.startswith(outside + "."))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            if not foreign(base):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    hits.add((module, a.name, base))
                elif f"{base}.{a.name}" in MODULES:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if foreign(a.name) and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            hits.add((module, node.attr, bound[node.value.id]))
    return hits


def test_private_import_finder():
    src = ("from ..ops import _push_pull_async, Handle\nfrom .. import ops, process_sets as sets\n"
           "from .work import _Op\nfrom ... import _env\nsets._reset()\nops.allreduce\n")
    found = _private_torch_imports("gradhub.torch.dist.collectives", PKG / "torch" / "dist" / "collectives.py",
                                   "gradhub.torch.dist", src)
    assert found == {("gradhub.torch.dist.collectives", "_push_pull_async", "gradhub.torch.ops"),
                     ("gradhub.torch.dist.collectives", "_reset", "gradhub.torch.process_sets")}


def test_torch_doors_reach_the_core_through_sums():
    """gradhub.torch's doors (the Horovod-style API, the DDP comm hook, the
    torch.distributed backend) share one path to the core, `torch/sums.py`:
    the backend (every module under torch/dist/) and the hook take no
    private name from the torch layer's other modules, and neither calls the
    core's push_pull itself."""
    hits = set()
    for m, p in MODULES.items():
        if m == "gradhub.torch.dist" or m.startswith("gradhub.torch.dist."):
            hits |= _private_torch_imports(m, p, "gradhub.torch.dist")
    hits |= _private_torch_imports("gradhub.torch.ddp", MODULES["gradhub.torch.ddp"], "gradhub.torch.ddp")
    assert hits == set(), "private names across torch doors: " + "; ".join(
        f"{m} takes {n} from {f}" for m, n, f in sorted(hits))


def test_environment_is_read_only_in_env_module():
    # Copying the environment for child processes (launch, bench) is fine; reading settings is _env.py's job.
    allowed = {PKG / "_env.py", PKG / "launch" / "local.py", PKG / "launch" / "ssh.py"}
    hits = [f"{p.relative_to(PKG)}:{i}" for p in _sources() if p not in allowed and "bench" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if "os.environ" in line or "getenv" in line]
    assert hits == []


def test_one_counter_for_automatic_names():
    from gradhub import api

    pytest.importorskip("torch")
    from gradhub.torch import ops

    assert ops._auto_name is api.auto_name
    a, b = api.auto_name("broadcast"), ops._auto_name("broadcast")
    assert a != b and a.startswith("broadcast.noname.")


@pytest.mark.parametrize("var,value,reader,text", [
    ("GRADHUB_NUM_WORKERS", "four", _env.worker_env, "is not an integer"),
    ("GRADHUB_CONNECT_TIMEOUT", "soon", _env.worker_env, "is not a number"),
    ("GRADHUB_PEER_TIMEOUT", "10s", _env.scheduler_env, "is not a number"),
    ("GRADHUB_COLOCATED", "maybe", _env.server_env, "is not a flag"),
    ("GRADHUB_OVERLAP_FORWARD", "2", _env.torch_options, "is not a flag"),
    ("GRADHUB_SCHEDULING", "lifo", _env.torch_options, "expected auto, priority, size or fifo"),
    ("GRADHUB_ROLE", "client", _env.role, "expected worker, server or scheduler"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, var, value, reader, text):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=re.escape(var)) as e:
        reader()
    assert text in str(e.value)


def test_environment_defaults_and_flags(monkeypatch):
    for k in ("GRADHUB_SERVER_THREADS", "GRADHUB_COLOCATED", "GRADHUB_OVERLAP_FORWARD", "GRADHUB_SCHEDULING",
              "GRADHUB_PEER_TIMEOUT", "GRADHUB_ROLE"):
        monkeypatch.delenv(k, raising=False)
    assert _env.server_env().threads is None and not _env.server_env().colocated
    assert _env.scheduler_env().peer_timeout == 10.0
    assert _env.torch_options().scheduling == "auto" and _env.role() == "worker"
    assert _env.torch_options().eager_update
    monkeypatch.setenv("GRADHUB_COLOCATED", "Yes")
    monkeypatch.setenv("GRADHUB_OVERLAP_FORWARD", "off")
    monkeypatch.setenv("GRADHUB_SCHEDULING", "FIFO")
    assert _env.server_env().colocated and not _env.torch_options().overlap_forward
    assert _env.torch_options().scheduling == "fifo"


def test_cli_reports_a_bad_variable(monkeypatch, capsys):
    from gradhub import cli

    monkeypatch.setenv("GRADHUB_STALL_SECONDS", "long")
    assert cli.main(["scheduler", "--workers", "1", "--servers", "1"]) == 2
    assert "GRADHUB_STALL_SECONDS" in capsys.readouterr().err
