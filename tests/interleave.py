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
