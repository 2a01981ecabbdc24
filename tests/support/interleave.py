"""Forcing an interleaving of two emulated streams, so that a missing wait fails every time, not on a slow day.

`held_until_quiet(held, runner)` holds one stream shut while the code under test runs; a helper thread opens it
only once `runner` has run everything its waits allow. Code that forgot to make `runner` wait for `held` has by
then read (or overwritten) what `held` had not yet written (or read): the wrong data, every time. Correct code has
`runner` stuck on `held`'s event, so opening the hold lets both finish.
"""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def held_until_quiet(held, runner, *, after: int = 1, timeout: float = 60.0):
    """Hold `held` for the block; release it once `runner` has been given `after` more items and is quiet.

    The block may itself wait for `held` (the engine's step waits for its uploads): the release comes from a
    helper thread. A runner that never goes quiet is a hang, reported after `timeout` seconds."""
    hold = held.hold()
    target = runner.submitted + after
    failure: list[BaseException] = []

    def release_when_quiet():
        try:
            runner.wait_quiet(submitted=target, timeout=timeout)
        except BaseException as err:  # reported by the block's thread, never left holding the stream
            failure.append(err)
        finally:
            hold.release()

    helper = threading.Thread(target=release_when_quiet, name="release-when-quiet", daemon=True)
    helper.start()
    try:
        yield hold
    except BaseException:
        hold.release()  # the block failed on its own: let the held stream drain, do not wait for the helper
        raise
    helper.join()
    if failure:
        raise failure[0]


@contextlib.contextmanager
def deferred_gathers():
    """Every asynchronous all-gather lands only when it is waited for; until then its buffer holds NaN.

    The collective itself runs at once, in the same order on every rank, into a buffer of its own: only its
    landing is held back. Code that reads a prefetched unit without waiting for its gather reads NaN, every time,
    however fast the network is. Use it inside a rank's process (it patches that process's Comm)."""
    import torch

    from zero_offload.principles.comm import Comm

    original = Comm.all_gather

    def all_gather(self, full, shard, *, async_op=False):
        if not async_op:
            return original(self, full, shard)
        landed = torch.empty_like(full)
        original(self, landed, shard)
        full.fill_(float("nan"))  # what a buffer still being written holds, as far as a reader can tell
        return _Landing(full, landed)

    Comm.all_gather = all_gather
    try:
        yield
    finally:
        Comm.all_gather = original


class _Landing:
    """The handle of a deferred gather: wait() copies the gathered values into place."""

    def __init__(self, full, landed):
        self.full, self.landed = full, landed

    def is_completed(self) -> bool:
        return self.landed is None

    def wait(self) -> bool:
        if self.landed is not None:
            self.full.copy_(self.landed)
            self.landed = None
        return True
