"""A C Adam that cannot be built or loaded: every cause falls back to torch's Adam with one warning naming it.

Run in a fresh process each time, with an empty cache: a module already loaded in this one would be reused.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from zero_offload.tuning.build import BuildFailed, check_python_headers

SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zo.initialize(torch.nn.Linear(4, 4), cfg, accelerator=EmulatedAccelerator())
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    print(type(engine.optimizer).__name__)
    for w in caught:
        if "CPU Adam" in str(w.message):
            print("WARNING", w.message)
    """
)


def _initialize(tmp_path, **env):
    environment = {**os.environ, "ZO_CACHE_DIR": str(tmp_path / "cache"), **env}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for the compiler")
def test_a_compiler_that_fails_falls_back_naming_the_compiler(tmp_path):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc: internal compiler error' >&2\nexit 1\n")
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    out = _initialize(tmp_path, CC=str(compiler))
    assert "WARNING the SIMD CPU Adam could not be built or loaded (VerificationError" in out
    assert "check the C compiler ($CC) works" in out and "Falling back to torch.optim's fused Adam" in out


def test_a_python_without_its_headers_is_named_before_the_compiler_runs(tmp_path):
    check_python_headers(sysconfig.get_paths()["include"])  # this one has them
    with pytest.raises(BuildFailed, match=r"no Python\.h in .*nowhere.*python3-dev"):
        check_python_headers(str(tmp_path / "nowhere"))


def test_a_cache_directory_that_cannot_be_made_falls_back_naming_zo_cache_dir(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache directory should go")
    out = _initialize(tmp_path)
    assert "ZO_CACHE_DIR" in out and "Falling back to torch.optim's fused Adam" in out
