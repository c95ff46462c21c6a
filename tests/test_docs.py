"""The docs name only what exists: every repository path docs/*.md and
README.md name (`src/...`, `python/gradhub/...`, `lab/...`, `tests/...`, a module
relative to its package like `client/io/flow.rs`, a link, a data file of
docs/bench/), and every section another document cites as
(docs/X.md, "Heading"). Pure file reads, no gradhub import."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "docs" / "bench" / "suite.md", ROOT / "docs" / "bench" / "details.md",
                                                ROOT / "README.md"]
# Where the data files docs/benchmarks.md names by their bare names live.
DATA_DOCS = {ROOT / "docs" / "benchmarks.md": ROOT / "docs" / "bench", ROOT / "docs" / "bench" / "suite.md": ROOT / "docs" / "bench",
             ROOT / "docs" / "bench" / "details.md": ROOT / "docs" / "bench"}

ROOTS = ("src", "python", "lab", "tests", "docs", "examples", "deploy", "benches", "fuzz")
# A path rooted in the repository, anywhere in the text (prose, backticks, code).
ROOTED = re.compile(r"(?<![\w./~-])(?:%s)/[\w.{}*<>,/-]*[\w}*>/]" % "|".join(ROOTS))
FILE_EXT = r"\.(?:rs|py|pyi|md|json|jsonl|png|toml|sh|sbatch|yaml|dict)"
# In backticks, a path relative to its package (`client/io/flow.rs`,
# `torch/fusion.py`, `protocol/`), or in docs/benchmarks.md a data file
# (`tenancy.json`, `sfb_{alexnet,vgg19}_k4.jsonl`, `autotune_*.jsonl`).
RELATIVE = re.compile(r"^[\w.{}*,-]+(?:/[\w.{}*,-]+)*(?:%s|/)$" % FILE_EXT)
BACKTICKS = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_NAMES = "|".join(re.escape(d.name) for d in DOCS if d.parent.name == "docs") + "|README\\.md"
SECTION_REF = re.compile(r"((?:docs/)?(?:%s)),?\s+\(?\"([^\"]+)\"" % DOC_NAMES)


def _files() -> list[str]:
    """Every file and folder (folders end in /) under the repository's
    top-level folders above, build outputs left out."""
    out = []
    for top in ROOTS:
        for d, dirs, files in os.walk(ROOT / top):
            dirs[:] = [x for x in dirs if x not in ("target", "__pycache__", "node_modules") and not x.startswith(".")
                       and not x.endswith(".egg-info")]
            rel = Path(d).relative_to(ROOT).as_posix()
            out.append(rel + "/")
            out += [f"{rel}/{f}" for f in files]
    return out


FILES = _files()
# The packages' folders (`protocol`, `io`, `torch`, ...): a relative path
# starting with one of them names a module; other folders in backticks
# (`bench-results/gpu/`) are what a command writes.
PACKAGES = {f.rstrip("/").rsplit("/", 1)[-1] for f in FILES
            if f.endswith("/") and f.startswith(("src/", "python/gradhub/", "lab/gradhub_lab/"))}


def _expand(token: str) -> list[str]:
    """{a,b} alternatives expanded; {rank}-style placeholders and <name> as wildcards."""
    token = re.sub(r"<[^>]*>", "*", token)
    token = re.sub(r"\{[^{},]*\}", "*", token)
    parts = re.split(r"(\{[^{}]*\})", token)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(pattern: str, base: Path) -> bool:
    if "*" in pattern:
        return any(base.glob(pattern.rstrip("/")))
    return (base / pattern).exists()


def _suffix_exists(pattern: str) -> bool:
    """Some file or folder of the repository ends with this path."""
    rx = re.compile("(^|/)" + re.escape(pattern).replace(r"\*", "[^/]*") + ("" if pattern.endswith("/") else "/?") + "$")
    return any(rx.search(f) for f in FILES)


def _strip_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _line(text: str, needle: str) -> int:
    i = text.find(needle)
    return text.count("\n", 0, i) + 1 if i >= 0 else 0


def _missing_paths(doc: Path) -> list[str]:
    text = doc.read_text()
    missing = []
    # Rooted paths, anywhere.
    for m in ROOTED.finditer(text):
        token = m.group(0).rstrip(".,;:")
        token = token.split("::")[0]
        if any(not _exists(p, ROOT) for p in _expand(token)):
            missing.append(f"{_rel(doc)}:{_line(text, token)}: {token}")
    # Paths relative to their package, and data files by their bare names, in backticks.
    prose = _strip_fences(text)
    for span in BACKTICKS.findall(prose):
        for word in span.split():
            word = word.strip("()[],;:.'\"").split("::")[0]
            if not word or word.startswith(ROOTS) or "=" in word or ":" in word or word.startswith(("/", "~", ".")):
                continue
            if not RELATIVE.match(word):
                continue
            in_package = "/" in word and (word.split("/")[0] in PACKAGES or word.endswith((".rs", ".py", ".pyi")))
            if not in_package and doc not in DATA_DOCS:
                continue
            patterns = _expand(word)
            if doc in DATA_DOCS and "/" not in word.rstrip("/"):
                ok = all(_exists(p, DATA_DOCS[doc]) or _suffix_exists(p) for p in patterns)
            elif doc in DATA_DOCS and word.endswith(tuple(".json .jsonl .png".split())):
                ok = all(_exists(p, DATA_DOCS[doc]) for p in patterns)
            else:
                ok = all(_suffix_exists(p) for p in patterns)
            if not ok:
                missing.append(f"{_rel(doc)}:{_line(text, word)}: `{word}`")
    # Links and images, relative to the document.
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not (doc.parent / path).exists():
            missing.append(f"{_rel(doc)}:{_line(text, target)}: link {target}")
    return missing


def _missing_in_module_rows(doc: Path) -> list[str]:
    """A module table's row for a folder (`protocol/`, `torch/`) names its
    files bare (`frame.rs`, `control/mod.rs`): each must be in that folder."""
    missing = []
    for line in doc.read_text().splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3:
            continue
        first = BACKTICKS.findall(cells[1])
        if len(first) != 1 or not first[0].endswith("/"):
            continue
        bases = [ROOT / top / first[0] for top in ("src", "python/gradhub") if (ROOT / top / first[0]).is_dir()]
        if not bases:
            continue
        for span in BACKTICKS.findall("|".join(cells[2:])):
            word = span.strip("()[],;:.")
            if re.fullmatch(r"[\w/]+\.(?:rs|py|pyi)", word) and not word.startswith(ROOTS):
                if not any(any(b.rglob(word)) for b in bases):
                    missing.append(f"{_rel(doc)}: `{word}` in the row of `{first[0]}`")
    return missing


def test_every_path_the_docs_name_exists():
    missing = [m for doc in DOCS for m in _missing_paths(doc) + _missing_in_module_rows(doc)]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def _headings(doc: Path) -> list[str]:
    return [re.sub(r"^#+\s*", "", line).strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def _flat(path: Path) -> str:
    """The text with comment leaders, escaped quotes and line breaks gone, so
    a reference wrapped over two comment lines reads as one."""
    text = path.read_text().replace('\\"', '"')
    text = re.sub(r"^\s*(?://[/!]?|#)", " ", text, flags=re.M)
    return re.sub(r"\s+", " ", text)


CODE = sorted((ROOT / "src").rglob("*.rs")) + sorted((ROOT / "python").rglob("*.py"))


def test_every_section_the_docs_and_the_code_cite_exists():
    """(docs/benchmarks.md, "Training modes"), in a document, a comment or a
    setting's help, must name a heading of that document (the start of one:
    "Racks" finds "Racks (two-level reduction)")."""
    missing = []
    for doc in DOCS + CODE:
        text = _flat(doc)
        for name, section in SECTION_REF.findall(text):
            target = ROOT / name if "/" in name else (ROOT / "docs" / name)
            if not target.exists():
                target = ROOT / name
            if not target.exists():
                missing.append(f"{_rel(doc)}: {name} (no such document)")
                continue
            if not any(h == section or h.startswith(section) for h in _headings(target)):
                missing.append(f"{_rel(doc)}: {name}, \"{section}\"")
    assert not missing, "sections cited that no heading starts with:\n" + "\n".join(missing)


def test_the_checks_catch_a_missing_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See `src/protocol/control.rs`, `protocol/control.rs` and [there](nowhere.md); "
                   "`src/protocol/control/mod.rs` and `client/io/flow.rs` exist.\n")
    missing = _missing_paths(doc)
    assert len(missing) == 3, missing
    table = tmp_path / "y.md"
    table.write_text("| `protocol/` | the header (`frame.rs`), messages (`control.rs`, `control/mod.rs`) |\n")
    assert _missing_in_module_rows(table) == [f"{table}: `control.rs` in the row of `protocol/`"]
    assert any("src/protocol/control.rs" in m for m in missing)
    assert any("`protocol/control.rs`" in m for m in missing)
    assert any("nowhere.md" in m for m in missing)


# Work-log references: a tracker number, a session, a date (history is git's).
WORK_LOG = re.compile(r"\b(?:issue|session|sprint)s? ?#?\d+\b|(?<![\w-])20\d\d-[01]\d-[0-3]\d(?![\w-])", re.I)


def _work_log_refs(paths) -> list[str]:
    found = []
    for path in paths:
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORK_LOG.search(line):
                found.append(f"{_rel(path)}:{i}: {line.strip()[:120]}")
    return found


def test_no_work_log_references_in_docs_and_code():
    trees = [ROOT / t for t in ("src", "python", "lab", "examples")]
    paths = [p for t in trees for p in t.rglob("*") if p.suffix in (".rs", ".py", ".pyi", ".md")
             and "target" not in p.parts and p.name != "test_docs.py"]
    found = _work_log_refs(DOCS + paths)
    assert not found, "work-log references (keep the measured reason, drop the tracker number or date):\n" + \
        "\n".join(found)


def test_the_work_log_check_catches_one(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Measured in session 36 (issue 34), 2026-11-29.\nA 3-session job and issue-free text.\n")
    assert len(_work_log_refs([doc])) == 1


def test_the_protocol_version_the_docs_quote_is_the_code_s():
    # `gradhub --version` as the docs quote it, against the wire protocol's version in the core.
    code = re.search(r"pub const VERSION: u8 = (\d+);", (ROOT / "src" / "protocol" / "frame.rs").read_text())
    assert code, "src/protocol/frame.rs: no VERSION"
    quoted = [(d.name, m.group(1)) for d in DOCS for m in re.finditer(r"\(protocol (\d+)\)", d.read_text())]
    assert ("README.md", code.group(1)) in quoted, "README.md quotes no `(protocol N)`"
    assert all(v == code.group(1) for _, v in quoted), (quoted, code.group(1))
