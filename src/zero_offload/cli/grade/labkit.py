"""Lab markers: the solution code lives once, in src/, and labs/ and solutions/ are generated from it.

A marked region sits inside a function body. It opens with a comment line that reads
``BEGIN LAB 1.2: <one-line title>`` and closes with ``END LAB 1.2`` at the same indentation
(``#`` comments in Python, ``/* ... */`` in C). The comment lines right after the opening line are
the task's instructions. The learner's stub keeps the title and the instructions and replaces the code
by ``raise NotImplementedError("Lab 1.2: <title>")`` (in C, ``ZO_LAB_NOT_IMPLEMENTED("...");``);
the solution file is the src file verbatim, so ``grep -rn "Lab 1.2"`` finds stub, solution and test.

``tools/make_labs.py`` is the command line over ``generate``; grading and the meta-tests use the rest.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".py", ".c")
RECORD = ".generated.json"  # in labs/labN/: relpath -> sha256 of the stub we wrote

_ID = r"(?P<id>(?P<lab>\d+)\.\d+)"
_TITLE = r":[ \t]*(?P<title>\S.*?)"
_MARKERS = {  # suffix -> (begin, end)
    ".py": (
        re.compile(rf"^(?P<indent>[ \t]*)# BEGIN LAB {_ID}{_TITLE}\s*$"),
        re.compile(rf"^(?P<indent>[ \t]*)# END LAB {_ID}\s*$"),
    ),
    ".c": (
        re.compile(rf"^(?P<indent>[ \t]*)/\* BEGIN LAB {_ID}{_TITLE}\s*\*/\s*$"),
        re.compile(rf"^(?P<indent>[ \t]*)/\* END LAB {_ID}\s*\*/\s*$"),
    ),
}
_FORMS = {
    ".py": "'# BEGIN LAB 1.2: title' ... '# END LAB 1.2'",
    ".c": "'/* BEGIN LAB 4.1: title */' ... '/* END LAB 4.1 */'",
}
# Anything that looks like a marker but does not parse is an error, not silently ordinary code.
_LOOSE = re.compile(r"^\s*(#|//|/\*)\s*(BEGIN|END)\s+LAB\b", re.IGNORECASE)


class LabMarkerError(ValueError):
    """A marker problem, reported as ``file:line: what is wrong``."""

    def __init__(self, path: str | Path, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")


@dataclass(frozen=True)
class Region:
    task_id: str  # "1.2"
    lab: int
    title: str
    start: int  # 1-based line of the BEGIN marker
    end: int  # 1-based line of the END marker
    indent: str
    instructions: tuple[str, ...]  # the comment lines after BEGIN, as written (no line ends)


def _suffix(path: str | Path) -> str:
    suffix = Path(path).suffix
    if suffix not in _MARKERS:
        raise ValueError(f"{path}: lab markers are only read from {', '.join(SUFFIXES)} files")
    return suffix


def _instructions(body: list[str], suffix: str) -> tuple[str, ...]:
    starts = ("#",) if suffix == ".py" else ("//", "/*")
    out, in_block = [], False
    for line in body:
        text = line.strip()
        if in_block:  # inside a multi-line /* ... */
            in_block = "*/" not in text
        elif text.startswith(starts):
            in_block = text.startswith("/*") and "*/" not in text[2:]
        else:
            break
        out.append(line)
    return tuple(out)


def _check_unique(located: list[tuple[str | Path, Region]]) -> None:
    seen: dict[str, str] = {}
    for path, r in located:
        if r.task_id in seen:
            raise LabMarkerError(path, r.start, f"Lab {r.task_id} is marked twice, also at {seen[r.task_id]}")
        seen[r.task_id] = f"{path}:{r.start}"


def find_regions(text: str, path: str | Path) -> list[Region]:
    """The marked regions of one file, in order; raise LabMarkerError on any malformed marker."""
    suffix = _suffix(path)
    begin_re, end_re = _MARKERS[suffix]
    lines = text.splitlines()
    regions: list[Region] = []
    opened, start = None, 0  # the BEGIN match of the region being read, and its line
    for n, line in enumerate(lines, 1):
        begin, end = begin_re.match(line), end_re.match(line)
        if begin:
            if opened:
                raise LabMarkerError(path, n, f"nested region: Lab {opened['id']} is open since line {start}")
            opened, start = begin, n
        elif end:
            if opened is None:
                raise LabMarkerError(path, n, f"END LAB {end['id']} has no BEGIN LAB {end['id']} above it")
            if end["id"] != opened["id"]:
                raise LabMarkerError(path, n, f"END LAB {end['id']} closes Lab {opened['id']} (line {start})")
            if end["indent"] != opened["indent"]:
                raise LabMarkerError(path, n, f"END LAB {end['id']} is not indented as BEGIN (line {start})")
            # A Python stub raises where the region was: at module level that would break every import.
            if suffix == ".py" and not opened["indent"]:
                raise LabMarkerError(path, start, f"Lab {opened['id']} must be inside a function body")
            id_, indent, steps = opened["id"], opened["indent"], _instructions(lines[start : n - 1], suffix)
            regions.append(Region(id_, int(opened["lab"]), opened["title"], start, n, indent, steps))
            opened = None
        elif _LOOSE.match(line):
            raise LabMarkerError(path, n, f"malformed lab marker {line.strip()!r}; write {_FORMS[suffix]}")
    if opened:
        raise LabMarkerError(path, start, f"BEGIN LAB {opened['id']} has no END LAB {opened['id']}")
    _check_unique([(path, r) for r in regions])
    return regions


def _stub_lines(region: Region, suffix: str) -> list[str]:
    label = f"Lab {region.task_id}: {region.title}"
    message = json.dumps(label, ensure_ascii=False)  # a valid string literal in Python and in C
    if suffix == ".py":
        title, call = f"# {label}", f"raise NotImplementedError({message})"
    else:
        title, call = f"/* {label} */", f"ZO_LAB_NOT_IMPLEMENTED({message});"
    indent = region.indent
    return [f"{indent}{title}\n", *(f"{line}\n" for line in region.instructions), f"{indent}{call}\n"]


def render_stub(text: str, path: str | Path, lab: int | None = None) -> str:
    """The learner's version of a file: the regions of `lab` (all labs if None) replaced by stubs."""
    suffix = _suffix(path)
    lines = text.splitlines(keepends=True)
    for region in reversed(find_regions(text, path)):
        if lab is None or region.lab == lab:
            lines[region.start - 1 : region.end] = _stub_lines(region, suffix)
    stub = "".join(lines)
    if suffix == ".py":  # catch a region placed where a raise cannot stand, before a learner does
        try:
            compile(stub, str(path), "exec")
        except SyntaxError as err:
            raise LabMarkerError(path, err.lineno or 0, f"the stub would not compile: {err.msg}") from err
    return stub


def replace_region(text: str, task_id: str, new_body: str, path: str | Path = "<text>.py") -> str:
    """Replace the region of `task_id`, markers included, by `new_body` indented to the region's level."""
    region = next((r for r in find_regions(text, path) if r.task_id == task_id), None)
    if region is None:
        raise LabMarkerError(path, 0, f"there is no region for Lab {task_id}")
    body = [line.rstrip() for line in textwrap.dedent(new_body).strip("\n").splitlines()]
    lines = text.splitlines(keepends=True)
    lines[region.start - 1 : region.end] = [f"{region.indent}{line}\n" if line else "\n" for line in body]
    return "".join(lines)


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def scan(src_root: str | Path) -> dict[str, list[Region]]:
    """relpath -> regions, for every marked file under src_root; task ids are unique across the tree."""
    root = Path(src_root)
    found: dict[str, list[Region]] = {}
    for path in _sources(root):
        regions = find_regions(path.read_text(encoding="utf-8"), path)
        if regions:
            found[path.relative_to(root).as_posix()] = regions
    _check_unique([(root / rel, r) for rel, regions in found.items() for r in regions])
    return found


def lab_files(src_root: str | Path, lab: int) -> list[str]:
    """The files (relative to src_root) that hold at least one region of `lab`."""
    return sorted(rel for rel, regions in scan(src_root).items() if any(r.lab == lab for r in regions))


def render_lab(src_root: str | Path, lab: int) -> dict[str, tuple[str, str]]:
    """relpath -> (stub, solution) for each of lab's files."""
    out = {}
    for rel in lab_files(src_root, lab):
        path = Path(src_root) / rel
        text = path.read_text(encoding="utf-8")
        out[rel] = (render_stub(text, path, lab), text)
    return out


def write_lab(src_root: str | Path, lab: int, dest: str | Path, *, solution: bool) -> list[str]:
    """Write lab's stubs (or solutions) under dest/<relpath>: a lab directory to grade."""
    files = render_lab(src_root, lab)
    for rel, (stub, text) in files.items():
        _write(Path(dest) / rel, text if solution else stub)
    return list(files)


# --- keeping labs/ and solutions/ in step with src/ -------------------------------------------------


@dataclass
class Report:
    changes: list[str] = field(default_factory=list)  # written / removed, or (with check) would be
    kept: list[str] = field(default_factory=list)  # notices about learner-edited files left alone

    @property
    def ok(self) -> bool:
        return not self.changes


def _read(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _write(path: Path, text: str | None) -> None:
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sync(repo: Path, path: Path, want: str | None, check: bool, report: Report) -> None:
    have = _read(path)
    if have != want:
        what = "stale" if want is None else "missing" if have is None else "out of date"
        report.changes.append(f"{path.relative_to(repo).as_posix()} ({what})")
        if not check:
            _write(path, want)


def _relpaths(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in _sources(root)} if root.is_dir() else set()


def _sync_lab(repo: Path, lab: int, check: bool, force: bool, report: Report) -> None:
    files = render_lab(repo / "src" / "zero_offload", lab)
    solutions, labs = repo / "solutions" / f"lab{lab}", repo / "labs" / f"lab{lab}"
    # Nobody edits solutions by hand: they are always regenerated, and stale ones removed.
    for rel in sorted(_relpaths(solutions) | set(files)):
        _sync(repo, solutions / rel, files[rel][1] if rel in files else None, check, report)

    recorded = json.loads(_read(labs / RECORD) or "{}")
    for rel in sorted(_relpaths(labs) | set(files)):
        want, have = (files[rel][0] if rel in files else None), _read(labs / rel)
        # Differing from both what we wrote last time and what we would write now means a learner's work.
        if have not in (None, want) and _sha(have) != recorded.get(rel) and not force:
            report.kept.append(
                f"{(labs / rel).relative_to(repo).as_posix()}: you changed it, so it was left alone; "
                "to regenerate it, delete it or run `python tools/make_labs.py --force`"
            )
        else:
            _sync(repo, labs / rel, want, check, report)
    record = {rel: _sha(stub) for rel, (stub, _) in files.items()}
    text = json.dumps(record, indent=2, sort_keys=True) + "\n" if record else None
    _sync(repo, labs / RECORD, text, check, report)


def generate(repo_root: str | Path, *, check: bool = False, force: bool = False) -> Report:
    """Bring labs/labN and solutions/labN in step with src/zero_offload (with check, only report).

    A learner's edits to labs/ survive unless force is set; README.md files are never touched.
    """
    repo = Path(repo_root)
    wanted = {r.lab for regions in scan(repo / "src" / "zero_offload").values() for r in regions}
    dirs = [*repo.glob("labs/lab*/"), *repo.glob("solutions/lab*/")]
    present = {int(d.name[3:]) for d in dirs if d.name[3:].isdigit()}
    report = Report()
    for lab in sorted(wanted | present):
        _sync_lab(repo, lab, check, force, report)
    return report
