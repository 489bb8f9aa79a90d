"""The docs name files that exist: every path to a module, package or test file written in README.md and
docs/*.md, and every `python -m` module they tell a reader to run, is in the tree; README's Layout names every
package under appliance/ and every module of its root. Files move (a package split, tests mirroring the packages)
and prose that names them rots silently; this keeps it in step at no cost (no server, no model: text only).

What counts as a path (in the text, code blocks included):
- `appliance/...py`, `tests/...py`, `bench/...py`, `export/...py`: that file;
- `appliance/.../`: that package;
- a short path inside the package tree, `server/jobs.py` or `engine/text.py` (how architecture.md and the layout
  write them): some file of appliance/, export/, bench/ or tests/ ends with it;
- a bare module name, `jobs.py`: some file of the tree has that name;
- a dotted name `appliance.x.y` or `bench.x`: an importable module or package, or an attribute of one (a
  lower-case name under a package that holds no such module is a module that is gone)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("appliance", "export", "bench", "tests", "docker", "deploy", "systemd")
# The run-by-run log names files as they were on the day of each run: a record, not a map of today's tree.
HISTORY = {"performance-log.md"}
# Written like folders but not ours: litellm's model-name prefixes, and what the benchmarks write at run time.
NOT_FOLDERS = {"anthropic/", "ollama/", "ollama_chat/", "bench/results/"}

PATH = re.compile(r"(?<![\w/.-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_]\w*\.py)\b")
PACKAGE = re.compile(r"(?<![\w/.-])(appliance/(?:\w+/)+)(?![\w.])")
FOLDER = re.compile(r"`((?:[A-Za-z_]\w*/)+)`")  # `server/encoders/`, `engine/`, `tests/runtime/`
# `python -m appliance.pull`, `bench.kernels`, `appliance.runtime.engine.Engine`; not `appliance.choice` (a span
# attribute), `appliance.serve` (a logger) or `appliance.service` (a unit): two parts count only after `-m`.
DOTTED = re.compile(r"(?:-m |(?<![\w./-]))((?:appliance|bench)(?:\.\w+)+)")
RUN = re.compile(r"-m ((?:appliance|bench)(?:\.\w+)+)")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in HISTORY)]


@cache
def tree_dirs() -> tuple[str, ...]:
    return tuple(
        str(p.relative_to(ROOT)) + "/"
        for top in TREES
        for p in [ROOT / top, *(ROOT / top).rglob("*")]
        if p.is_dir() and "__pycache__" not in p.parts
    )


@cache
def tree_files() -> tuple[str, ...]:
    return tuple(
        str(p.relative_to(ROOT)) for top in TREES for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts
    )


def path_exists(path: str) -> bool:
    if path.startswith(tuple(f"{top}/" for top in TREES)):
        return (ROOT / path).is_file()
    if "/" in path:
        return any(f.endswith("/" + path) for f in tree_files())
    return any(f == path or f.endswith("/" + path) for f in tree_files())


def folder_exists(path: str) -> bool:
    """A folder of the repository (`deploy/`), or one inside its trees, however much of its path is written."""
    return (ROOT / path).is_dir() or any(d == path or d.endswith("/" + path) for d in tree_dirs())


def dotted_exists(name: str) -> bool:
    parts = name.split(".")
    here = ROOT / parts[0]
    for part in parts[1:]:
        if (here / f"{part}.py").is_file():
            return True  # a module: what follows is an attribute of it
        if (here / part / "__init__.py").is_file():
            here = here / part
            continue
        return not part.islower()  # a class or constant of the package; a lower-case miss is a module that is gone
    return True


def named_paths(text: str) -> set[str]:
    return {m for m in PATH.findall(text) if not m.startswith(("/", "."))}


def missing_in(doc: Path) -> list[str]:
    text = doc.read_text()
    gone = [p for p in sorted(named_paths(text)) if not path_exists(p)]
    gone += [p for p in sorted(set(PACKAGE.findall(text))) if not (ROOT / p / "__init__.py").is_file()]
    folders = set(FOLDER.findall(text)) - set(PACKAGE.findall(text)) - NOT_FOLDERS
    gone += [p for p in sorted(folders) if not folder_exists(p)]
    dotted = {d for d in DOTTED.findall(text) if d.count(".") >= 2 or d.startswith("bench.")} | set(RUN.findall(text))
    gone += [d for d in sorted(dotted) if not dotted_exists(d)]
    return gone


def test_every_path_in_the_docs_exists():
    missing = {doc.name: gone for doc in documents() if (gone := missing_in(doc))}
    assert not missing, f"docs name files that are not in the tree: {missing}"


def layout() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Layout")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def bullets(section: str) -> list[str]:
    """The Layout's top-level bullets, each with its continuation lines."""
    out: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            out.append(line)
        elif out and line.startswith(" "):
            out[-1] += "\n" + line
    return out


def packages() -> list[Path]:
    base = ROOT / "appliance"
    return sorted(p.parent.relative_to(base) for p in base.rglob("__init__.py") if p.parent != base)


def test_readme_layout_names_every_package_and_root_module():
    section = layout()
    items = bullets(section)
    unnamed = []
    for pkg in packages():
        top, *sub = pkg.parts
        if not sub:
            if f"`appliance/{top}/`" not in section:
                unnamed.append(f"appliance/{pkg}/")
            continue
        own = [b for b in items if b.startswith(f"- `appliance/{top}/`")]
        if f"appliance/{pkg}/" not in section and not any(f"`{pkg.name}/`" in b for b in own):
            unnamed.append(f"appliance/{pkg}/")
    root = next((b for b in items if b.startswith("- `appliance/*.py`")), "")
    unnamed += [
        f"appliance/{m.name}"
        for m in sorted((ROOT / "appliance").glob("*.py"))
        if m.name != "__init__.py" and f"`{m.name}`" not in root
    ]
    assert not unnamed, f"README's Layout does not name: {unnamed}"


def test_the_checks_catch_a_moved_file():
    """The matchers themselves: a name that is gone fails, one that is there passes, in each form."""
    assert path_exists("appliance/runtime/engine/core.py") and not path_exists("appliance/runtime/engine/gone.py")
    assert path_exists("engine/core.py") and not path_exists("engine/gone.py")
    assert path_exists("core.py") and not path_exists("no_such_module_anywhere.py")
    assert dotted_exists("appliance.runtime.engine.Engine") and dotted_exists("appliance.params.SamplingParams")
    assert not dotted_exists("appliance.runtime.no_such_module")
    assert named_paths("see `server/jobs.py` and tests/x/test_y.py::test_z") == {"server/jobs.py", "tests/x/test_y.py"}


def anchors(doc: Path) -> set[str]:
    """The #anchors GitHub makes of a page's headings (code blocks' `#` lines are not headings)."""
    found, code = set(), False
    for line in doc.read_text().splitlines():
        code ^= line.lstrip().startswith("```")
        if not code and (m := re.match(r"#{1,6} (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_links_between_the_docs_resolve():
    """A link to another page of the docs, or to a heading, still lands: a heading renamed or a page split
    (performance.md and its log) would otherwise leave the link pointing nowhere."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([^)\s]+))?\)", doc.read_text()):
            page = (doc.parent / target).resolve() if target else doc
            if not page.is_file() or (anchor and anchor not in anchors(page)):
                broken.append(f"{doc.name} -> {target}#{anchor}")
    assert not broken, broken
