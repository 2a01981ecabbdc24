"""tools/figures/deepspeed_bytes.py: the engine's side of the figure is what the engine measures (lesson 3's stored
outputs), and the DeepSpeed side adds up to what chapter 3a says."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tools.figures import deepspeed_bytes as fig

REPO = Path(__file__).resolve().parents[2]
LESSON = REPO / "lessons" / "03_implementation.ipynb"
ROW = re.compile(r"^(stage .+?)\s+(nano|tiny|small)\s+([\d,]+)\s.*?([\d.]+)\s+([\d.]+)\s*$")


def _measured() -> dict[tuple[str, str], tuple[float, float]]:
    """Lesson 3, section 3: {(setup, model): (D2H bytes a parameter, H2D bytes a parameter)} as stored."""
    notebook = json.loads(LESSON.read_text(encoding="utf-8"))
    rows = {}
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))
            if "D2H/param" not in text:
                continue
            for line in text.splitlines():
                match = ROW.match(line)
                if match:
                    rows[match[1].strip(), match[2]] = (float(match[4]), float(match[5]))
    assert rows, "lesson 3's PCIe table is not in the notebook's stored outputs"
    return rows


def test_this_engines_zero2_bytes_are_the_lessons_measurement():
    measured = _measured()
    ours = fig.totals()["ZeRO-2 + offload_optimizer"]["this engine"]
    for (setup, _), (d2h, h2d) in measured.items():
        if setup == "stage 2 + offload":
            assert (d2h, h2d) == (ours["D2H"], ours["H2D"]) == (2, 2)


def test_this_engines_zero3_bytes_are_the_lessons_measurement():
    # The lesson's stage-3 run uploads a little more than 4: the tied embedding is gathered once more (its
    # share falls as the model grows). Downloads are exactly the fp16 gradient.
    measured = {model: v for (setup, model), v in _measured().items() if setup == "stage 3 + offload_param"}
    ours = fig.totals()["ZeRO-3 + offload_param + offload_optimizer"]["this engine"]
    assert measured, "no stage-3 row in lesson 3's table"
    for d2h, h2d in measured.values():
        assert d2h == ours["D2H"] == 2
        assert ours["H2D"] == 4 <= h2d < 4.3
    shares = [measured[m][1] for m in ("nano", "tiny", "small") if m in measured]
    assert shares == sorted(shares, reverse=True), "the extra gather's share should fall as the model grows"


def test_deepspeeds_bytes_are_the_chapters():
    totals = fig.totals()
    assert totals["ZeRO-2 + offload_optimizer"]["DeepSpeed"] == {"D2H": 4, "H2D": 2}
    zero3 = "ZeRO-3 + offload_param + offload_optimizer"
    assert totals[zero3]["DeepSpeed"] == {"D2H": 6, "H2D": 6}
    # Without the backward re-gather (a model whose parameters are kept from forward to backward): 4 up.
    assert fig.total(fig.DEEPSPEED_ZERO3["H2D"], only_always=True) == 4
    assert totals[zero3]["this engine"] == {"D2H": 2, "H2D": 4}


def test_every_copy_names_where_it_happens():
    """Each Copy(...) in the module sits under a comment naming a DeepSpeed file:line or this engine's file."""
    source = (REPO / "tools" / "figures" / "deepspeed_bytes.py").read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(source):
        if "Copy(" in line and "class Copy" not in line and "Copy(label" not in line:
            before = "\n".join(source[max(0, number - 8) : number + 1])
            assert re.search(r"\.py#L\d+|implementation/|principles/", before), line
