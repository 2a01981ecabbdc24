"""tools/gradient_walk.py keeps finding its way: each landmark of one gradient is reached on both paths.

The tool is how the layout's "files and hops of one gradient" are measured; a renamed landmark would make it
report a shorter walk than the real one, so a landmark it cannot reach fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gradient_walk.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("gradient_walk", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_every_landmark_is_reached_from_the_engine(overlap):
    tool = load_tool()
    found = tool.walk(overlap)
    assert set(found) == set(tool.LANDMARKS)
    for landmark, chain in found.items():
        # The host's work in the pipeline starts on a worker stream, not in the engine.
        assert chain[0].startswith(("engine/engine.py:", "accelerator/streams.py:")), (landmark, chain)
        assert len(chain) >= 2, (landmark, chain)
