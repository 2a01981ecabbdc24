"""Plausible wrong solutions that each lab's graded tests must catch (checked by tests/course/test_labs.py).

MUTANTS maps a task id to a list of (name, code) pairs. The code replaces that task's whole marked
region in the solution (markers included), written without indentation: it is indented to the
region's level. Or the code is an (old, new) pair: `old` must occur exactly once in the task's region
of the solution, and is replaced by `new` (lab 4's mistakes are one expression each). For every mutant
the meta-test grades the solution with that one change and asserts that the task FAILS; other tasks
may pass or fail. Example:

    MUTANTS = {
        "1.2": [
            ("no bias correction", '''
                m_hat, v_hat = exp_avg, exp_avg_sq
                ...
            '''),
        ],
        "4.3": [("the tail stops one short", ("a, i, end", "a, i, end - 1"))],
    }
"""

MUTANTS: dict[str, list[tuple[str, str | tuple[str, str]]]] = {
    "1.1": [
        (
            "momentum without the (1 - beta1) factor",
            """
            exp_avg.mul_(beta1).add_(grad)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        """,
        ),
        (
            "variance of g instead of g * g",
            """
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).add_(grad, alpha=1 - beta2)
        """,
        ),
        (
            "new tensors instead of in-place updates",
            """
            exp_avg = beta1 * exp_avg + (1 - beta1) * grad
            exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        """,
        ),
    ],
    "1.2": [
        (
            "no bias correction",
            """
            if weight_decay != 0:
                if adamw:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(param, alpha=weight_decay)
            update_moments(exp_avg, exp_avg_sq, grad, beta1, beta2)
            param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
        """,
        ),
        (
            "AdamW decay applied as Adam's L2 term",
            """
            if weight_decay != 0:
                grad = grad.add(param, alpha=weight_decay)
            update_moments(exp_avg, exp_avg_sq, grad, beta1, beta2)
            bias1 = 1 - beta1**step if bias_correction else 1.0
            bias2 = 1 - beta2**step if bias_correction else 1.0
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / bias1)
        """,
        ),
        (
            "eps inside the square root",
            """
            if weight_decay != 0:
                if adamw:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(param, alpha=weight_decay)
            update_moments(exp_avg, exp_avg_sq, grad, beta1, beta2)
            bias1 = 1 - beta1**step if bias_correction else 1.0
            bias2 = 1 - beta2**step if bias_correction else 1.0
            denom = (exp_avg_sq / bias2 + eps).sqrt()
            param.addcdiv_(exp_avg, denom, value=-lr / bias1)
        """,
        ),
        (
            "L2 term added to the caller's gradient in place",
            """
            if weight_decay != 0:
                if adamw:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad.add_(param, alpha=weight_decay)
            update_moments(exp_avg, exp_avg_sq, grad, beta1, beta2)
            bias1 = 1 - beta1**step if bias_correction else 1.0
            bias2 = 1 - beta2**step if bias_correction else 1.0
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / bias1)
        """,
        ),
    ],
    "1.3": [
        (
            "the introduction's 12 bytes: no master weights",
            """
            tier_of = {"none": "device", "cpu": "host", "nvme": "nvme"}
            low = 4 if precision == "fp32" else 2
            shard = math.ceil(num_params / world_size)
            weights = shard if stage == 3 else num_params
            result.add("parameters", tier_of[offload_param], low * weights)
            if offload_optimizer == "none":
                result.add("gradients", "device", low * (shard if stage >= 2 else num_params))
            else:
                result.add("gradients", "host", 4 * shard)
            states = shard if stage >= 1 else num_params
            result.add("exp_avg", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg_sq", tier_of[offload_optimizer], 4 * states)
        """,
        ),
        (
            "stage 2 shards the weights too",
            """
            tier_of = {"none": "device", "cpu": "host", "nvme": "nvme"}
            low = 4 if precision == "fp32" else 2
            shard = math.ceil(num_params / world_size)
            weights = shard if stage >= 2 else num_params
            result.add("parameters", tier_of[offload_param], low * weights)
            if offload_optimizer == "none":
                result.add("gradients", "device", low * (shard if stage >= 2 else num_params))
            else:
                result.add("gradients", "host", 4 * shard)
            states = shard if stage >= 1 else num_params
            if precision != "fp32" or offload_optimizer != "none":
                result.add("master_weights", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg_sq", tier_of[offload_optimizer], 4 * states)
        """,
        ),
        (
            "shards rounded down",
            """
            tier_of = {"none": "device", "cpu": "host", "nvme": "nvme"}
            low = 4 if precision == "fp32" else 2
            shard = num_params // world_size
            weights = shard if stage == 3 else num_params
            result.add("parameters", tier_of[offload_param], low * weights)
            if offload_optimizer == "none":
                result.add("gradients", "device", low * (shard if stage >= 2 else num_params))
            else:
                result.add("gradients", "host", 4 * shard)
            states = shard if stage >= 1 else num_params
            if precision != "fp32" or offload_optimizer != "none":
                result.add("master_weights", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg_sq", tier_of[offload_optimizer], 4 * states)
        """,
        ),
        (
            "fp32 offload without a host master copy",
            """
            tier_of = {"none": "device", "cpu": "host", "nvme": "nvme"}
            low = 4 if precision == "fp32" else 2
            shard = math.ceil(num_params / world_size)
            weights = shard if stage == 3 else num_params
            result.add("parameters", tier_of[offload_param], low * weights)
            if offload_optimizer == "none":
                result.add("gradients", "device", low * (shard if stage >= 2 else num_params))
            else:
                result.add("gradients", "host", 4 * shard)
            states = shard if stage >= 1 else num_params
            if precision != "fp32":
                result.add("master_weights", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg", tier_of[offload_optimizer], 4 * states)
            result.add("exp_avg_sq", tier_of[offload_optimizer], 4 * states)
        """,
        ),
    ],
    "1.4": [
        (
            "no hysteresis: back off at every overflow",
            """
            if overflow:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
                self.good_steps = 0
                return
            self.good_steps += 1
            if self.good_steps % self.scale_window == 0:
                self.scale *= self.scale_factor
        """,
        ),
        (
            "the good-step count survives an overflow",
            """
            if overflow:
                if self.hysteresis_left <= 1:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                return
            self.good_steps += 1
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if self.good_steps % self.scale_window == 0:
                self.scale *= self.scale_factor
                self.hysteresis_left = self.hysteresis
        """,
        ),
        (
            "the scale falls below min_loss_scale",
            """
            if overflow:
                if self.hysteresis_left <= 1:
                    self.scale = self.scale / self.scale_factor
                else:
                    self.hysteresis_left -= 1
                self.good_steps = 0
                return
            self.good_steps += 1
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if self.good_steps % self.scale_window == 0:
                self.scale *= self.scale_factor
                self.hysteresis_left = self.hysteresis
        """,
        ),
    ],
}

MUTANTS.update(
    {
        "2.1": [
            (
                "shard size rounded down: the tail is lost",
                """
            total = sum(numels)
            shard_numel = align * (total // (world_size * align))
            start, end = rank * shard_numel, (rank + 1) * shard_numel
            slices = []
            offset = 0
            for index, numel in enumerate(numels):
                lo, hi = max(offset, start), min(offset + numel, end)
                if lo < hi:
                    slices.append(Slice(index, lo - offset, lo - start, hi - lo))
                offset += numel
        """,
            ),
            (
                "slice positions taken from the buffer, not the shard",
                """
            total = sum(numels)
            shard_numel = align * math.ceil(total / (world_size * align))
            start, end = rank * shard_numel, (rank + 1) * shard_numel
            slices = []
            offset = 0
            for index, numel in enumerate(numels):
                lo, hi = max(offset, start), min(offset + numel, end)
                if lo < hi:
                    slices.append(Slice(index, lo - offset, lo, hi - lo))
                offset += numel
        """,
            ),
            (
                "off by one at the shard boundary",
                """
            total = sum(numels)
            shard_numel = align * math.ceil(total / (world_size * align))
            start, end = rank * shard_numel, (rank + 1) * shard_numel
            slices = []
            offset = 0
            for index, numel in enumerate(numels):
                lo, hi = max(offset, start), min(offset + numel, end - 1)
                if lo < hi:
                    slices.append(Slice(index, lo - offset, lo - start, hi - lo))
                offset += numel
        """,
            ),
        ],
        "2.2": [
            (
                "summed, not averaged",
                """
            return comm.reduce_scatter(shard_out, full_grad, async_op=async_op)
        """,
            ),
            (
                "averaged after the collective, on the input instead of the output",
                """
            work = comm.reduce_scatter(shard_out, full_grad, async_op=async_op)
            full_grad.div_(comm.world_size)
            return work
        """,
            ),
            (
                "every rank keeps chunk 0 of an all-reduce",
                """
            full_grad.div_(comm.world_size)
            comm.all_reduce(full_grad)
            shard_out.copy_(full_grad[: shard_out.numel()])
            return None
        """,
            ),
        ],
        "2.3": [
            (
                "master weights never rounded into the shard: the weights never move",
                """
            for index in range(len(self.units)):
                if self.stage < 3:
                    all_gather_unit(self.comm, self.full_params[index], self.param_shards[index])
        """,
            ),
            (
                "no all-gather: other ranks' parts of the weights go stale",
                """
            for index in range(len(self.units)):
                if self.master is not None:
                    self.param_shards[index].copy_(self.master_params[index])
        """,
            ),
            (
                "all-gather at stage 3 too, into freed memory",
                """
            for index in range(len(self.units)):
                if self.master is not None:
                    self.param_shards[index].copy_(self.master_params[index])
                all_gather_unit(self.comm, self.full_params[index], self.param_shards[index])
        """,
            ),
        ],
        "2.4": [
            (
                "storage never restored",
                """
            work = all_gather_unit(self.comm, self.full_params[index], self.param_shards[index], async_op=async_op)
            unit.gathered = True
            return work
        """,
            ),
            (
                "only this rank's shard copied in: the rest is garbage",
                """
            self.accel.restore_storage(self.full_params[index], "parameters")
            n = self.param_shards[index].numel()
            self.full_params[index][self.comm.rank * n : (self.comm.rank + 1) * n].copy_(self.param_shards[index])
            unit.gathered = True
            return None
        """,
            ),
            (
                "never marked gathered: every use gathers again",
                """
            self.accel.restore_storage(self.full_params[index], "parameters")
            return all_gather_unit(self.comm, self.full_params[index], self.param_shards[index], async_op=async_op)
        """,
            ),
        ],
    }
)


MUTANTS.update(
    {
        "3.1": [
            (
                "overwrites the host gradient instead of accumulating",
                """
            transfers.to_host(host_staging, device_shard)
            host_grad.copy_(host_staging).mul_(inv_scale)
        """,
            ),
            (
                "forgets to divide out the loss scale",
                """
            transfers.to_host(host_staging, device_shard)
            host_grad.add_(host_staging)
        """,
            ),
            (
                "upcasts on the device: 4 bytes cross the link",
                """
            host_grad.add_(device_shard.float().to(host_grad.device), alpha=inv_scale)
        """,
            ),
        ],
        "3.2": [
            (
                "clipping factor ignored",
                """
            for master, grad in zip(masters, grads, strict=True):
                master.grad = grad
            optimizer.step()
            for master in masters:
                master.grad = None
        """,
            ),
            (
                "gradients left attached after the step",
                """
            for master, grad in zip(masters, grads, strict=True):
                master.grad = grad.mul_(clip_factor)
            optimizer.step()
        """,
            ),
        ],
        "3.3": [
            (
                "uploads before casting: the device gets last step's weights",
                """
            transfers.to_device(device_shard, host_low)
            if host_low.data_ptr() != master.data_ptr():
                host_low.copy_(master)
        """,
            ),
            (
                "copies the fp32 master straight into the device shard",
                """
            device_shard.copy_(master)
        """,
            ),
        ],
        "3.4": [
            (
                "only this rank's overflow counts",
                """
            return not bool(torch.isfinite(host_grad).all())
        """,
            ),
            (
                "inf is checked, nan is not",
                """
            return comm.any(bool(torch.isinf(host_grad).any()))
        """,
            ),
        ],
    }
)


MUTANTS.update(
    {
        "4.1": [
            ("m without the (1 - beta1) factor", ("_mm256_mul_ps(one_minus_beta1, g)", "g")),
            (
                "no bias correction of v in the vector loop",
                ("_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt)", "_mm256_sqrt_ps(v)"),
            ),
            (
                "AdamW decay applied as Adam's L2 term",
                (
                    "if (a->adamw) w = _mm256_mul_ps(w, decay);",
                    "if (a->adamw) g = _mm256_fmadd_ps(wd, w, g);",
                ),
            ),
            (
                "the gradient factor (loss scale, clipping) left out",
                (
                    "_mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i), scale)",
                    "load8_grad(a->grad, a->grad_dtype, i)",
                ),
            ),
            (
                "each chunk starts at element 0",
                ("for (; i + 8 <= end; i += 8)", "for (i = 0; i + 8 <= end; i += 8)"),
            ),
            ("runs past the end: i < end", ("i + 8 <= end", "i < end")),
        ],
        "4.2": [
            (
                "truncation instead of round to nearest even",
                ("_mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT)", "_mm256_cvtps_ph(w, _MM_FROUND_TO_ZERO)"),
            ),
            ("every group of 8 stored at the start of out", ("(uint16_t *)out + i", "(uint16_t *)out")),
        ],
        "4.3": [
            (
                "the tail starts at begin: the vector loop's elements updated twice",
                ("a, i, end", "a, begin, end"),
            ),
            ("the tail stops one short", ("a, i, end", "a, i, end - 1")),
            ("the tail runs to the end of the array, not of this chunk", ("a, i, end", "a, i, a->n")),
        ],
        "4.4": [
            (
                "one scale for the whole tensor, not one per block",
                ("scales = rows.abs().amax(dim=1)", "scales = rows.abs().amax().expand(rows.shape[0])"),
            ),
            ("sqrt(v) quantized as signed, 127 codes", ("top = M_TOP if signed else V_TOP", "top = M_TOP")),
            ("truncation instead of round to nearest even", ("torch.round(scaled)", "torch.trunc(scaled)")),
            (
                "ties rounded away from zero",
                ("torch.round(scaled)", "torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)"),
            ),
            (
                "top / scale used even where it overflows fp32",
                ("torch.where(times.isinf(), divide(rows, safe) * top, rows * times)", "rows * times"),
            ),
        ],
    }
)


_CODE = "\n        "  # a line of code in a method, not a comment that mentions it

MUTANTS.update(
    {
        "5.1": [
            (
                "copies on backward's thread instead of the down stream",
                """
            slot, staging = self.grad_slots.acquire(self.down, shard.numel())
            self.transfers.to_host(staging, shard)
            done = self._queue_on_host(index, staging)
            self.grad_slots.release(slot, done)
        """,
            ),
            # Each `old` starts at a line's indentation: the comments above the code name the same calls.
            (
                "the host reads the slot without waiting for the copy",
                (_CODE + "self.host.wait_event(copied)", _CODE + "pass"),
            ),
            ("backward waits for every copy", (_CODE + "self.host.wait_event(copied)", _CODE + "copied.wait()")),
            (
                "the slot is never handed back",
                (_CODE + "self.grad_slots.release(slot, done)", _CODE + "pass"),
            ),
            (
                "the slot is handed back when the copy lands, before the host has read it",
                (_CODE + "self.grad_slots.release(slot, done)", _CODE + "self.grad_slots.release(slot, copied)"),
            ),
            (
                "the host queue, not the down stream that writes the slot, waits for its reader",
                (
                    _CODE + "slot, staging = self.grad_slots.acquire(self.down, shard.numel())",
                    _CODE + "slot, staging = self.grad_slots.acquire(self.host, shard.numel())",
                ),
            ),
            (
                "the host's work is queued before the host is told to wait for the copy",
                """
            slot, staging = self.grad_slots.acquire(self.down, shard.numel())
            copied = self.down.submit(self.transfers.to_host, staging, shard, blocking=False)
            done = self._queue_on_host(index, staging)
            self.host.wait_event(copied)
            self.grad_slots.release(slot, done)
            self._hold_until_copied(shard, copied)
        """,
            ),
        ],
        "5.2": [
            ("never waits for the slot's reader", ("writer.wait_event(reader)", "pass")),
            (
                "waits for the other slot's reader",
                ("reader = self._readers[slot]", "reader = self._readers[(slot + 1) % len(self.buffers)]"),
            ),
            ("blocks the caller instead of the writer", ("writer.wait_event(reader)", "reader.wait()")),
            (
                "hands out the whole buffer, not a view of the shard's size",
                ("self.buffers[slot][:numel]", "self.buffers[slot]"),
            ),
        ],
        "5.3": [
            (
                "Adam reads the live gradients",
                """
            self.finish(publish)
            if skip:
                return
            if self.uploads is not None:
                self.host.wait_event(self.uploads)
            self.in_flight = self.host.submit(adam, grads)
        """,
            ),
            (
                "copies the gradients even when told not to",
                """
            self.finish(publish)
            if skip:
                return
            if self.snapshot is None:
                self.snapshot = [torch.empty_like(g) for g in grads]
            for saved, grad in zip(self.snapshot, grads, strict=True):
                saved.copy_(grad)
            if self.uploads is not None:
                self.host.wait_event(self.uploads)
            self.in_flight = self.host.submit(adam, self.snapshot)
        """,
            ),
            (
                "launches before the previous update has landed",
                """
            if skip:
                self.finish(publish)
                return
            if self.uploads is not None:
                self.host.wait_event(self.uploads)
            if self.copy_gradients:
                if self.snapshot is None:
                    self.snapshot = [torch.empty_like(g) for g in grads]
                for saved, grad in zip(self.snapshot, grads, strict=True):
                    saved.copy_(grad)
                grads = self.snapshot
            launched = self.host.submit(adam, grads)
            self.finish(publish)
            self.in_flight = launched
        """,
            ),
            (
                "waits for its own update: nothing is delayed",
                (
                    _CODE + "self.in_flight = self.host.submit(adam, grads)",
                    _CODE + "self.host.submit(adam, grads).wait()",
                ),
            ),
            ("a skipped step still launches", ("if skip:", "if False:")),
            (
                "Adam is launched while publish's uploads still read what it rewrites",
                ("self.host.wait_event(self.uploads)", "pass"),
            ),
        ],
    }
)
