"""Module 4's bf16 and 8-bit Adam moments in the engine (`zero_offload.cpu_adam.states`): where they live, what
they take, that every tier steps them, and that checkpoints keep them in their own precision.

The kernel itself is tested against the readable reference in test_state_precision.py; here the question is the
wiring: the states really narrow and on the host, the C Adam really updating them (decoded, they follow the fp32
run's moments within the quantization's bound), and saving, loading and resharding losing nothing.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import check, run_ranks
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.basics.memory import moment_scales
from zero_offload.config import ConfigError
from zero_offload.implementation.durable import CheckpointError
from zero_offload.tuning.build import CPUAdamUnavailable
from zero_offload.tuning.moment_codec import MomentCodec
from zero_offload.tuning.state_precision import BLOCK
from zero_offload.workloads import ByteBatches, TinyGPT, gpt_config, lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*pin.*")
BATCH = 4
BATCHES = ByteBatches(fixed_corpus(), 32, seed=5)
CPU = {"device": "cpu"}
# d_model 72: the embedding's 256 x 72 = 18432 elements make shards of 9216 on two ranks, 4.5 blocks, so that
# rank 1's shard starts inside a block of the one-rank layout (blocks cross the shard boundary).
MODEL = {"d_model": 72, "n_head": 2, "n_layer": 1}


def _config(states="fp32", stage=2, precision="bf16", zero_offload=None, **zero):
    zero = {"offload_optimizer": CPU, **zero}
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, **zero},
        "zero_offload": {**(zero_offload or {}), "cpu_adam": {"states": states}},
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine(config, seed=0):
    model = TinyGPT(gpt_config("nano", **MODEL), seed=seed)
    return zo.initialize(model, config, accelerator=EmulatedAccelerator())


def _train(engine, steps, rank=0, world_size=1):
    losses = []
    for step in steps:
        x, y = BATCHES.micro_batch(step, BATCH // world_size, rank=rank, world_size=world_size)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _moments(engine):
    """Each master piece's (m, v), decoded to fp32, in order (NVMe: read back from the files)."""
    codec, found = MomentCodec(), []
    for index in engine.states.each_unit():
        state = engine.optimizer.state[engine.states.master_params[index]]
        piece = {key: value for key, value in state.items() if key != "step"}
        n = piece["exp_avg"].numel()
        if "exp_avg_scale" in piece:
            piece["block_offset"] = 0
        decoded = codec.decode_piece(piece)
        found.append((decoded["exp_avg"][:n].clone(), decoded["exp_avg_sq"][:n].clone()))
    return found


def _bound(m: torch.Tensor, v: torch.Tensor, states: str) -> tuple[torch.Tensor, torch.Tensor]:
    """How far a stored moment may be from the fp32 one after one encode: half a bf16 ulp; half an int8 code of
    its block's scale (v: of sqrt v, squared out)."""
    if states == "bf16":
        return m.abs() * 2**-8 + 1e-30, v.abs() * 2**-8 + 1e-30
    scale_m = _per_element_max(m.abs())
    root = v.sqrt()
    scale_v = _per_element_max(root)
    step_root = scale_v / 255 / 2
    return scale_m / 127 / 2 * 1.001 + 1e-30, (2 * root * step_root + step_root**2) * 1.001 + 1e-30


def _per_element_max(x: torch.Tensor) -> torch.Tensor:
    blocks = math.ceil(x.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK)
    padded[: x.numel()] = x
    return padded.view(blocks, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[: x.numel()]


# -- where they live, what they take ---------------------------------------------------------------------------
@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_the_moments_are_narrow_host_tensors_and_the_master_stays_fp32(states):
    engine = _engine(_config(states))
    m_dtype, v_dtype = {"bf16": (torch.bfloat16,) * 2, "int8": (torch.int8, torch.uint8)}[states]
    for master in engine.states.master_params:
        state = engine.optimizer.state[master]
        assert master.dtype == torch.float32 and master.device.type == "cpu"
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (m_dtype, v_dtype)
        assert state["exp_avg"].device.type == "cpu"
        if states == "int8":  # one fp32 scale per block of each unit, counted from the unit's start
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                assert state[key].dtype == torch.float32
                assert state[key].numel() == math.ceil(master.numel() / BLOCK)
        else:
            assert "exp_avg_scale" not in state
    engine.close()


def test_the_ledger_counts_the_narrow_bytes_and_matches_the_estimate():
    """Host bytes of master + m + v per element of the shard: 12 in fp32, 8 in bf16, 6 plus the scales in int8."""
    per_element = {}
    for states in ("fp32", "bf16", "int8"):
        engine = _engine(_config(states))
        measured = engine.memory_report().measured.bytes
        shard = sum(unit.shard_numel for unit in engine.states.units)
        optimizer = sum(measured[s]["host"] for s in ("master_weights", "exp_avg", "exp_avg_sq"))
        per_element[states] = optimizer / shard
        scales = sum(2 * 4 * moment_scales(unit.shard_numel, states) for unit in engine.states.units)
        assert optimizer == {"fp32": 12, "bf16": 8, "int8": 6}[states] * shard + scales
        estimated = engine.memory_report().estimated.bytes
        for state in ("exp_avg", "exp_avg_sq"):  # the estimate counts one scale per block of the whole shard
            assert abs(estimated[state]["host"] - measured[state]["host"]) <= 4 * len(engine.states.units) + (
                engine.states.padding["shard"] * {"fp32": 4, "bf16": 2, "int8": 1}[states]
            )
        engine.close()
    assert per_element["fp32"] == 12 and per_element["bf16"] == 8 and per_element["int8"] < 6.1


# -- every tier steps them ---------------------------------------------------------------------------------------
TIERS = {
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3-offload-param": dict(stage=3, offload_param=CPU),
    "partial-offload": dict(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.5}),
    "pipeline": dict(stage=2, zero_offload={"overlap_offload": True}),
    "delayed-update": dict(
        stage=2, zero_offload={"delayed_param_update": {"enabled": True, "start_step": 1}}
    ),
    "fp16-loss-scaling": dict(stage=2, precision="fp16"),
}


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_every_tier_updates_the_narrow_moments_as_fp32_would(tier, states):
    """After one step m = (1 - beta1) g and v = (1 - beta2) g^2 in any precision: the narrow run's decoded
    moments must be the fp32 run's within one rounding. Three steps on, the losses still follow."""
    runs, losses = {}, {}
    for precision in ("fp32", states):
        engine = _engine(_config(precision, **TIERS[tier]))
        losses[precision] = _train(engine, range(1))
        runs[precision] = _moments(engine)
        losses[precision] += _train(engine, range(1, 4))
        engine.close()
    # A partial offload's device units keep fp32 moments (torch's Adam updates them there): equal within the bound.
    for (m, v), (m_narrow, v_narrow) in zip(runs["fp32"], runs[states], strict=True):
        bound_m, bound_v = _bound(m, v, states)
        assert ((m_narrow - m).abs() <= bound_m).all()
        assert ((v_narrow - v).abs() <= bound_v).all()
    assert any(m.abs().sum() > 0 for m, _ in runs[states])  # a step happened
    assert losses[states] == pytest.approx(losses["fp32"], rel=1e-3)


def test_the_nvme_tier_keeps_narrow_files(tmp_path):
    config = _config("int8", offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    engine = _engine(config)
    fp32 = _engine(_config("fp32"))
    _train(engine, range(2))
    _train(fp32, range(2))
    files = sorted(p.name for p in (tmp_path / "zero_offload_rank0").iterdir())
    kinds = {name.split(".", 1)[1] for name in files}
    assert kinds == {"master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"}
    sizes = {kind: sum((tmp_path / "zero_offload_rank0" / n).stat().st_size for n in files if n.endswith(kind))
             for kind in kinds}  # fmt: skip
    assert sizes["exp_avg"] == sizes["exp_avg_sq"] == sizes["master"] // 4  # one byte against four
    for (m, v), (m8, v8) in zip(_moments(fp32), _moments(engine), strict=True):
        assert (m8 - m).abs().max() <= m.abs().max() * 0.05
        assert (v8 - v).abs().max() <= v.abs().max() * 0.05
    engine.close()
    fp32.close()


# -- checkpoints ---------------------------------------------------------------------------------------------------
def _raw(engine):
    """Every stored tensor of every master piece, bit for bit."""
    found = []
    for index in engine.states.each_unit():
        state = engine.optimizer.state[engine.states.master_params[index]]
        found.append({k: (v.clone() if v.dim() else float(v)) for k, v in state.items()})
        found[-1]["master"] = engine.states.master_params[index].clone()
    return found


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_a_checkpoint_round_trips_bit_for_bit_in_its_own_precision(tmp_path, states):
    engine = _engine(_config(states))
    _train(engine, range(3))
    engine.save_checkpoint(tmp_path)
    saved = torch.load(next(tmp_path.glob("*/rank00000-of-00001.pt")), weights_only=True)
    piece = next(iter(saved["pieces"].values()))[0]
    assert saved["moments"] == states and piece["exp_avg"].dtype != torch.float32  # its own precision
    fresh = _engine(_config(states), seed=1)
    fresh.load_checkpoint(tmp_path)
    for got, expected in zip(_raw(fresh), _raw(engine), strict=True):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key
    assert _train(fresh, range(3, 5)) == _train(engine, range(3, 5))


def test_loading_into_another_precision_converts_with_a_warning(tmp_path):
    engine = _engine(_config("fp32"))
    _train(engine, range(2))
    engine.save_checkpoint(tmp_path / "fp32")
    expected = _moments(engine)
    narrow = _engine(_config("int8"))
    with pytest.warns(UserWarning, match="keeps Adam's m and v in fp32 and this run in int8"):
        narrow.load_checkpoint(tmp_path / "fp32")
    for (m, v), (m8, v8) in zip(expected, _moments(narrow), strict=True):
        bound_m, bound_v = _bound(m, v, "int8")
        assert ((m8 - m).abs() <= bound_m).all() and ((v8 - v).abs() <= bound_v).all()
    narrow.save_checkpoint(tmp_path / "int8")
    back = _engine(_config("fp32"))
    with pytest.warns(UserWarning, match="in int8 and this run in fp32"):
        back.load_checkpoint(tmp_path / "int8")
    for (m8, v8), (m, v) in zip(_moments(narrow), _moments(back), strict=True):
        assert torch.equal(m, m8) and torch.equal(v, v8)  # fp32 holds every int8 value exactly


def test_a_damaged_block_offset_is_named(tmp_path):
    engine = _engine(_config("int8"))
    _train(engine, range(1))
    engine.save_checkpoint(tmp_path)
    (file,) = tmp_path.glob("*/rank00000-of-00001.pt")
    saved = torch.load(file, weights_only=True)
    name = max(saved["pieces"], key=lambda n: saved["pieces"][n][0]["exp_avg"].numel())
    saved["pieces"][name][0]["block_offset"] = BLOCK - 1  # one block more than its scales cover
    torch.save(saved, file)
    with pytest.raises(CheckpointError, match=f"piece of {name} does not hold readable 8-bit moments"):
        _engine(_config("int8")).load_checkpoint(tmp_path)


def _save_at_two(rank, world_size, directory):
    engine = _engine(_config("int8"))
    _train(engine, range(3), rank, world_size)
    engine.save_checkpoint(directory)
    straight = _train(engine, range(3, 5), rank, world_size)
    crossing = [
        unit.layout.slices[0].param_start % BLOCK
        for unit in engine.states.units
        if unit.layout.slices and unit.layout.slices[0].param_start
    ]
    return {"straight": straight, "crossing": crossing}


@pytest.mark.slow
def test_a_two_rank_int8_checkpoint_loads_at_one_rank_with_blocks_cut_across_the_shards(tmp_path):
    results = check(run_ranks(_save_at_two, 2, str(tmp_path), timeout_s=180))
    assert any(offset % BLOCK for offset in results[1]["crossing"])  # the test is about these
    one = _engine(_config("int8"), seed=1)
    one.load_checkpoint(tmp_path)
    # The same training at one rank on the whole batch, m and v re-encoded in blocks of the one-rank units.
    expected = [(a + b) / 2 for a, b in zip(results[0]["straight"], results[1]["straight"], strict=True)]
    assert _train(one, range(3, 5)) == pytest.approx(expected, rel=2e-3)


# -- what is refused -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "fix"),
    [
        (
            _config("int8", stage=0, offload_optimizer={"device": "none"}),
            '"offload_optimizer": {"device": "cpu"}',
        ),
        (_config("bf16", offload_optimizer={"device": "none"}), '"offload_optimizer": {"device": "cpu"}'),
        (
            {**_config("int8"), "zero_offload": {"cpu_adam": {"states": "int8", "impl": "torch"}}},
            '"impl": "simd"',
        ),
    ],
)
def test_impossible_combinations_are_refused_by_name(config, fix):
    with pytest.raises(NotImplementedError, match="zero_offload.cpu_adam.states") as err:
        _engine(config)
    assert fix in str(err.value)


def test_a_misspelt_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="allowed values: fp32, bf16, int8"):
        _engine(_config("int4"))


def test_without_the_c_adam_narrow_moments_fail_instead_of_falling_back(monkeypatch):
    def no_compiler():
        raise CPUAdamUnavailable("no C compiler found (tried cc, gcc, clang)")

    monkeypatch.setattr("zero_offload.tuning.cpu_adam.build", no_compiler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback to torch's Adam either
        with pytest.raises(CPUAdamUnavailable, match='make the C Adam build .* or set "states": "fp32"'):
            _engine(_config("bf16"))
