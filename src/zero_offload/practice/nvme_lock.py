"""One owner per NVMe rank directory: a lock file beside it, so that two jobs never share their swap files.

Two jobs given the same nvme_path would each rewrite the other's files between its own writes and reads, and
both would train on garbage without an error. The lock is flock() on DIR/zero_offload_rank<R>.lock: the kernel
drops it when its owner dies, however it dies, so a lock a killed job left behind is simply taken over. The
file holds the owner's pid and host, to name it in the error. Where there is no fcntl (Windows), the file's
existence is the lock and a pid that no longer runs marks it stale.
"""

from __future__ import annotations

import atexit
import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_held: set[SwapLock] = set()  # released at exit: the pid-file fallback has no kernel to do it


class LockedError(RuntimeError):
    """Another live process owns the directory; the message names it."""


class SwapLock:
    def __init__(self, path: Path):
        self.path, self.fd = Path(path), None

    def acquire(self) -> None:
        """Own the lock, or raise LockedError naming its live owner. OSError as it comes (an unwritable path)."""
        for _ in range(100):  # each retry means the file was replaced meanwhile by an owner that let go
            fd = self._open()
            if fd is None:
                continue
            if fcntl is not None and not self._flock(fd):
                owner = self._owner(fd)
                os.close(fd)
                raise LockedError(owner)
            try:  # an owner that let go unlinks the file: a lock on that old file would guard nothing
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise LockedError(f"the lock file {self.path} keeps changing")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self.fd = fd
        _held.add(self)

    def release(self) -> None:
        if self.fd is None:
            return
        _held.discard(self)
        try:
            os.unlink(self.path)  # while still holding it, so no one takes the file that is going away
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def _open(self) -> int | None:
        flags = os.O_RDWR | _NOFOLLOW
        try:
            return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, flags)  # a symlink in its place fails here (ELOOP)
        except FileNotFoundError:
            return None
        if fcntl is None and _alive(self._pid(fd)):
            owner = self._owner(fd)
            os.close(fd)
            raise LockedError(owner)
        return fd

    @staticmethod
    def _flock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @staticmethod
    def _pid(fd: int) -> int | None:
        words = _words(fd)
        return int(words[0]) if words and words[0].isdigit() else None

    def _owner(self, fd: int) -> str:
        pid, host = self._pid(fd), " ".join(_words(fd)[1:2]) or "an unknown host"
        if pid == os.getpid() and host == socket.gethostname():
            return f"another engine of this process (pid {pid}) holds {self.path}: close it (engine.close()) first"
        command = ""
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            command = f", command: {b' '.join(words).decode(errors='replace').strip()}"
        except (OSError, TypeError):
            pass
        return f"process {pid or '(unknown pid)'} on {host}{command} holds {self.path}"


def _words(fd: int) -> list[str]:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 512).decode(errors="replace").split()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, under another user
    return True


@atexit.register
def _release_all() -> None:
    for lock in list(_held):
        lock.release()
