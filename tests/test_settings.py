"""The settings registry (src/settings.rs, seen as `_core.settings()`) and
everything that must agree with it: the variables the code mentions, the
docs/settings.md's settings tables (the user-facing and advanced tiers), the `--help`
fallbacks and defaults, the one Rust module that reads the environment, and
that module being a leaf of the crate. Static checks; no job is started."""

import re
from pathlib import Path

import pytest

import gradhub
from gradhub import _core, _env

PKG = Path(gradhub.__file__).parent
ROOT = PKG.parent.parent
NAME = re.compile(r"GRADHUB_[A-Z0-9_]*[A-Z0-9]")


def _files() -> list[Path]:
    return (sorted(PKG.rglob("*.py")) + [PKG / "_core.pyi"] + sorted((ROOT / "src").rglob("*.rs"))
            + sorted((ROOT / "benches").rglob("*.rs")) + [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")))


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith(("GRADHUB_", "HOROVOD_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)


def test_every_variable_mentioned_is_registered():
    unknown = {f"{p.relative_to(ROOT)}: {n}" for p in _files() for n in NAME.findall(p.read_text())
               if n not in _env.SETTINGS}
    assert unknown == set(), "declare these in src/settings.rs (or fix the name)"


def test_every_registered_setting_is_read_somewhere():
    registry = ROOT / "src" / "settings.rs"
    text = "".join(p.read_text() for p in _files() if p.suffix in (".py", ".rs") and p != registry)
    # The core's own readers are the accessors after the table.
    accessors = registry.read_text().split("pub fn lookup", 1)[1]
    unread = [n for n in _env.SETTINGS if n not in text and f'"{n}"' not in accessors]
    assert unread == []


def test_registry_rows_are_well_formed(clean_env):
    assert len(_env.SETTINGS) == len(_core.settings())  # no name twice
    for s in _env.SETTINGS.values():
        assert s.kind in ("str", "int", "float", "flag", "choice"), s
        assert set(s.roles) <= {"worker", "server", "scheduler", "launcher", "bench"} and s.roles, s
        assert s.help and "|" not in s.help and "\n" not in s.help, s
        assert (s.kind == "choice") == bool(s.choices), s
        assert s.tier in _env.TIERS, s
        # The default parses as its type (and a choice is one of its choices).
        value = _env.get(s.name)
        assert (value is None) == (s.default is None), s
        if s.default is not None:
            assert s.default_doc == (s.default or "none"), s


def test_only_the_settings_module_reads_the_environment_in_rust():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "src").rglob("*.rs"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"env::(var|var_os|vars)\b", line) and not line.lstrip().startswith("//")]
    assert hits and all(h.startswith("src/settings.rs:") for h in hits), hits


def _readme_settings() -> tuple[str, str]:
    """docs/settings.md's generated settings tables, and the whole page."""
    section = (ROOT / "docs" / "settings.md").read_text()
    marker = "<!-- generated from src/settings.rs by `gradhub settings --markdown`"
    assert marker in section and "<!-- end of the generated settings -->" in section
    tables = section.split(marker, 1)[1].split("\n", 1)[1].split("<!-- end of the generated settings -->", 1)[0]
    return tables, section


def test_readme_tables_are_the_registry():
    tables, section = _readme_settings()
    assert tables == _env.markdown_table(), "regenerate them: gradhub settings --markdown"
    assert "gradhub settings --all" in section


def test_every_setting_has_a_tier_and_internal_ones_stay_out_of_the_readme(capsys):
    from gradhub import cli

    tiers = {s.name: s.tier for s in _env.SETTINGS.values()}
    assert set(tiers.values()) == {"user", "advanced", "internal"}
    internal = {n for n, t in tiers.items() if t == "internal"}
    # The harness and ablation knobs are internal; what a job needs is not.
    assert {"GRADHUB_BENCH_QUICK", "GRADHUB_BENCH_TBF_LATENCY", "GRADHUB_SPIN_US", "GRADHUB_KERNELS",
            "GRADHUB_SPREAD_BYTES", "GRADHUB_HOST_ID"} <= internal
    assert tiers["GRADHUB_SCHEDULER"] == tiers["GRADHUB_JOB_TOKEN"] == tiers["GRADHUB_ASYNC"] == "user"
    assert tiers["GRADHUB_PARTITION_BYTES"] == tiers["GRADHUB_HOST_REDUCE"] == "advanced"
    _, section = _readme_settings()
    documented = set(NAME.findall(section))
    assert documented & internal == set(), "internal settings are not for docs/settings.md"
    assert documented >= set(tiers) - internal
    # `gradhub settings` lists the two documented tiers, `--all` every one.
    assert cli.main(["settings"]) == 0
    shown = set(NAME.findall(capsys.readouterr().out))
    assert shown == set(tiers) - internal
    assert cli.main(["settings", "--all"]) == 0
    out = capsys.readouterr().out
    assert set(NAME.findall(out)) == set(tiers)
    assert out.index(_env.TIERS["user"]) < out.index(_env.TIERS["advanced"]) < out.index(_env.TIERS["internal"])
    # The --help epilogs leave them out too.
    assert "GRADHUB_KERNELS" not in _env.env_help(("worker", "server")) and "GRADHUB_LOG" in _env.env_help(("server",))


def test_settings_command_prints_the_tables(capsys):
    from gradhub import cli

    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == _env.markdown_table()
    assert cli.main(["settings", "--markdown", "--all"]) == 0
    out = capsys.readouterr().out
    assert all(f"| `{name}`" in out for name in _env.SETTINGS)


def test_settings_rs_is_a_leaf_of_the_crate():
    # The registry names no other module (settings.rs's unit test
    # `settings_is_a_leaf` holds the same): the modules that read settings
    # and the configs that share its defaults form no import circle.
    code = (ROOT / "src" / "settings.rs").read_text().split("#[cfg(test)]", 1)[0]
    paths = [line.strip() for line in code.splitlines()
             if re.search(r"\b(crate|super)::", line) and not line.lstrip().startswith("//")]
    assert paths == []


def _actions(parser):
    """Every option of the parser and its subcommands."""
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _actions(sub)
        else:
            yield a


def test_help_fallbacks_come_from_the_registry(clean_env):
    from gradhub import cli

    source = (PKG / "cli.py").read_text()
    assert not re.search(r"GRADHUB_[A-Z_]+; default", source), "use _env.fallback(NAME) for a flag's default"
    checked = 0
    for a in _actions(cli.build_parser()):
        for name, doc in re.findall(r"\((GRADHUB_[A-Z0-9_]+); default ([^)]*)\)", a.help or ""):
            assert doc == _env.setting(name).default_doc, (a.option_strings, name)
            # The flag's default, with the variable unset, is the registry's
            # (None: left to the core, whose default the registry's is).
            assert a.default in (None, _env.get(name)), (a.option_strings, a.default)
            checked += 1
    assert checked >= 8


def test_help_epilogs_list_each_roles_settings():
    from gradhub import cli

    p = cli.build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    server_help = sub.choices["server"].format_help()
    assert "GRADHUB_SERVER_PORT" in server_help and "GRADHUB_SCHEDULING" not in server_help
    scheduler_help = sub.choices["scheduler"].format_help()
    assert "GRADHUB_PEER_TIMEOUT  [default: 10]" in scheduler_help


def test_aliases_and_torchrun_fallbacks(clean_env, monkeypatch):
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    assert _env.autotune_options().enabled
    monkeypatch.setenv("GRADHUB_AUTOTUNE", "0")  # the gradhub name wins
    assert not _env.autotune_options().enabled
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    w = _env.worker_env()
    assert (w.rank, w.num_workers, w.timeline) == (3, 4, "/tmp/t.json")
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match="RANK"):
        _env.worker_env()


def test_unregistered_names_are_refused():
    with pytest.raises(KeyError, match="src/settings.rs"):
        _env.get("GRADHUB_NO_SUCH_SETTING")


def test_config_objects_take_the_core_defaults(clean_env):
    # The environment's defaults are the configs' (one copy, in Rust).
    s = repr(_core.SchedulerConfig())
    e = _env.scheduler_env()
    assert f"peer_timeout_ms: {int(e.peer_timeout * 1000)}," in s and f"stall_ms: {int(e.stall_seconds * 1000)}," in s
    c = repr(_core.ClientConfig("h:1"))
    w = _env.worker_env()
    # The credit's default depends on the job's chunk size: left to the core.
    assert _env.get("GRADHUB_CREDIT_BYTES") is None and "credit_bytes: None," in c, c
    assert f"namespace: {w.namespace}," in c
    assert f"server_shm: {str(w.server_shm).lower()}," in c
    with pytest.raises(ValueError, match="rack_reduce"):
        _core.SchedulerConfig(rack_reduce="sometimes")
