"""Lab 5 (practice 实战篇): graded tests. `make lab5` grades your files, `make lab5 LAB_DIR=solutions` the reference.

Overlap bugs are races: a wrong schedule often gives the right answer because the other thread happened to be
fast. These tests take luck out of it. A "gate" holds a stream shut until the test opens it, and a "hold" keeps
one queue from starting anything while the test lets the other run as far as its waits allow: a missing or wrong
wait then reads (or overwrites) the wrong data every time, on any machine. The engine tests train the nano GPT:
the overlapped pipeline must give the serial step's weights bit for bit, and the delayed update must match a
one-step-stale reference written in plain torch. Correct versions of the other tasks stand in for yours, so one
unfinished task cannot fail another.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.support.corpus import fixed_corpus
from tests.support.interleave import held_until_quiet

import zero_offload as zo
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.practice import dpu, pipeline
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

pytestmark = pytest.mark.lab5
BATCH, SEQ = 4, 16


def _reference_acquire(self, writer, numel):
    slot = self.uses % len(self.buffers)
    self.uses += 1
    if self._readers[slot] is not None:
        writer.wait_event(self._readers[slot])
    return slot, self.buffers[slot][:numel]


def _reference_receive(self, index, shard):
    # Given in the lab: the delayed update's two cases.
    if self.early.update is not None and self.final:
        self.early.upload(index, self.up)
    if self.keeping:
        copied, done = self.kept.receive(index, shard, down=self.down, host=self.host, norms=self.squared_norms)
        self._pending.append(done)
        self._hold_until_copied(shard, copied)
        return
    slot, staging = self.grad_slots.acquire(self.down, shard.numel())
    copied = self.down.submit(self.transfers.to_host, staging, shard, blocking=False)
    self.host.wait_event(copied)
    done = self._queue_on_host(index, staging)
    self.grad_slots.release(slot, done)
    self._hold_until_copied(shard, copied)


def _reference_step(self, grads, adam, publish, *, skip):
    self.finish(publish)
    if skip:
        return
    if self.copy_gradients:
        if self.snapshot is None:
            self.snapshot = [torch.empty_like(g) for g in grads]
        for saved, grad in zip(self.snapshot, grads, strict=True):
            saved.copy_(grad)
        grads = self.snapshot
    if self.uploads is not None:
        self.host.wait_event(self.uploads)
    self.in_flight = self.host.submit(adam, grads)


def _others(keep, monkeypatch):
    """Correct versions of every task but `keep`."""
    references = {
        "5.1": (pipeline.OffloadPipeline, "receive", _reference_receive),
        "5.2": (pipeline.SlotRing, "acquire", _reference_acquire),
        "5.3": (dpu.DelayedUpdate, "step", _reference_step),
    }
    for task, (owner, name, function) in references.items():
        if task != keep:
            monkeypatch.setattr(owner, name, function)


def _config(precision="fp32", *, overlap=True, clip=0.0, dpu_start=None, accumulation=1, impl="torch"):
    extension = {"cpu_adam": {"impl": impl}, "overlap_offload": overlap}
    if dpu_start is not None:
        extension["delayed_param_update"] = {"enabled": True, "start_step": dpu_start}
    config = {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}},
        # Small buckets: every unit is reduced (and handed to the pipeline) on its own, during backward.
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1000},
        "zero_offload": extension,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine(config):
    return zo.initialize(TinyGPT("nano", seed=0), config, accelerator=EmulatedAccelerator())


def _batch(step, micro_step=0, accumulation=1):
    data = ByteBatches(fixed_corpus(), SEQ, seed=3)
    return data.micro_batch(step, BATCH // accumulation, micro_step=micro_step, accumulation=accumulation)


def _train(engine, steps, start=0, accumulation=1):
    losses = []
    for step in range(start, start + steps):
        for k in range(accumulation):
            x, y = _batch(step, k, accumulation)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def _weights(engine):
    return {n: p.detach().float().clone() for n, p in engine.model.named_parameters()}


def _assert_bit_identical(got, want):
    for name, weight in want.items():
        assert torch.equal(got[name], weight), f"{name} differs from the serial step's (max abs error "
        f"{float((got[name] - weight).abs().max()):.2e}); the pipeline must change when, never what"


class _Gate:
    """Work queued behind `closed()` on a stream waits until `open()`."""

    def __init__(self):
        self._event = threading.Event()

    def closed(self):
        self._event.wait(timeout=30)

    def open(self):
        self._event.set()


def _delivered(engine, count):
    """Hand the pipeline `count` reduced shards as backward would, unit k's filled with k + 1."""
    states = engine.states
    for index in range(count):
        numel = states.units[index].shard_numel
        shard = engine.accelerator.zeros(numel, states.dtype, category="buckets").fill_(index + 1.0)
        engine.optimizer_step.pipeline.receive(index, shard)


def _assert_arrived(engine, count):
    for index in range(count):
        grad = engine.states.grad_shards[index]
        wrong = int((grad != index + 1.0).sum())
        assert not wrong, (
            f"unit {index}'s gradient is wrong in {wrong} of {grad.numel()} places: the host read its staging "
            "slot before the copy had landed, or after the next copy had overwritten it"
        )


# ---------------------------------------------------------------------------------------------------- Lab 5.1
@pytest.mark.task("5.1")
@pytest.mark.parametrize(
    ("precision", "clip", "accumulation"), [("fp32", 0.0, 1), ("fp16", 0.5, 1), ("bf16", 0.0, 2)]
)
def test_the_overlapped_schedule_trains_bit_for_bit_like_the_serial_step(
    precision, clip, accumulation, monkeypatch
):
    _others("5.1", monkeypatch)
    kwargs = dict(clip=clip, accumulation=accumulation)
    serial = _engine(_config(precision, overlap=False, **kwargs))
    overlapped = _engine(_config(precision, **kwargs))
    assert _train(overlapped, 4, accumulation=accumulation) == _train(serial, 4, accumulation=accumulation)
    _assert_bit_identical(_weights(overlapped), _weights(serial))
    assert overlapped.states.transfers.bytes == serial.states.transfers.bytes


@pytest.mark.task("5.1")
def test_receive_returns_while_the_down_stream_is_busy(monkeypatch):
    _others("5.1", monkeypatch)
    engine = _engine(_config())
    pipeline_, states = engine.optimizer_step.pipeline, engine.states
    gate = _Gate()
    pipeline_.down.submit(gate.closed)  # the link is busy until the test opens the gate
    returned = threading.Event()

    def open_later():  # a schedule that waits for its copy would hang until here
        if not returned.wait(timeout=5):
            gate.open()

    opener = threading.Thread(target=open_later)
    opener.start()
    shard = engine.accelerator.zeros(states.units[0].shard_numel, states.dtype, category="buckets").fill_(1.0)
    try:
        pipeline_.receive(0, shard)  # backward's thread hands over one reduced shard
        returned_with_gate_closed = not gate._event.is_set()
        copied_on_this_thread = states.transfers.bytes["d2h"]
    finally:
        returned.set()
        gate.open()
        opener.join()
    pipeline_.wait()
    assert returned_with_gate_closed, "receive waited for the copy: D2H must go on the down stream"
    assert copied_on_this_thread == 0, "the copy ran on backward's thread: submit it to the down stream"
    assert torch.equal(states.grad_shards[0], torch.ones_like(states.grad_shards[0])), "the gradient arrived"


@pytest.mark.task("5.1")
def test_the_host_reads_a_gradient_only_after_its_copy_has_landed(monkeypatch):
    _others("5.1", monkeypatch)
    engine = _engine(_config())
    pipeline_ = engine.optimizer_step.pipeline
    # The link starts nothing until the host has run everything it can: a host not made to wait for the copy
    # has read an empty slot by then.
    with held_until_quiet(pipeline_.down, pipeline_.host):
        _delivered(engine, 1)
    pipeline_.wait()
    _assert_arrived(engine, 1)


@pytest.mark.task("5.1")
def test_a_staging_slot_is_handed_back_only_after_the_host_has_read_it(monkeypatch):
    _others("5.1", monkeypatch)
    engine = _engine(_config())
    pipeline_, slots = engine.optimizer_step.pipeline, len(engine.optimizer_step.pipeline.grad_slots.buffers)
    count = slots + 1  # the last one reuses the first slot
    # The host starts nothing until the link has run every copy it can: a slot handed back before the host
    # read it has been overwritten by then.
    with held_until_quiet(pipeline_.host, pipeline_.down, after=count):
        _delivered(engine, count)
    pipeline_.wait()
    _assert_arrived(engine, count)


@pytest.mark.task("5.1")
def test_without_clipping_every_unit_is_updated_before_backward_returns(monkeypatch):
    _others("5.1", monkeypatch)
    engine = _engine(_config())
    before = [m.clone() for m in engine.states.master_params]
    x, y = _batch(0)
    engine.backward(lm_loss(engine(x), y))  # no step yet: Adam ran as each gradient arrived
    changed = [not torch.equal(a, b) for a, b in zip(before, engine.states.master_params, strict=True)]
    assert all(changed), f"units not updated during backward: {[i for i, c in enumerate(changed) if not c]}"
    assert engine.optimizer_step.pipeline.grad_slots.uses == len(engine.states.units), "one staging slot per unit"
    engine.step()


# ---------------------------------------------------------------------------------------------------- Lab 5.2
@pytest.mark.task("5.2")
def test_slots_are_taken_in_turn_as_views_of_the_right_size():
    buffers = [torch.zeros(8), torch.zeros(8)]
    ring = pipeline.SlotRing(buffers)
    stream = pipeline.HostQueue("writer")
    got = [ring.acquire(stream, n) for n in (8, 5, 3)]
    assert [slot for slot, _ in got] == [0, 1, 0]
    assert [view.numel() for _, view in got] == [8, 5, 3]
    assert got[2][1].data_ptr() == buffers[0].data_ptr(), "a slot is a view of its buffer, not a copy"


@pytest.mark.task("5.2")
def test_a_writer_waits_for_the_last_reader_of_its_own_slot():
    ring = pipeline.SlotRing([torch.zeros(1), torch.zeros(1)])
    writer, gate = pipeline.HostQueue("writer"), _Gate()
    readers = [pipeline.HostQueue("reader-0"), pipeline.HostQueue("reader-1")]
    try:
        for k in range(2):  # slot 0's reader cannot finish before the gate opens; slot 1's has finished
            slot, buffer = ring.acquire(writer, 1)
            written = writer.submit(buffer.fill_, k)
            readers[k].wait_event(written)
            read = readers[k].submit(gate.closed if k == 0 else lambda: None)
            ring.release(slot, read)
        read.wait()
        slot, buffer = ring.acquire(writer, 1)  # slot 0 again, while its reader is still shut
        overwrite = writer.submit(buffer.fill_, 99)
        writer.wait_quiet(submitted=3)  # it has run all it can
        early = overwrite.done()
    finally:
        gate.open()
    overwrite.wait()
    assert not early, "slot 0 was overwritten while the work reading it had not finished"
    assert float(buffer[0]) == 99


@pytest.mark.task("5.2")
def test_acquire_returns_at_once_and_leaves_the_waiting_to_the_writer():
    ring = pipeline.SlotRing([torch.zeros(1)])
    writer, reader, gate = pipeline.HostQueue("writer"), pipeline.HostQueue("reader"), _Gate()
    ring.release(0, reader.submit(gate.closed))  # the slot's reader is shut until the gate opens
    acquired = threading.Event()
    caller = threading.Thread(target=lambda: (ring.acquire(writer, 1), acquired.set()), daemon=True)
    caller.start()
    try:
        # The gate stays shut whatever happens: an acquire that blocks its caller never returns here.
        returned = acquired.wait(timeout=20)
    finally:
        gate.open()
        caller.join()
    assert returned, (
        "acquire blocked its caller until the reader finished: make the writer stream wait instead"
    )


@pytest.mark.task("5.2")
def test_a_held_reader_sees_every_value_written_for_it():
    ring = pipeline.SlotRing([torch.zeros(4), torch.zeros(4)])
    writer, reader, seen, events = pipeline.HostQueue("writer"), pipeline.HostQueue("reader"), [], []
    # The reader reads nothing until the writer has written all it can: a writer that does not wait for the
    # slot's reader has overwritten both slots by then.
    with held_until_quiet(reader, writer, after=6):
        for k in range(6):
            slot, buffer = ring.acquire(writer, 4)
            written = writer.submit(buffer.fill_, k)
            reader.wait_event(written)
            done = reader.submit(lambda b=buffer, k=k: seen.append((k, int(b[0]))))
            ring.release(slot, done)
            events.append(done)
    for event in events:
        event.wait()
    assert sorted(seen) == [(k, k) for k in range(6)]


@pytest.mark.task("5.2")
def test_the_pipeline_with_your_ordering_and_a_held_host_keeps_every_gradient(monkeypatch):
    _others("5.2", monkeypatch)
    engine = _engine(_config("fp16"))
    pipeline_ = engine.optimizer_step.pipeline
    count = len(pipeline_.grad_slots.buffers) + 1
    with held_until_quiet(pipeline_.host, pipeline_.down, after=count):
        _delivered(engine, count)
    pipeline_.wait()
    scale = engine.states.loss_scale()  # fp16: the host unscales as it accumulates
    for index in range(count):
        want = torch.full_like(engine.states.grad_shards[index], (index + 1.0) / scale)
        assert torch.equal(engine.states.grad_shards[index], want), f"unit {index}'s gradient was overwritten"


@pytest.mark.task("5.2")
def test_the_pipeline_with_your_ordering_equals_the_serial_step(monkeypatch):
    _others("5.2", monkeypatch)
    serial = _engine(_config("fp16", overlap=False))
    engine = _engine(_config("fp16"))
    assert _train(engine, 2) == _train(serial, 2)
    _assert_bit_identical(_weights(engine), _weights(serial))


# ---------------------------------------------------------------------------------------------------- Lab 5.3
def _stale_reference(steps, start):
    """Plain torch: from step start + 1 on, the gradient is taken on the weights one update old."""
    model = TinyGPT("nano", seed=0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.01)
    visible, losses = [p.detach().clone() for p in params], []
    for step in range(steps):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, visible, strict=True):
                p.copy_(v)
        x, y = _batch(step)
        loss = lm_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for p, c in zip(params, current, strict=True):
                p.copy_(c)
        optimizer.step()
        visible = [p.detach().clone() for p in params] if step + 1 <= start else current
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.task("5.3")
@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_steps_are_exact_and_later_ones_one_step_stale(overlap, monkeypatch):
    _others("5.3", monkeypatch)
    steps, start = 7, 2
    plain = _train(_engine(_config(overlap=overlap)), steps)
    engine = _engine(_config(overlap=overlap, dpu_start=start))
    delayed = _train(engine, steps)
    engine.synchronize()
    assert delayed[: start + 1] == plain[: start + 1], "before start_step the update must not be delayed"
    assert delayed[start + 1 :] != plain[start + 1 :], "after start_step the update must lag one step"
    ref_losses, ref_weights = _stale_reference(steps, start)
    assert delayed == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, weight in _weights(engine).items():
        torch.testing.assert_close(weight, ref_weights[name], rtol=1e-5, atol=1e-6)


@pytest.mark.task("5.3")
def test_adam_reads_a_snapshot_not_the_gradients_the_next_backward_writes(monkeypatch):
    _others("5.3", monkeypatch)
    queue, gate = pipeline.HostQueue("host"), _Gate()
    update = dpu.DelayedUpdate(queue, start_step=0)
    grads, read, published = [torch.ones(3)], [], []
    queue.submit(gate.closed)  # Adam cannot run before the test has changed the live gradients
    try:
        update.step(grads, lambda g: read.append(g[0].clone()), lambda: published.append(True), skip=False)
        grads[0].fill_(7.0)  # the next backward writes the live buffer
    finally:
        gate.open()
    update.finish(lambda: published.append(True))
    assert read and torch.equal(read[0], torch.ones(3)), "Adam read the live gradients, not this step's"
    assert published == [True]


@pytest.mark.task("5.3")
def test_without_copy_gradients_adam_reads_the_gradients_in_place(monkeypatch):
    _others("5.3", monkeypatch)
    update = dpu.DelayedUpdate(pipeline.HostQueue("host"), start_step=0, copy_gradients=False)
    grads, read = [torch.ones(3)], []
    update.step(grads, lambda g: read.append(g), lambda: None, skip=False)
    update.finish(lambda: None)
    assert read and read[0][0] is grads[0], "with copy_gradients=False Adam must get the gradients themselves"
    assert update.snapshot is None, "nothing to copy: no snapshot should be made"


@pytest.mark.task("5.3")
def test_each_step_publishes_the_previous_update_before_launching_its_own(monkeypatch):
    _others("5.3", monkeypatch)
    host = pipeline.HostQueue("host")
    update, log, published = dpu.DelayedUpdate(host, start_step=0), [], []

    def publish():  # lets the host run all it can first: an update already launched would run now
        host.wait_quiet()
        published.append(True)

    for step in range(3):
        update.step([torch.zeros(1)], lambda g, s=step: log.append((s, len(published))), publish, skip=False)
        assert update.in_flight is not None, "the step must launch its update and not wait for it"
    update.finish(publish)
    assert log == [(0, 0), (1, 1), (2, 2)], "each update must start after the previous one was published"
    assert len(published) == 3


@pytest.mark.task("5.3")
def test_a_skipped_step_launches_nothing_but_still_lands_the_previous_update(monkeypatch):
    _others("5.3", monkeypatch)
    update, log = dpu.DelayedUpdate(pipeline.HostQueue("host"), start_step=0), []
    update.step([torch.zeros(1)], lambda g: log.append("adam"), lambda: log.append("publish"), skip=False)
    update.step([torch.zeros(1)], lambda g: log.append("adam"), lambda: log.append("publish"), skip=True)
    assert update.in_flight is None and log == ["adam", "publish"]


@pytest.mark.task("5.3")
def test_adam_waits_for_the_uploads_that_publish_started(monkeypatch):
    _others("5.3", monkeypatch)
    host, link = pipeline.HostQueue("host"), pipeline.HostQueue("link")
    update, order = dpu.DelayedUpdate(host, start_step=0), []

    def publish():  # its uploads still read the host's weights after it returns, as DMA does
        return link.submit(lambda: order.append("upload"))

    update.step([torch.zeros(1)], lambda g: order.append("adam"), publish, skip=False)
    # The link starts nothing until the host has run all it can: an Adam that does not wait for the uploads
    # has rewritten their source by then.
    with held_until_quiet(link, host):
        update.step([torch.zeros(1)], lambda g: order.append("adam"), publish, skip=False)
    update.finish(publish)
    link.synchronize()
    assert order == ["adam", "upload", "adam", "upload"], (
        f"{order}: Adam ran before the uploads had read the weights it rewrites; make the host queue wait "
        "for self.uploads"
    )
