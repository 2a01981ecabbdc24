"""The examples run end to end: examples/finetune_llama trains a Hugging Face Llama, checkpoints and exports it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "finetune_llama" / "train.py"


@pytest.mark.slow
def test_finetune_llama_trains_checkpoints_and_exports(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}  # one process, whatever launched us
    command = [sys.executable, str(LLAMA), "--steps", "3", "--seq-len", "32", "--save-every", "2"]
    command += ["--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # --save-every 2 over 3 steps: step 2, and the last step; `latest` marks a complete checkpoint.
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step_2", "step_3"}
    assert (out / "checkpoints" / "step_3" / "step00000003" / "meta.json").is_file()
    assert (out / "checkpoints" / "step_3" / "latest").read_text() == "step00000003\n"
    assert "from_pretrained loads it and generates" in result.stdout

    spec = importlib.util.spec_from_file_location("finetune_llama_train", LLAMA)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loaded = LlamaForCausalLM.from_pretrained(out / "hf")
    assert loaded.state_dict().keys() == example.build_model(32).state_dict().keys()
