"""Input that used to raise a bare Python error, or to train silently wrong, now gets a message with the fix."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.cli import main
from zero_offload.config import ConfigError, load_config
from zero_offload.units import parse_bytes
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

BATCHES = ByteBatches(fixed_corpus(), 32, seed=3)
CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


# -- sizes and config files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [float("inf"), float("nan"), "1e400MB", "1e309"])
def test_an_infinite_byte_size_is_a_value_error_not_an_overflow(size):
    with pytest.raises(ValueError, match="not a finite byte size"):
        parse_bytes(size)


def test_an_infinite_device_memory_names_the_key(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 4, "zero_offload": {"device_memory": Infinity}}')
    with pytest.raises(ConfigError, match=r"zero_offload.device_memory: inf is not a finite byte size"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"zero_offload.device_memory: '1e400MB' is not a finite"):
        load_config({"train_batch_size": 4, "zero_offload": {"device_memory": "1e400MB"}})


def test_a_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"train_batch_size": 4, "comment": "café"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.json' is not UTF-8 text .*save it as UTF-8"):
        load_config(path)
    assert main(["train", "--config", str(path), "--model", "nano", "--out", str(tmp_path / "out")]) == 2
    assert "latin1.json' is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, path",
    [('{"train_batch_size": 4, "train_batch_size": 8}', "train_batch_size"),
     ('{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "lr": 1e-2}}}',
      "optimizer.params.lr")],
)  # fmt: skip
def test_a_key_written_twice_is_refused_naming_it(tmp_path, text, path):
    file = tmp_path / "ds_config.json"
    file.write_text(text)
    with pytest.raises(ConfigError, match="appears more than once") as info:
        load_config(file)
    assert info.value.path == path and str(info.value).startswith(path)


def test_warmup_min_lr_above_warmup_max_lr_is_refused():
    params = {"warmup_min_lr": 1e-2, "warmup_max_lr": 1e-3}
    with pytest.raises(
        ConfigError, match="warmup_min_lr 0.01 is above scheduler.params.warmup_max_lr"
    ) as info:
        load_config({**CONFIG, "scheduler": {"type": "WarmupLR", "params": params}})
    assert info.value.path == "scheduler.params.warmup_min_lr"
    load_config({**CONFIG, "scheduler": {"type": "WarmupLR", "params": {**params, "warmup_min_lr": 1e-3}}})


@pytest.mark.parametrize(
    "config, key",
    [({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                               "ratio": 0.5}}},
      "zero_optimization.offload_optimizer.ratio"),
     ({"zero_offload": {"overlap_offload": True}}, "zero_offload.overlap_offload")],
)  # fmt: skip
def test_check_config_refuses_what_initialize_refuses(tmp_path, capsys, config, key):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**CONFIG, **config}))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: zero_offload cannot run this config") and key in err and "OK" not in err


# -- the model and the engine --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(32,), (2, 4, 32), ()])
def test_tinygpt_names_the_shape_it_needs(shape):
    with pytest.raises(
        ValueError, match=r"expected shape \(batch, seq_len\) of token ids, seq_len at most 32"
    ):
        TinyGPT("nano")(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("shape", [(0, 32), (4, 0)])
def test_an_empty_batch_is_refused_before_it_makes_a_nan_loss(shape):
    engine = zo.initialize(TinyGPT("nano"), CONFIG, accelerator=EmulatedAccelerator())
    with pytest.raises(ValueError, match="the batch is empty"):
        engine(torch.zeros(shape, dtype=torch.long))
    assert engine.global_steps == 0


def test_backward_of_a_number_asks_for_the_loss_tensor():
    engine = zo.initialize(TinyGPT("nano"), CONFIG, accelerator=EmulatedAccelerator())
    with pytest.raises(TypeError, match="backward needs the loss tensor returned by the forward, got float"):
        engine.backward(1.0)


def test_a_second_backward_before_step_warns_once():
    engine = zo.initialize(TinyGPT("nano"), CONFIG, accelerator=EmulatedAccelerator())
    x, y = BATCHES.global_batch(0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one backward, one step: nothing to say
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.backward(lm_loss(engine(x), y))
    with pytest.warns(
        UserWarning, match=r"no engine.step\(\) between.*gradient_accumulation_steps"
    ) as caught:
        engine.backward(lm_loss(engine(x), y))
        engine.backward(lm_loss(engine(x), y))
    assert len([w for w in caught if "engine.step()" in str(w.message)]) == 1


def test_a_file_name_or_a_number_python_cannot_read_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file 'a\\\\x00b.json': embedded null byte"):
        load_config("a\0b.json")
    path = tmp_path / "huge.json"
    path.write_text('{"train_batch_size": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match=r"cannot read config file .*huge.json'.*4300 digits"):
        load_config(path)
