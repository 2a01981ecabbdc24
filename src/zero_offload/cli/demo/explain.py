"""The demo report's sentences on the schedule ratios: what each ratio says, with the cause chosen by what was
measured (the device's own work, its time blocked on events, its time runnable but off its core), never a fixed
sentence that the numbers could contradict."""

from __future__ import annotations

# Ratios within this much of 1.0 are "about the same": a shared machine drifts by a few per cent between rounds.
SAME = 0.05
SERIAL, OVERLAPPED, DELAYED = "serial", "overlapped", "delayed (DPU)"


def _speed(ratio: float) -> str:
    """'1.15x as fast as', or for a ratio below 1, 'slower: it took 1.08x as long as'."""
    if ratio >= 1:
        return f"{ratio:.2f}x as fast as"
    return f"slower: it took {1 / ratio:.2f}x as long as"


def _where(cores: str) -> str:
    if cores == "shared":
        return "the same cores and memory bandwidth (cores shared)"
    return "one memory bandwidth and cache (each side has its own core, but the two cores share those)"


def _what_grew(r: dict, base: str, other: str) -> str | None:
    """Why schedule `other` gained nothing on `base`, from what its device's thread did with the time: more work
    of its own, more time blocked on events, or more time runnable but off its core. The largest of the three
    that grew by more than SAME of the base step is named; None if none did."""
    busy, mean = r["busy_ms"], r["mean_ms"]

    def rest(name: str) -> float:
        return mean[name] - busy[name]["device"] - busy[name]["waited"]

    grew = {
        "work": busy[other]["device"] - busy[base]["device"],
        "blocked": busy[other]["waited"] - busy[base]["waited"],
        "off core": rest(other) - rest(base),
    }
    kind, ms = max(grew.items(), key=lambda item: item[1])
    if ms <= SAME * r["median_ms"][base]:
        return None
    if kind == "work":
        return (
            f"The device's own work grew from {busy[base]['device']:.1f} to {busy[other]['device']:.1f} ms of "
            f"CPU a step: the emulated device's compute and the host's Adam ran at the same time on "
            f"{_where(r['cores'])}, so what was hidden came back as slower device work."
        )
    if kind == "blocked":
        return (
            f"The device's thread was blocked {busy[other]['waited']:.1f} ms a step (against "
            f"{busy[base]['waited']:.1f} in {base}) on copies, staging slots or the host's Adam: the host's side "
            "fell behind the device's."
        )
    return (
        f"The device's thread spent {ms:.1f} ms a step more able to run but not running: each unit is handed "
        "between the pipeline's threads in Python, every handover needs the GIL"
        + (
            ", and the threads also wait for the shared cores."
            if r["cores"] == "shared"
            else " (or its core was busy with another process)."
        )
    )


def explain_schedules(r: dict) -> list[str]:
    """Plain sentences on what each ratio of compare_schedules' result `r` says, the cause chosen by what was
    measured: the per-round ratios, the CPU time each side used a step and the waits (busy_ms, mean_ms), and
    the bound (bound_ms)."""
    busy, cores = r["busy_ms"], r["cores"]
    sentences = []
    ratio = r["overlapped_vs_serial"]
    head = f"Overlapped was {_speed(ratio)} serial (median of each round's serial / overlapped time, {ratio:.2f}x)."
    if ratio >= 1 + SAME:
        cause = (
            "The host's Adam and the copies ran while the device was still in backward, so most of the serial "
            "step's tail after backward was hidden."
        )
    else:
        cause = _what_grew(r, SERIAL, OVERLAPPED) or (
            f"The host's work was small next to the device's ({busy[SERIAL]['host']:.1f} against "
            f"{busy[SERIAL]['device']:.1f} ms of CPU a serial step), so there was little to hide."
        )
    sentences.append(f"{head} {cause}")
    ratio = r["delayed_vs_overlapped"]
    head = f"DPU was {_speed(ratio)} overlapped" + (f" ({ratio:.2f}x)." if ratio < 1 else ".")
    host, device = busy[DELAYED]["host"], busy[DELAYED]["device"]
    if ratio >= 1 + SAME:
        cause = (
            "Each step's Adam ran under the next step's forward and backward, so the device no longer waited "
            "for the host at the end of a step."
        )
    elif grew := _what_grew(r, OVERLAPPED, DELAYED):
        cause = grew
    elif cores == "split" and host < device:
        cause = (
            f"The host's work ({host:.1f} ms of CPU a step) was already shorter than the device's "
            f"({device:.1f} ms) and hidden behind backward, so moving Adam a step later had little left to hide."
        )
    else:
        cause = (
            f"Both sides were busy ({device:.1f} ms device, {host:.1f} ms host of CPU a step) on {_where(cores)}: "
            "running Adam beside forward as well only moved work from one side's cores to the other's."
        )
    sentences.append(f"{head} {cause}")
    of_bound, bound = r["of_bound"][DELAYED], r["bound_ms"][DELAYED]
    head = (
        f"DPU's step took {of_bound:.2f}x its bound, {bound:.1f} ms: the busier side's CPU time a step, "
        "the shortest step its work allows."
    )
    if of_bound <= 1 + SAME:
        cause = "It hid nearly everything the other side did."
    else:
        waited = busy[DELAYED]["waited"]
        rest = r["mean_ms"][DELAYED] - device - waited
        cause = (
            f"Of the rest, the device's thread was blocked {waited:.1f} ms a step on copies, slots or the "
            f"host, and {max(rest, 0.0):.1f} ms it could have run but did not (waiting for the GIL or a core)."
        )
    sentences.append(f"{head} {cause}")
    return sentences
