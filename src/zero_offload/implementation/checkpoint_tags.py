"""Which save of a checkpoint directory is the one to load: tag folders, and `latest` naming the newest whole one.

    <dir>/step00000016/   one save (a "tag"): every rank's file and meta.json, as checkpoint.py describes
    <dir>/step00000020/   the next save
    <dir>/latest          one line of text: the tag of the newest complete save

A save writes into a new tag folder, and `latest` is replaced (a temporary file renamed over it) only once every
rank's file and meta.json are in that folder. A process killed at any moment of a save therefore leaves `latest`
naming the previous save, whole. Loading follows `latest`; a tag folder without meta.json is a save that did not
finish, and loading says that it skipped it. A directory without `latest` that holds meta.json and rank files
itself (as saves wrote them before tags, or one tag folder given directly) is loaded as it is.

Retention, by rank 0 once `latest` names the new save: the newest save and the one `latest` named before stay;
other folders of saves that did not finish, complete ones under a default tag (stepNNNNNNNN), and temporary
files of `latest` that a killed save left are removed.
A tag the caller chose is kept once complete, and a folder holding anything a save does not write is never
touched.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from .checkpoint_format import META, RANK_FILE_NAME
from .durable import CheckpointError, fsync_dir, write_temp

LATEST = "latest"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_DEFAULT_TAG = re.compile(r"step\d{8,}(-\d+)?")
_TEMP = re.compile(r"\.(.+)\.[0-9a-f]{16}\.tmp")  # durable.temp_name


def default_tag(global_steps: int, path=None) -> str:
    """stepNNNNNNNN; where `path` already holds a complete save under it (a second save at the same step, say at
    the end of a run that also saves every N steps), the first free stepNNNNNNNN-k: a save never writes over a
    complete one, and the script does not fail at its last line."""
    tag = f"step{global_steps:08d}"
    taken = 0
    while path is not None and (Path(path) / (tag if not taken else f"{tag}-{taken}") / META).is_file():
        taken += 1
    return tag if not taken else f"{tag}-{taken}"


def check_tag(tag) -> str:
    """A tag is one plain folder name: a save never writes outside its directory."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(
            f"the checkpoint tag {tag!r} is not a plain folder name: use letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit, and not {LATEST!r}"
        )
    return tag


def _ours(name: str) -> bool:
    """A file name a save writes: a rank file, meta.json, or a temporary file left by a killed save."""
    temp = _TEMP.fullmatch(name)
    name = temp.group(1) if temp else name
    return name == META or RANK_FILE_NAME.fullmatch(name) is not None


def saves_in(path: Path) -> list[Path]:
    """The folders in `path` that hold only files a save writes (a user's own folders are not among them)."""
    if not path.is_dir():
        return []
    found = []
    for folder in sorted(path.iterdir()):
        if folder.is_dir() and not folder.is_symlink() and _TAG.fullmatch(folder.name):
            names = [entry.name for entry in folder.iterdir()]
            if names and all(_ours(name) and (folder / name).is_file() for name in names):
                found.append(folder)
    return found


def read_latest(path: Path) -> str | None:
    """The tag `latest` names, or None where there is no `latest`."""
    file = path / LATEST
    if not file.is_file():
        return None
    try:
        tag = file.read_text(encoding="utf-8").strip()
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err
    if not _TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(
            f"{file} holds {tag[:80]!r}, not the name of a tag folder; it was damaged or edited"
        )
    return tag


def complete(path) -> bool:
    """Whether directory `path` has a checkpoint to load: the save `latest` names, or meta.json of its own."""
    path = Path(path)
    try:
        tag = read_latest(path)
    except CheckpointError:
        return False
    return (path / META).is_file() if tag is None else (path / tag / META).is_file()


def checkpoint_folder(path) -> Path:
    """The folder that holds the checkpoint to load from directory `path`, warning of saves that it skips."""
    path = Path(path)
    tag = read_latest(path)
    if tag is None:
        if path.is_dir() and not (path / META).exists() and not any(_ours(p.name) for p in path.iterdir()):
            _no_latest(path)
        return path  # one save's folder itself; read_meta says what is wrong if it is none
    if not (path / tag).is_dir():
        raise CheckpointError(
            f"{path / LATEST} names the save {tag}, but {path / tag} is not there: it was removed or not copied"
        )
    skipped = [
        folder.name for folder in saves_in(path) if not (folder / META).is_file() and folder.name != tag
    ]
    if skipped:
        warnings.warn(
            f"{path}: skipped {', '.join(skipped)}, a save that did not finish (no {META}); loading {tag}, "
            f"the newest complete checkpoint, which {LATEST} names",
            stacklevel=3,
        )
    return path / tag


def _no_latest(path: Path) -> None:
    saves = saves_in(path)
    if not saves:
        return
    whole = [folder.name for folder in saves if (folder / META).is_file()]
    if whole:
        raise CheckpointError(
            f"{path} has no {LATEST} file naming its newest save; pass one of its folders instead: "
            f"{', '.join(str(path / name) for name in whole)}"
        )
    raise CheckpointError(
        f"{path} holds no complete checkpoint: {', '.join(f.name for f in saves)} did not finish (no {META})"
    )


# -- writing (rank 0) ----------------------------------------------------------------------------------------
def prepare(path: Path, tag: str) -> str | None:
    """Make room for a save into `path/tag`: a folder left by a save that did not finish goes; a complete
    checkpoint or a folder of the user's stays, and the save is refused. Returns the tag `latest` names now."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        previous = read_latest(path)
    except CheckpointError:  # a damaged `latest` names nothing to keep; this save replaces it
        previous = None
    folder = path / tag
    if not folder.exists():
        return previous
    if folder not in saves_in(path):
        raise CheckpointError(
            f"{folder} exists and holds files that are not a checkpoint's; save under another tag or directory"
        )
    if (folder / META).is_file():
        raise CheckpointError(
            f"{folder} already holds a complete checkpoint, and a save never writes over one (killed halfway, "
            "it would leave neither): pass another tag, or remove that folder first"
        )
    discard(folder)
    return previous


def publish(path: Path, tag: str) -> None:
    """Point `latest` at `tag`, atomically: a reader sees the old tag or the new, never a mixture."""
    text = (tag + "\n").encode()
    os.replace(write_temp(path / LATEST, lambda file: file.write(text)), path / LATEST)
    fsync_dir(path)


def prune(path: Path, keep: set[str]) -> None:
    """The retention rule of this module's docstring, applied after `latest` moved."""
    for folder in saves_in(path):
        unfinished = not (folder / META).is_file()
        if folder.name not in keep and (unfinished or _DEFAULT_TAG.fullmatch(folder.name)):
            discard(folder)
    for file in path.iterdir():  # a temporary `latest` that a killed save left
        temp = _TEMP.fullmatch(file.name)
        if temp and temp.group(1) == LATEST and file.is_file() and not file.is_symlink():
            file.unlink(missing_ok=True)


def discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # a file that will not go leaves a folder loading skips
