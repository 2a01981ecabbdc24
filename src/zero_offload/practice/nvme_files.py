"""The NVMe tier's files (practice/nvme.py): one rank's swap directory, its files, and what each must hold.

The files are this process's scratch space, and nothing else's. A lock beside the directory (nvme_lock.py) keeps
a second job off it; a symlink in place of the directory is refused, and files are created with O_EXCL and
O_NOFOLLOW, so nothing outside it is written; remove() deletes what this object created and nothing else. Each
file's CRC-32 is kept in memory as it is written and checked as it is read back (zlib: a few GB/s on one core, on
the reader and writer threads): a file changed underneath raises instead of training on what it now holds.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import warnings
import zlib
from pathlib import Path

import torch

from ..implementation.durable import fsync_dir, host_bytes, write_temp
from ..units import format_bytes
from .nvme_lock import LockedError, SwapLock

# One file each per sub-group; module 4's 8-bit moments add a file of block scales per moment.
STATES = ("master", "exp_avg", "exp_avg_sq")
_KEY = "zero_optimization.offload_optimizer.nvme_path"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW  # a new file of ours, never one already there
_CHANGED = (
    "the swap space was modified or damaged by something other than this engine (another program or job, or "
    "the drive): resume from the last checkpoint, and check the drive and what else writes under nvme_path"
)
_FIXES = {
    errno.ENOSPC: "free space on that drive, or choose an nvme_path on a drive with more",
    errno.EDQUOT: "your disk quota is used up: free some, or choose an nvme_path outside it",
    errno.EACCES: "make that directory writable for this user, or choose another nvme_path",
    errno.EPERM: "make that directory writable for this user, or choose another nvme_path",
    errno.EROFS: "that file system is read-only: choose an nvme_path on a writable drive",
    errno.ENOTDIR: "nvme_path must be a directory, or a path where one can be made",
    errno.EEXIST: "nvme_path must be a directory, or a path where one can be made",
    errno.ELOOP: "a symbolic link stands where the NVMe tier makes its own file: remove the link",
}


class NVMeError(RuntimeError):
    """The NVMe tier cannot use its files; the message names the file, the cause and the fix."""


class NVMePathError(NVMeError, ValueError):
    """The config's nvme_path cannot be used (unwritable, full, a symlink, another job's): like a ConfigError,
    the user's to fix before training starts, so the `zo` command prints it as one line."""


def os_error(err: OSError, doing: str, path, kind: type[NVMeError] = NVMeError) -> NVMeError:
    code = errno.errorcode.get(err.errno, "unknown error")
    fix = _FIXES.get(err.errno, f"check the drive, or choose another {_KEY}")
    return kind(f"could not {doing} {path}: {err.strerror or err} ({code}); {fix}")


class SwapFiles:
    """One rank's files: subgroup<g>.<state>, each holding exactly file_bytes[state][g] bytes, and their
    checksums. `file_bytes`: per state (master, m, v, and the scales of 8-bit moments), the size of each
    sub-group's file."""

    def __init__(self, root: str, rank: int, file_bytes: dict[str, list[int]]):
        self.dir = Path(root) / f"zero_offload_rank{rank}"
        self.file_bytes = file_bytes
        self.numels = [nbytes // 4 for nbytes in file_bytes["master"]]  # the fp32 masters: one per parameter
        self.lock = SwapLock(self.dir.with_name(f"{self.dir.name}.lock"))
        self.crcs: dict[Path, int] = {}  # what each file held when this process put it in place
        self.created: set[Path] = set()  # all that remove() may delete
        self._made_dir = False
        self._tag = f"{os.getpid()}.{secrets.token_hex(4)}"  # a probe file no one else names

    def path(self, group: int, state: str) -> Path:
        return self.dir / f"subgroup{group:05d}.{state}"

    def prepare(self) -> None:
        """Make the directory and own it, prove it writable, and check there is room for the files."""
        try:
            self._own_directory()
            probe = self._create(self.dir / f".probe.{self._tag}")
            os.close(probe)
            self._unlink(self.dir / f".probe.{self._tag}")
            self._check_space()
        except BaseException:
            self.remove()
            raise

    def _own_directory(self) -> None:
        try:
            try:
                os.mkdir(self.dir)  # with the user's umask, as any directory they make
            except FileNotFoundError:
                self.dir.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(self.dir)
            self._made_dir = True
        except FileExistsError:
            pass
        except OSError as err:
            raise os_error(err, "create the swap directory", self.dir, NVMePathError) from None
        if not stat.S_ISDIR(os.lstat(self.dir).st_mode):
            raise NVMePathError(
                f"{self.dir} is a symbolic link or a file, not a directory: the NVMe tier writes and removes "
                f"files only in a real directory of its own; remove it, or point {_KEY} at the target itself"
            )
        try:
            self.lock.acquire()
        except LockedError as err:
            raise NVMePathError(
                f"the NVMe swap directory {self.dir} is in use: {err}. Two jobs on one nvme_path overwrite "
                f"each other's swap files: give this job another {_KEY}, or wait until the other one ends"
            ) from None
        except OSError as err:
            raise os_error(err, "create the lock file", self.lock.path, NVMePathError) from None

    def _check_space(self) -> None:
        paths = {self.path(g, state) for state, sizes in self.file_bytes.items() for g in range(len(sizes))}
        others = sorted(p.name for p in self.dir.iterdir() if p.name.startswith(("subgroup", ".subgroup")))
        others = [name for name in others if self.dir / name not in paths]
        if others:  # an earlier run's: another sub-group layout, or the temporaries of a crash
            warnings.warn(
                f"{self.dir} holds {len(others)} file(s) this engine did not create ({others[0]}, ...); they are "
                "left alone and take space: remove them if no other job uses them",
                stacklevel=2,
            )
        files = sum(sum(sizes) for sizes in self.file_bytes.values())
        # Every file exists twice between a step's writes and its replacements; files of an earlier run at our
        # names are replaced, so their space counts as free.
        need = 2 * files
        ours = sum(os.lstat(path).st_size for path in paths if os.path.lexists(path))
        free = shutil.disk_usage(self.dir).free + ours
        if free < need:
            raise NVMePathError(
                f"not enough free space for the NVMe tier in {self.dir}: it needs {need:,} bytes "
                f"({format_bytes(need)}: {format_bytes(files)} of fp32 master weights and Adam's m and v for "
                f"{sum(self.numels):,} parameters, twice while a step replaces them), and {free:,} bytes "
                f"({format_bytes(free)}) are free; free {format_bytes(need - free)} or choose another {_KEY}"
            )

    def _create(self, path: Path) -> int:
        try:
            fd = os.open(path, _CREATE, 0o666)
        except OSError as err:
            raise os_error(err, "write a file in", self.dir, NVMePathError) from None
        self.created.add(path)
        return fd

    def _unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.created.discard(path)

    # read() and write() raise OSError as it comes; the states turn it into an NVMeError that names the file.
    def read(self, group: int, state: str, out: torch.Tensor) -> None:
        path = self.path(group, state)
        view = host_bytes(out)
        with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb", buffering=0) as file:
            size, done = os.fstat(file.fileno()).st_size, 0
            while done < len(view) and (got := file.readinto(view[done:])):
                done += got
        if size != len(view) or done != len(view):
            raise NVMeError(f"{path} holds {size:,} bytes, {len(view):,} were expected: {_CHANGED}")
        crc, wrote = zlib.crc32(view), self.crcs.get(path)
        if crc != wrote:
            raise NVMeError(
                f"{path} does not hold what this process wrote there (CRC-32 {crc:08x}, written "
                f"{'nothing' if wrote is None else f'{wrote:08x}'}): {_CHANGED}"
            )

    def write(self, group: int, state: str, data: torch.Tensor) -> tuple[Path, Path, int]:
        """Write `data` beside its file, flushed to the drive; returns (temporary, final, CRC-32) for commit()."""
        final = self.path(group, state)
        view = host_bytes(data)
        temp = write_temp(final, lambda file: file.write(view))  # O_EXCL|O_NOFOLLOW, fsync'd, gone on failure
        self.created.add(temp)
        return temp, final, zlib.crc32(view)

    def commit(self, written: list[tuple[Path, Path, int]]) -> None:
        try:
            for temp, final, crc in written:
                os.replace(temp, final)
                self.created.discard(temp)
                self.created.add(final)
                self.crcs[final] = crc
        except OSError as err:
            self.discard(written)
            raise NVMeError(
                f"{os_error(err, 'rename', temp)}. The swap files may now mix two steps: load a checkpoint"
            ) from None
        fsync_dir(self.dir)

    def discard(self, written: list[tuple[Path, Path, int]]) -> None:
        for temp, *_ in written:
            self._unlink(temp)

    def remove(self) -> None:
        """Delete the files this object created, and nothing else, and let go of the directory."""
        for path in list(self.created):
            self._unlink(path)
        if self._made_dir:
            try:
                os.rmdir(self.dir)  # only if empty: a file someone else put there is not ours to delete
            except OSError:
                pass
            self._made_dir = False
        self.lock.release()
