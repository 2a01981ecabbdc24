"""Files written so that a crash, a full disk or a planted link loses nothing already saved.

Every file the engine keeps (checkpoint pieces, meta.json, NVMe swap files, a run's history) is first written in
full to a new temporary file beside its final name, flushed to disk, and only then renamed over the old one; a
failure at any point leaves the old file as it was. The errors name the file, the cause and the fix.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used here; the message names the file and the fix."""


WRITE_FIXES = {
    errno.ENOSPC: "free some space on that disk or save to another directory",
    errno.EACCES: "make the directory writable or save to another one",
    errno.EROFS: "that file system is read-only; save to another directory",
    errno.EEXIST: "something else keeps creating files under the names tried: check who can write there",
}


def write_error(target: Path, err: OSError, outcome: str) -> CheckpointError:
    """The error for a failed write of `target`, with the fix for its cause and what became of the save."""
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(target) else ""
    fix = WRITE_FIXES.get(err.errno, "check that the directory can be created and written")
    return CheckpointError(f"could not write {target}{where}: {err.strerror or err}; {fix}. {outcome}")


def temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.{secrets.token_hex(8)}.tmp")


def write_temp(final: Path, write) -> Path:
    """write(file) into a new temporary file beside `final`, flushed to disk; the caller renames it into place."""
    # Beside the target so the rename stays on one file system, where it is atomic. O_EXCL: whatever already
    # has the name, a link planted there included, makes the call fail instead of being written through; the
    # random name makes that a retry, not a refusal. os.open applies the user's umask, as for any file they
    # write (mkstemp would make it private).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(8):
        temp = temp_name(final)
        try:
            fd = os.open(temp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "every temporary name tried was taken", str(temp))
    try:  # from here on the file is ours to remove
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy: for files and checksums. Not through
    `tensor.numpy()`: torch does not need numpy, and a bare machine (a GPU box's own Python) may lack it."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"host_bytes needs a contiguous CPU tensor, got {tensor.device} {tuple(tensor.stride())}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    raw.tensor = tensor  # the view keeps `raw` alive, and `raw` the tensor whose memory it is
    return memoryview(raw).cast("B")


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable: it is so only once the directory itself is flushed."""
    try:  # not every platform lets us open a directory
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def os_error_behind(err: BaseException) -> OSError | None:
    """The OSError behind `err`: torch.save's zip writer reports a failed write as a RuntimeError ("unexpected
    pos ..."), with the OSError only as its context."""
    while err is not None and not isinstance(err, OSError):
        err = err.__cause__ or err.__context__
    return err


def mount_point(directory: Path) -> Path:
    """The mount point of the file system `directory` is on: the disk a full-disk error names."""
    directory = directory.resolve()
    while not directory.is_mount() and directory != directory.parent:
        directory = directory.parent
    return directory
