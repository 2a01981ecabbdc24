"""Module 5: the overlapped offload pipeline and the delayed parameter update.

The pipeline changes only *when* each piece runs, never what it computes: every run here must end with the
same weights, bit for bit, as module 3's serial step. The delayed update changes what is computed, in one
precise way: after its warm-up, each step applies a gradient taken on the weights one update old, and an
explicit reference written with plain torch does exactly that.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zero_offload as zo
import zero_offload.engine.optimizer_step
from tests.support.corpus import fixed_corpus
from tests.support.distributed import check, run_ranks
from tests.support.interleave import held_until_quiet
from tests.support.training import BATCH, SEQ, make_config, train_delayed, train_run
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.config import ConfigError
from zero_offload.practice.early_uploads import EarlyUploads
from zero_offload.practice.pipeline import HostQueue, OffloadPipeline, SlotRing
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

CPU = {"device": "cpu"}


def _config(stage, precision="fp32", *, overlap=False, impl="simd", clip=0.0, ext=None, **zero):
    zero.setdefault("offload_optimizer", CPU)
    config = make_config(stage, precision, **zero)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config["gradient_clipping"] = clip
    config["zero_offload"] = {"cpu_adam": {"impl": impl}, "overlap_offload": overlap, **(ext or {})}
    return config


def _same_weights(a: dict, b: dict) -> list[str]:
    """Names of the weights that differ in any bit."""
    return [name for name in b if not torch.equal(a[name], b[name])]


def _serial_and_overlapped(rank, world_size, stage, precision, steps, accumulation, kwargs):
    serial_ext = {k: v for k, v in kwargs.get("ext", {}).items() if k != "staging_slots"}  # pipeline only
    serial = {**kwargs, "ext": serial_ext}
    return [
        train_run(rank, world_size, _config(stage, precision, overlap=overlap, **args), steps, accumulation)
        for overlap, args in ((False, serial), (True, kwargs))
    ]


CASES = {  # name -> (stage, precision, accumulation, extra config)
    "stage1-fp32": (1, "fp32", 1, {}),
    "stage2-fp32": (2, "fp32", 1, {}),
    "stage3-fp32": (3, "fp32", 1, {}),
    "stage2-bf16": (2, "bf16", 1, {}),
    "stage2-fp16-clip": (2, "fp16", 1, {"clip": 0.5}),
    "stage2-fp32-accumulate-torch-adam": (2, "fp32", 3, {"impl": "torch"}),
    "stage2-bf16-accumulate-c-adam": (2, "bf16", 2, {}),
    "stage3-fp16-offload-param": (3, "fp16", 1, {"offload_param": CPU}),
    "stage2-fp32-partial-offload": (2, "fp32", 1, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    "stage2-bf16-four-slots": (2, "bf16", 1, {"ext": {"staging_slots": 4}}),
    "stage2-fp32-one-slot": (2, "fp32", 1, {"ext": {"staging_slots": 1}}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_overlapped_pipeline_trains_bit_for_bit_like_the_serial_step(case):
    stage, precision, accumulation, kwargs = CASES[case]
    serial, overlapped = _serial_and_overlapped(0, 1, stage, precision, 6, accumulation, kwargs)
    assert not _same_weights(overlapped["weights"], serial["weights"])
    assert overlapped["losses"] == serial["losses"]
    assert overlapped["norms"] == serial["norms"]
    assert overlapped["pcie"] == serial["pcie"]  # the same bytes cross, only earlier


@pytest.mark.parametrize("stage", [2, 3])
def test_the_overlapped_pipeline_on_two_ranks_equals_the_serial_step(stage):
    for serial, overlapped in check(run_ranks(_serial_and_overlapped, 2, stage, "fp32", 4, 1, {})):
        assert not _same_weights(overlapped["weights"], serial["weights"])
        assert overlapped["losses"] == serial["losses"]


def _engine(config, model_name="nano"):
    return zo.initialize(TinyGPT(model_name, seed=0), config, accelerator=EmulatedAccelerator())


def _train(engine, steps, start=0):
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    losses = []
    for step in range(start, start + steps):
        x, y = data.micro_batch(step, BATCH, micro_step=0, rank=0, world_size=1, accumulation=1)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _spans(engine, stage):
    return [s for s in engine._timeline.spans if s.stage == stage]


def test_without_clipping_adam_runs_while_backward_is_still_running():
    engine = _engine(_config(2, overlap=True))
    _train(engine, 2)
    backward = [s for s in _spans(engine, "backward") if s.step == 1][0]
    adam = [s for s in _spans(engine, "Adam") if s.step == 1]
    assert len(adam) == len(engine.states.units)  # unit by unit, not one call over the partition
    assert adam[0].start < backward.end, "the first unit's Adam should start before backward ends"
    down = [s for s in _spans(engine, "D2H") if s.step == 1]
    assert down[0].start < backward.end


@pytest.mark.parametrize("overlap", [False, True])
def test_without_clipping_the_c_adam_sums_the_norm_and_no_pass_of_its_own_reads_the_gradients(
    overlap, monkeypatch
):
    reference = _engine(
        _config(2, impl="torch", overlap=overlap)
    )  # torch's Adam: the norm in a pass of its own
    engine = _engine(_config(2, overlap=overlap))
    assert engine.optimizer_step.norm_in_adam and not reference.optimizer_step.norm_in_adam
    expected = _train(reference, 3)

    def separate_pass(grad):
        raise AssertionError("the norm should come from the C Adam's pass, not a pass of its own")

    for module in (
        "zero_offload.implementation.offload",
        "zero_offload.principles.zero",
        "zero_offload.practice.pipeline",
    ):
        monkeypatch.setattr(f"{module}.squared_norm", separate_pass)
    assert _train(engine, 3) == pytest.approx(expected, rel=1e-5)
    norms = [r["grad_norm"] for r in engine.history]
    assert norms == pytest.approx([r["grad_norm"] for r in reference.history], rel=1e-5)
    assert all(n > 0 for n in norms)


@pytest.mark.parametrize(
    "change",
    [{"clip": 0.5}, {"ext": {"delayed_param_update": {"enabled": True, "start_step": 1}}}, {"impl": "torch"}],
    ids=["clipping", "delayed-update", "torch-adam"],
)
def test_the_norm_has_a_pass_of_its_own_when_it_is_needed_before_adam_or_adam_is_not_the_c_one(change):
    assert not _engine(_config(2, overlap=True, **change)).optimizer_step.norm_in_adam


def test_with_clipping_adam_waits_for_the_global_norm():
    engine = _engine(_config(2, overlap=True, clip=0.5))
    _train(engine, 2)
    backward = [s for s in _spans(engine, "backward") if s.step == 1][0]
    adam = [s for s in _spans(engine, "Adam") if s.step == 1]
    assert min(s.start for s in adam) >= backward.end  # every unit needs the norm of all of them
    assert [s for s in _spans(engine, "D2H") if s.step == 1][0].start < backward.end  # copies still overlap


@pytest.mark.parametrize("slots", [None, 3])
def test_the_host_stages_through_slots_of_the_largest_unit(slots):
    engine = _engine(_config(2, "fp16", overlap=True, ext={"staging_slots": slots} if slots else None))
    _train(engine, 1)
    pipeline, states = engine.optimizer_step.pipeline, engine.states
    largest = max(u.shard_numel for u in states.units)
    for ring in (pipeline.grad_slots, pipeline.weight_slots):
        assert len(ring.buffers) == (slots or 2)  # double-buffered unless staging_slots says otherwise
        assert all(b.numel() == largest and b.dtype == torch.float16 for b in ring.buffers)
        assert not any(engine.accelerator.is_on_device(b) for b in ring.buffers)
        assert ring.uses == len(states.units)  # one use per unit and step, taken in turn


class _SlowReader:
    """A stream whose work runs `delay` seconds late, so a writer that does not wait for it overtakes it."""

    def __init__(self, delay):
        self.queue, self.delay = HostQueue("slow-reader"), delay

    def submit(self, fn, *args):
        def late():
            time.sleep(self.delay)
            return fn(*args)

        return self.queue.submit(late)


def test_a_slot_is_not_written_again_before_its_reader_has_read_it():
    ring = SlotRing([torch.zeros(4), torch.zeros(4)])
    writer, reader, seen = HostQueue("writer"), _SlowReader(0.02), []
    lock = threading.Lock()

    def read(buffer, k):
        with lock:
            seen.append((k, int(buffer[0])))

    events = []
    for k in range(6):
        slot, buffer = ring.acquire(writer, 4)
        written = writer.submit(buffer.fill_, k)
        reader.queue.wait_event(written)
        done = reader.submit(read, buffer, k)
        ring.release(slot, done)
        events.append(done)
    for event in events:
        event.wait()
    assert sorted(seen) == [(k, k) for k in range(6)]


def test_an_error_on_the_host_queue_surfaces_at_the_step_and_the_next_step_is_not_attempted(monkeypatch):
    engine = _engine(_config(2, overlap=True))
    _train(engine, 1)

    def broken(index, out, staged=None):
        raise RuntimeError("host Adam failed")

    monkeypatch.setattr(engine.optimizer_step.pipeline, "_adam", broken)
    with pytest.raises(RuntimeError, match="host Adam failed"):
        _train(engine, 1, start=1)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (_config(0, overlap=True, offload_optimizer={"device": "none"}), "zero_offload.overlap_offload"),
        (_config(2, overlap=True, offload_optimizer={"device": "none"}), "zero_offload.overlap_offload"),
        (
            _config(3, offload_param=CPU, ext={"delayed_param_update": {"enabled": True}}),
            "zero_offload.delayed_param_update",
        ),
        (
            _config(
                2,
                offload_optimizer={"device": "cpu", "ratio": 0.5},
                ext={"delayed_param_update": {"enabled": True}},
            ),
            "zero_offload.delayed_param_update",
        ),  # fmt: skip
        (
            _config(2, offload_optimizer={"device": "none"}, ext={"cores": {"host": [0]}}),
            "zero_offload.cores.host",
        ),
        (_config(2, ext={"staging_slots": 4}), "zero_offload.staging_slots"),  # no pipeline to stage for
    ],
)
def test_impossible_module5_combinations_are_refused_with_the_fix(config, key):
    with pytest.raises(NotImplementedError, match=key.replace(".", r"\.")):
        _engine(config)


@pytest.mark.parametrize("slots", [0, -2, "4", 2.5])
def test_a_staging_slot_count_that_is_not_a_positive_integer_is_a_config_error(slots):
    with pytest.raises(ConfigError, match="zero_offload.staging_slots"):
        zo.config.load_config(_config(2, overlap=True, ext={"staging_slots": slots}))


def test_cores_that_overlap_or_do_not_exist_are_config_errors():
    with pytest.raises(ConfigError, match="share core"):
        zo.config.load_config(_config(2, overlap=True, ext={"cores": {"device": [0], "host": [0]}}))
    with pytest.raises(ConfigError, match="not among this machine's cores"):
        zo.config.load_config(_config(2, overlap=True, ext={"cores": {"host": [4096]}}))


def test_the_host_cores_size_the_c_adams_threads_unless_the_config_gives_them():
    from zero_offload.engine.optimizers import host_adam_threads

    on_core_0 = {"cores": {"host": [0]}}
    assert host_adam_threads(zo.config.load_config(_config(2, overlap=True, ext=on_core_0))) == 1
    given = {**on_core_0, "cpu_adam": {"impl": "simd", "threads": 2}}
    assert host_adam_threads(zo.config.load_config(_config(2, overlap=True, ext=given))) == 2
    assert host_adam_threads(zo.config.load_config(_config(2, overlap=True))) is None


# -- the delayed parameter update ---------------------------------------------------------------------------
def _stale_reference(steps, start):
    """Plain torch: gradients of step t are taken on the weights the delayed engine shows at step t."""
    model = TinyGPT("nano", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01)
    losses = train_delayed(model, optimizer, steps, start)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("overlap", "impl"), [(False, "torch"), (True, "torch"), (True, "simd")])
def test_the_delayed_update_is_exact_during_warm_up_and_one_step_stale_after(overlap, impl):
    steps, start = 8, 3
    dpu = {"delayed_param_update": {"enabled": True, "start_step": start}}
    plain = _train(_engine(_config(2, overlap=overlap, impl=impl)), steps)
    engine = _engine(_config(2, overlap=overlap, impl=impl, ext=dpu))
    delayed = _train(engine, steps)
    engine.synchronize()  # the last update is still in flight
    # Steps 0..start compute on the same weights; from start + 1 on the delayed run sees older ones.
    assert delayed[: start + 1] == plain[: start + 1]
    assert all(d != p for d, p in zip(delayed[start + 1 :], plain[start + 1 :], strict=True))
    ref_losses, ref_weights = _stale_reference(steps, start)
    assert delayed == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param.detach().float(), ref_weights[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_delayed_weights_go_up_during_the_next_backward_and_change_nothing(precision, monkeypatch):
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 1}}
    engine = _engine(_config(2, precision, overlap=True, ext=dpu))
    queued, upload = [], EarlyUploads.upload

    def recording(early, index, stream):  # called as each unit's gradient arrives, i.e. during backward
        queued.append((engine.global_steps, engine.optimizer_step.pipeline.final, index))
        upload(early, index, stream)

    monkeypatch.setattr(EarlyUploads, "upload", recording)
    losses = _train(engine, 4)
    units = len(engine.states.units)
    # Steps 2 and 3 ran backward while the update of the step before was in flight: every unit went up then.
    assert sorted(queued) == [(step, True, i) for step in (2, 3) for i in range(units)]

    def uploads_during_backward(engine, step=3):
        backward = [s for s in _spans(engine, "backward") if s.step == step][0]
        return [s for s in _spans(engine, "H2D") if s.step == step and s.start < backward.end]

    engine.synchronize()
    monkeypatch.undo()
    # The same run with every upload left to the step: none during backward, the same losses, the same bits.
    monkeypatch.setattr(OffloadPipeline, "upload_during_backward", lambda self, update: None)
    at_step = _engine(_config(2, precision, overlap=True, ext=dpu))
    assert _train(at_step, 4) == losses
    assert not uploads_during_backward(at_step)
    at_step.synchronize()
    assert not _same_weights(
        {n: p.detach().clone() for n, p in engine.model.named_parameters()},
        {n: p.detach().clone() for n, p in at_step.model.named_parameters()},
    )


class _SometimesUnused(torch.nn.Module):
    """A model whose second layer takes no part in every third step: its unit gets no gradient then."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def forward(self, x, use_second):
        x = torch.tanh(self.first(x))
        return self.second(x) if use_second else x


def _train_sometimes_unused(config, steps):
    engine = zo.initialize(_SometimesUnused(), config, accelerator=EmulatedAccelerator())
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 16, generator=generator)
        engine.backward(engine(x, step % 3 != 0).square().mean())
        engine.step()
    engine.synchronize()
    return engine


@pytest.mark.parametrize(
    ("precision", "clip", "impl"), [("fp32", 0.0, "simd"), ("bf16", 0.5, "simd"), ("fp32", 0.5, "torch")]
)
def test_the_kept_gradients_change_nothing_bit_for_bit(precision, clip, impl, monkeypatch):
    """The delayed update reads each step's gradients where they landed (host_gradients.py) instead of from
    the fp32 partition: the same losses, norms and weights, with clipping (the norm is taken from the kept
    bf16 copies) and with a unit that gets no gradient at some steps (it must read zeros, not the gradient
    its region kept two steps before)."""
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 1}}
    config = _config(
        2, precision, overlap=True, impl=impl, clip=clip, ext=dpu, reduce_bucket_size=16 * 16 + 16
    )
    kept = _train_sometimes_unused(config, 6)
    assert (
        kept.optimizer_step.pipeline.kept is not None
        and kept.optimizer_step.pipeline.kept.landed == frozenset()
    )
    kept_nano = _engine(_config(2, precision, overlap=True, impl=impl, clip=clip, ext=dpu))
    kept_losses = _train(kept_nano, 5)
    monkeypatch.setattr(
        zero_offload.engine.optimizer_step, "keeps_gradients", lambda config, host_adam: False
    )
    added = _train_sometimes_unused(config, 6)
    assert added.optimizer_step.pipeline.kept is None
    assert not _same_weights(dict(kept.model.named_parameters()), dict(added.model.named_parameters()))
    assert [r["grad_norm"] for r in kept.history] == [r["grad_norm"] for r in added.history]
    added_nano = _engine(_config(2, precision, overlap=True, impl=impl, clip=clip, ext=dpu))
    assert _train(added_nano, 5) == kept_losses
    kept_nano.synchronize(), added_nano.synchronize()
    named = [dict(e.model.named_parameters()) for e in (kept_nano, added_nano)]
    assert not _same_weights(*named)


def test_the_kept_gradients_take_turns_between_two_areas():
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 1}}
    engine = _engine(_config(2, "bf16", overlap=True, ext=dpu))
    pipeline = engine.optimizer_step.pipeline
    areas = [{t.untyped_storage().data_ptr() for t in area} for area in pipeline.kept.areas]
    assert len(areas[0]) == len(areas[1]) == 1 and areas[0] != areas[1]  # two flat buffers
    assert all(t.dtype == torch.bfloat16 for area in pipeline.kept.areas for t in area)  # as they came down
    written = []
    for step in range(4):
        _train(engine, 1, start=step)
        written.append(pipeline.kept.area)
    assert written == [0, 1, 0, 1]  # the area the next backward writes: step 0 is the warm-up, not kept
    staging = engine.states.host_staging_bytes()
    assert staging >= 2 * 2 * sum(u.shard_numel for u in engine.states.units)  # both areas are counted


def test_a_checkpoint_under_the_delayed_update_resumes_exactly(tmp_path):
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 1}}
    config = _config(2, "fp16", impl="simd", ext=dpu)
    uninterrupted = _train(_engine(config), 6)
    engine = _engine(config)
    _train(engine, 3)
    engine.save_checkpoint(tmp_path / "ckpt")  # the update in flight lands; the next step publishes it
    assert _train(engine, 3, start=3) == uninterrupted[3:]
    resumed_engine = _engine(config)
    resumed_engine.load_checkpoint(tmp_path / "ckpt")
    assert _train(resumed_engine, 3, start=3) == uninterrupted[3:]


class _BlockingCopyStream:
    """A copy stream with CUDA's manners: waiting for a host event blocks the thread that asks."""

    waits_without_blocking = False

    def __init__(self, stream):
        self.stream = stream

    def wait_event(self, event):
        event.wait()

    def submit(self, fn, *args, **kwargs):
        return self.stream.submit(fn, *args, **kwargs)

    def close(self):
        self.stream.close()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_copy_streams_that_block_on_host_events_as_cuda_does_still_give_the_serial_weights(precision):
    serial = _engine(_config(2, precision))
    engine = _engine(_config(2, precision, overlap=True))
    engine.optimizer_step.pipeline.down = _BlockingCopyStream(engine.optimizer_step.pipeline.down)
    engine.optimizer_step.pipeline.up = _BlockingCopyStream(engine.optimizer_step.pipeline.up)
    assert _train(engine, 4) == _train(serial, 4)
    assert not _same_weights(
        {n: p.detach().clone() for n, p in engine.model.named_parameters()},
        {n: p.detach().clone() for n, p in serial.model.named_parameters()},
    )
    assert (
        engine.optimizer_step.pipeline.eager is False
    )  # Adam waits for the step: the up stream cannot wait for it


def test_with_an_upload_stream_that_blocks_the_delayed_weights_go_up_at_the_step():
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 1}}
    engine = _engine(_config(2, overlap=True, ext=dpu))
    engine.optimizer_step.pipeline.up = _BlockingCopyStream(engine.optimizer_step.pipeline.up)
    _train(engine, 3)
    # Queuing them during backward would block backward until the delayed Adam is done.
    early = engine.optimizer_step.pipeline.early
    assert early.update is None and not early.queued
    engine.synchronize()


def test_compare_schedules_pairs_each_round_and_trains_the_same_model_three_ways():
    from zero_offload.cli.bench.schedules import compare_schedules

    result = compare_schedules("nano", seq_len=8, steps=2, rounds=3, cores="shared")
    rounds = result["per_round_ms"]
    assert len(rounds) == 3 and all(set(r) == set(result["median_ms"]) for r in rounds)
    # The speed-up is the median of each round's own ratio, not a ratio of medians taken over different rounds.
    ratios = sorted(r["serial"] / r["overlapped"] for r in rounds)
    assert result["overlapped_vs_serial"] == ratios[1]
    losses = result["losses"]
    assert losses["overlapped"] == losses["serial"]  # fp32 on the CPU: the same numbers, bit for bit
    assert losses["delayed (DPU)"][:2] == losses["serial"][:2]  # the delayed update's warm-up steps are exact
    with pytest.raises(ValueError, match="'split' or 'shared'"):
        compare_schedules("nano", cores="both")


@pytest.mark.parametrize(("precision", "impl"), [("fp32", "torch"), ("fp16", "simd"), ("bf16", "simd")])
def test_the_delayed_adam_waits_for_the_uploads_that_read_what_it_rewrites(precision, impl):
    """Publishing uploads the new weights by DMA from pinned memory (the fp32 master itself, or the staging buffer
    the one-pass Adam rounds into), and the next Adam, launched right after, rewrites that memory. Here the link is
    held at every step until the host has run all it can: an Adam that does not wait for the uploads has then
    rewritten their source, and the device gets the next step's weights one step early."""
    dpu = {"delayed_param_update": {"enabled": True, "start_step": 0}}

    def engine(pin):
        offload = {"device": "cpu", "pin_memory": pin}
        return _engine(_config(2, precision, impl=impl, ext=dpu, offload_optimizer=offload))

    pinned, pageable = engine(True), engine(False)  # pageable copies have read their source when they return
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    for step in range(4):
        x, y = data.micro_batch(step, BATCH, micro_step=0, rank=0, world_size=1, accumulation=1)
        for run in (pinned, pageable):
            run.backward(lm_loss(run(x), y))
        with held_until_quiet(pinned.accelerator.dma, pinned.optimizer_step.host_queue):
            pinned.step()
        pageable.step()
        want = {n: p.detach().clone() for n, p in pageable.model.named_parameters()}
        got = {n: p.detach().clone() for n, p in pinned.model.named_parameters()}
        assert not _same_weights(got, want), f"step {step}: the device's weights were torn by the next Adam"
    assert pinned.states.master.untyped_storage().data_ptr() in pinned.accelerator._pinned
