"""The package's structure: the type stub matches the extension, the torch
layer reaches the core only through gradhub.api, environment parsing lives in
_env.py. Static checks and unit tests; no job is started."""

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
