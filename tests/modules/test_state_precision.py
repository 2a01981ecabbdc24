"""The C Adam with its moments in bf16 or 8 bits, against the readable torch reference (tuning/state_precision.py).

The scalar loop does the reference's fp32 operations in the same order, so it must agree bit for bit. The vector
loops fuse multiply-adds and multiply constants together once (cpu_adam.c, above zo_hyper8 and int8_pass8), so
their fp32 moments differ from the reference's by an ulp, and a code may then round the other way: they must agree
within one step of the precision (one bf16 ulp, one int8 code). Each step starts both from the same (the kernel's)
state, so that a difference cannot grow over the steps. Skipped as a whole where no C compiler exists, as
test_cpu_adam.py is.
"""

from __future__ import annotations

import shutil

import pytest
import torch

if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
    pytest.skip("no C compiler on this machine", allow_module_level=True)

from zero_offload.tuning import state_precision as sp  # noqa: E402
from zero_offload.tuning.cpu_adam import (  # noqa: E402
    cpu_adam_update,
    memory_floor,
    norm_rows,
    supported_variants,
)

VARIANTS = supported_variants()
NARROW = ("bf16", "int8")
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# The spacing of bf16 below 2^-126, where a bound relative to the value says nothing.
BF16_SUBNORMAL_STEP = 2.0**-133


def _kernel_step(variant, param, grad, state, *, threads=1, out_dtype=None, row_squares=None, **hyper):
    """One step of the kernel on copies: (param, state, out)."""
    param, state = param.clone(), {name: t.clone() for name, t in state.items()}
    out = None if out_dtype is None else torch.empty(param.numel(), dtype=out_dtype)
    cpu_adam_update(
        param, grad, state["exp_avg"], state["exp_avg_sq"],
        exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
        variant=variant, threads=threads, out=out, row_squares=row_squares, **{**HYPER, **hyper},
    )  # fmt: skip
    return param, state, out


def _reference_step(param, grad, state, *, out_dtype=None, **hyper):
    return sp.reference_adam_update(param, grad, state, out_dtype=out_dtype, **{**HYPER, **hyper})


def _per_element(scales: torch.Tensor, n: int) -> torch.Tensor:
    return scales.repeat_interleave(sp.BLOCK)[:n]


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    return _per_element(sp.as_blocks(x).abs().amax(dim=1), x.numel())


def _assert_within(got, want, allowed, what):
    bad = (got - want).abs() > allowed
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: element {k} is {float(got[k])!r}, the reference gives {float(want[k])!r} "
            f"(allowed {float(allowed[k]):.3g}; {int(bad.sum())} of {got.numel()} elements differ more)"
        )


def _assert_agree(variant, got, want, what):
    """Bit for bit for the scalar loop; within one step of the precision for the vector loops."""
    param, state, out = got
    ref_param, ref_state, ref_out = want
    if variant == "scalar":
        for name in ref_state:
            assert torch.equal(state[name], ref_state[name]), f"{what}: {name} differs from the reference"
        assert torch.equal(param, ref_param), f"{what}: the weights differ from the reference"
        if ref_out is not None:
            assert torch.equal(out, ref_out), f"{what}: the rounded weights differ from the reference"
        return
    _assert_within(param, ref_param, 1e-6 + 1e-6 * ref_param.abs(), f"{what}: param")
    m, v = sp.decode_moments(state)
    ref_m, ref_v = sp.decode_moments(ref_state)
    n = m.numel()
    if "exp_avg_scale" in ref_state:
        m_step = _per_element(ref_state["exp_avg_scale"], n) / sp.M_TOP
        _assert_within(m, ref_m, 1.01 * m_step, f"{what}: exp_avg (one int8 code)")
        # v's codes are of sqrt(v): one code there.
        root_step = _per_element(ref_state["exp_avg_sq_scale"], n) / sp.V_TOP
        _assert_within(v.sqrt(), ref_v.sqrt(), 1.01 * root_step, f"{what}: sqrt(exp_avg_sq) (one uint8 code)")
        for name in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.allclose(state[name], ref_state[name], rtol=1e-5, atol=0), f"{what}: {name}"
    else:
        for name, got_x, want_x in (("exp_avg", m, ref_m), ("exp_avg_sq", v, ref_v)):
            # One bf16 ulp (2^-7 of the value at most), and the fp32 noise of a sum that cancels.
            allowed = 2.0**-7 * torch.maximum(got_x.abs(), want_x.abs()) + BF16_SUBNORMAL_STEP
            _assert_within(got_x, want_x, allowed + 1e-6 * _block_absmax(want_x), f"{what}: {name} (one ulp)")
    if ref_out is not None:
        assert torch.equal(out, param.to(out.dtype)), f"{what}: out is not the new weights rounded"


def _random(n, seed=0, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    m, v = 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)
    return param, grad, m, v


def _agree_over_steps(variant, precision, param, grad, m, v, what, steps=3, **kwargs):
    state = sp.encode_moments(m, v, precision)
    for step in range(1, steps + 1):
        got = _kernel_step(variant, param, grad, state, step=step, **kwargs)
        kwargs_ref = {k: val for k, val in kwargs.items() if k not in ("threads", "row_squares")}
        _assert_agree(variant, got, _reference_step(param, grad, state, step=step, **kwargs_ref),
                      f"{what}, step {step}")  # fmt: skip
        param, state = got[0], got[1]
        grad = grad.roll(1)


# ------------------------------------------------------------------------------------ the reference's own codes
def test_round_to_bf16_is_torchs_nearest_even():
    edges = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, float("inf"), -0.0, 1e-40, 2**-133,
                          3 * 2**-134, 0.1, -1 / 3])  # fmt: skip
    values = torch.cat([edges, torch.randn(1000, generator=torch.Generator().manual_seed(0))])
    want = values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(sp.round_to_bf16(values), want)
    assert torch.equal(sp.bf16_bits_to_float(want), values.to(torch.bfloat16).float())


@pytest.mark.parametrize("signed", [True, False])
def test_a_code_is_within_half_a_step_of_its_value(signed):
    x = torch.randn(3 * sp.BLOCK + 5, generator=torch.Generator().manual_seed(1))
    x = x if signed else x.abs()
    codes, scales = sp.quantize_blocks(x, signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8) and scales.numel() == 4
    half_step = _per_element(scales, x.numel()) / (sp.M_TOP if signed else sp.V_TOP) / 2
    _assert_within(sp.dequantize_blocks(codes, scales, signed), x, half_step * 1.001, "round trip")


# ---------------------------------------------------------------------------------- the kernel, per variant
@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_each_variant_follows_the_reference(variant, precision, adamw, grad_dtype):
    # 2 blocks and 1003 elements: neither a multiple of a block nor of a vector. fp16 gradients without L2
    # decay (adamw) are the case where the vector loops fold grad_scale into the moments' weights.
    param, grad, m, v = _random(2 * sp.BLOCK + 1003, grad_dtype=grad_dtype)
    _agree_over_steps(variant, precision, param, grad, m, v, f"{variant}, {precision}", adamw=adamw,
                      grad_scale=0.125)  # fmt: skip


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_whose_square_overflows_before_it_is_scaled(variant, precision, grad_dtype):
    # 1e20 squared is past fp32's 3.4e38; scaled by 1e-12 first it is 1e16. The vector loops fold the scale
    # into the moments' weights only for fp16 gradients, whose squares stay finite: here they must not.
    param, grad, m, v = _random(sp.BLOCK + 40, grad_dtype=grad_dtype)
    grad, state = grad * 1e20, sp.encode_moments(m, v, precision)
    hyper = dict(step=1, adamw=True, grad_scale=1e-12)
    what = f"{variant}, {precision}, {grad_dtype}"
    got = _kernel_step(variant, param, grad, state, **hyper)
    _assert_agree(variant, got, _reference_step(param, grad, state, **hyper), what)
    assert bool(torch.isfinite(sp.decode_moments(got[1])[1]).all()), f"{what}: v overflowed"


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_codes_the_moments_as_the_reference_does(variant, precision):
    # With betas 0 the new moments are g and g * g, exact in every variant, fused or not. The codes must then be
    # the reference's bit for bit, which one step's bound above would not see (a code truncated instead of
    # rounded is off by < 1). With betas 1 they are the decoded old ones: the gradient's weights are then 0, so
    # the vector int8 loops hand every block to the scalar loop, and every variant must agree bit for bit.
    # Moments of 1e-39 as well: 127 / scale overflows fp32 there, and m's codes are divided instead.
    param, grad, m, v = _random(2 * sp.BLOCK + 1003, seed=5)
    for size in (1.0, 1e-39):
        state = sp.encode_moments(m * size, v * size, precision)
        for betas in ((0.0, 0.0), (1.0, 1.0)):
            hyper = dict(step=1, betas=betas, weight_decay=0.0, bias_correction=False)
            got = _kernel_step(variant, param, grad * size, state, **hyper)[1]
            want = _reference_step(param, grad * size, state, **hyper)[1]
            for name in want:
                same = got[name] == want[name]
                assert bool(same.all()), (
                    f"x{size}, betas {betas}: {name} differs at {int((~same).sum())} elements"
                )


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
def test_low_precision_gradients_and_a_rounded_copy(variant, precision):
    param, grad, m, v = _random(sp.BLOCK + 77, grad_dtype=torch.bfloat16)
    _agree_over_steps(variant, precision, param, grad, m, v, f"{variant}, {precision}, bf16 grad, fp16 out",
                      out_dtype=torch.float16)  # fmt: skip


@pytest.mark.parametrize("n", [1, 7, 17, sp.BLOCK - 1, sp.BLOCK, sp.BLOCK + 1, 2 * sp.BLOCK + 15])
@pytest.mark.parametrize("precision", NARROW)
def test_any_length(n, precision):
    param, grad, m, v = _random(n, seed=n)
    for variant in VARIANTS:
        _agree_over_steps(variant, precision, param, grad, m, v, f"{variant}, {precision}, n={n}", steps=2)


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_block_of_zeros_stays_zero(variant, precision):
    param, grad, m, v = _random(3 * sp.BLOCK)
    grad[sp.BLOCK : 2 * sp.BLOCK] = 0
    m[sp.BLOCK : 2 * sp.BLOCK] = 0
    v[sp.BLOCK : 2 * sp.BLOCK] = 0
    state = sp.encode_moments(m, v, precision)
    got = _kernel_step(variant, param, grad, state, step=1, weight_decay=0.0)
    _assert_agree(variant, got, _reference_step(param, grad, state, step=1, weight_decay=0.0), "zeros")
    new_param, new_state, _ = got
    middle = slice(sp.BLOCK, 2 * sp.BLOCK)
    assert torch.equal(new_param[middle], param[middle]), "a zero gradient with zero moments moved a weight"
    new_m, new_v = sp.decode_moments(new_state)
    assert not new_m[middle].any() and not new_v[middle].any()
    if precision == "int8":
        assert new_state["exp_avg_scale"][1] == 0 and new_state["exp_avg_sq_scale"][1] == 0
        assert bool((new_state["exp_avg_scale"][[0, 2]] > 0).all())


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_huge_value_sets_its_own_block_only(variant, precision):
    param, grad, m, v = _random(3 * sp.BLOCK)
    # g * g = 1e36 is still finite in fp32.
    grad[sp.BLOCK + 5] = 1e18
    state = sp.encode_moments(m, v, precision)
    got = _kernel_step(variant, param, grad, state, step=1)
    _assert_agree(variant, got, _reference_step(param, grad, state, step=1), "one huge gradient")
    if precision == "int8":
        calm = grad.clone()
        calm[sp.BLOCK + 5] = 1.0
        quiet = _kernel_step(variant, param, calm, state, step=1)[1]
        scales = got[1]["exp_avg_scale"]
        assert scales[1] > 1e16, "the huge value's block must take its scale from it"
        assert torch.equal(scales[[0, 2]], quiet["exp_avg_scale"][[0, 2]]), "the other blocks' scales changed"
        # The block's small moments fall below half a code: their codes are 0, and so is their v.
        assert int((got[1]["exp_avg"][sp.BLOCK : 2 * sp.BLOCK] != 0).sum()) == 1


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
def test_denormal_moments_and_gradients(variant, precision):
    n = sp.BLOCK + 40
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(n, generator=gen)
    # Below 2^-126 = 1.18e-38: subnormal.
    grad = torch.randn(n, generator=gen) * 1e-39
    m = torch.randn(n, generator=gen) * 1e-40
    v = torch.rand(n, generator=gen) * 1e-40
    assert bool((grad.abs() < 1.18e-38).all()) and bool((grad != 0).any())
    # No L2 decay: weight_decay x w would add a normal number to every gradient. AdamW's leaves them tiny.
    what = f"{variant}, {precision}, subnormal"
    _agree_over_steps(variant, precision, param, grad, m, v, what, eps=1e-30, weight_decay=0.01, adamw=True)
    state = _kernel_step(variant, param, grad, sp.encode_moments(m, v, precision), step=1, adamw=True)[1]
    new_m, new_v = sp.decode_moments(state)
    assert float(new_m.abs().max()) < 1.18e-38, "m left the subnormals: the test would not test them"
    assert float(new_v.max()) < 1.18e-38, "v left the subnormals: the test would not test them"


@pytest.mark.parametrize("precision", NARROW)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_an_eps_as_large_as_the_root_of_v(variant, precision, grad_dtype):
    # The vector loops add eps (x sqrt(bc2), and for int8 blocks in the units of sqrt(v) / sqrt(v_weight)) to
    # the root of v. With the usual 1e-8 it is far below a root of ~0.1, and any eps would pass; here it is
    # the denominator's larger part for most elements.
    param, grad, m, v = _random(sp.BLOCK + 1003, seed=17, grad_dtype=grad_dtype)
    _agree_over_steps(variant, precision, param, grad, m, v, f"{variant}, {precision}, eps 0.05", eps=0.05,
                      adamw=True, grad_scale=0.25)  # fmt: skip


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_moments_near_the_top_of_fp32(variant, grad_dtype):
    # The vector int8 loops keep the new moments in units of the gradient's weights: m / 0.1 and sqrt(v) /
    # sqrt(0.001) here (x 1 / grad_scale as well for fp16 gradients). A block whose m is near fp32's top, or
    # whose sqrt(v) is near the square root of it, would pass 3.4e38 in those units where the reference stays
    # finite: such blocks must go to the scalar loop. One block is that large, the next an ordinary one.
    param, grad, m, v = _random(2 * sp.BLOCK, seed=13, grad_dtype=grad_dtype)
    m[: sp.BLOCK] *= 3e37 / float(m[: sp.BLOCK].abs().max())
    v[: sp.BLOCK] *= 1e36 / float(v[: sp.BLOCK].max())
    state = sp.encode_moments(m, v, "int8")
    hyper = dict(step=2, adamw=True, grad_scale=0.5)
    what = f"{variant}, {grad_dtype}, moments near the top"
    got = _kernel_step(variant, param, grad, state, **hyper)
    _assert_agree(variant, got, _reference_step(param, grad, state, **hyper), what)
    new_m, new_v = sp.decode_moments(got[1])
    assert bool(torch.isfinite(new_m).all() and torch.isfinite(new_v).all()), f"{what}: a moment overflowed"


@pytest.mark.parametrize("precision", ("fp32", *NARROW))
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_rounded_copy_lands_whole_streamed_or_not(variant, precision):
    # The vector loops write the 16-bit copy with streaming stores where its first element is aligned to the
    # store (32 bytes for AVX-512, 16 for AVX2), with plain stores elsewhere. Offsets of 0, 1, 8 and 16 elements
    # into a larger buffer take both ways; on 2 threads each thread's chunk streams (or not) on its own. Every
    # element must be the new weight rounded, and nothing outside the view may be written.
    n = 2**17 + 37
    param, grad, m, v = _random(n, seed=11, grad_dtype=torch.float16)
    state = sp.encode_moments(m, v, precision)
    sentinel = -7.0
    for dtype in (torch.float16, torch.bfloat16):
        for offset in (0, 1, 8, 16):
            buffer = torch.full((n + offset + 5,), sentinel, dtype=dtype)
            out = buffer[offset : offset + n]
            new_param, new_state = param.clone(), {name: t.clone() for name, t in state.items()}
            cpu_adam_update(
                new_param, grad, new_state["exp_avg"], new_state["exp_avg_sq"],
                exp_avg_scale=new_state.get("exp_avg_scale"), exp_avg_sq_scale=new_state.get("exp_avg_sq_scale"),
                step=1, variant=variant, threads=2, out=out, **HYPER,
            )  # fmt: skip
            what = f"{variant}, {precision} moments, {dtype} copy at offset {offset}"
            assert torch.equal(out, new_param.to(dtype)), f"{what}: the copy is not the new weights rounded"
            outside = torch.cat([buffer[:offset], buffer[offset + n :]])
            assert bool((outside == sentinel).all()), f"{what}: an element outside the copy was written"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "scalar"])
def test_nan_and_inf_gradients_code_as_the_scalar_loop_does(variant):
    # The engine refuses a step whose gradients hold a NaN or an Inf before the kernel sees them. Called
    # directly, every variant must still write the scalar loop's codes: a NaN is passed over by its block's
    # largest and coded as the lowest code (-127 for m, 0 for sqrt v); an Inf makes its block's scale Inf.
    # Betas 0 make the new moments g and g * g, exact in every variant, so the codes can be compared bit for bit.
    param, grad, m, v = _random(3 * sp.BLOCK + 64, seed=7)
    grad[[5, 700, sp.BLOCK + 17, 3 * sp.BLOCK + 3]] = float("nan")
    grad[2 * sp.BLOCK + 9] = float("inf")
    state = sp.encode_moments(m, v, "int8")
    hyper = dict(step=1, betas=(0.0, 0.0), weight_decay=0.0, bias_correction=False)
    want = _kernel_step("scalar", param, grad, state, **hyper)[1]
    got = _kernel_step(variant, param, grad, state, **hyper)[1]
    assert int(want["exp_avg"][5]) == -127 and int(want["exp_avg_sq"][5]) == 0, "the scalar loop's NaN codes"
    assert bool(want["exp_avg_scale"].isfinite()[[0, 1, 3]].all()), "a NaN reached a block's scale"
    for name in want:
        same = got[name] == want[name]
        if got[name].is_floating_point():
            same |= got[name].isnan() & want[name].isnan()
        assert bool(same.all()), f"{name} differs from the scalar loop's at {int((~same).sum())} elements"


@pytest.mark.parametrize("precision", NARROW)
def test_one_and_two_threads_give_the_same_bits(precision):
    # Each thread takes at least 2^16 elements: this length splits in two, the second chunk inside no block
    # boundary of its own unless the split is on one.
    n = 2**17 + sp.BLOCK + 5
    param, grad, m, v = _random(n)
    state = sp.encode_moments(m, v, precision)
    for variant in VARIANTS:
        rows = [torch.empty(norm_rows(n)) for _ in range(2)]
        one = _kernel_step(variant, param, grad, state, step=2, threads=1, row_squares=rows[0])
        two = _kernel_step(variant, param, grad, state, step=2, threads=2, row_squares=rows[1])
        assert torch.equal(one[0], two[0]), f"{variant}, {precision}: the weights depend on the threads"
        for name in one[1]:
            assert torch.equal(one[1][name], two[1][name]), (
                f"{variant}, {precision}: {name} depends on threads"
            )
        assert torch.equal(rows[0], rows[1])
        three = _kernel_step(variant, param, grad, state, step=2, threads=2)
        assert torch.equal(three[1]["exp_avg"], two[1]["exp_avg"]), "the row squares changed the update"


def test_bfloat16_tensors_and_uint16_bits_are_the_same_state():
    param, grad, m, v = _random(1000)
    bits = sp.encode_moments(m, v, "bf16")
    typed = {name: t.view(torch.bfloat16) for name, t in bits.items()}
    for variant in VARIANTS:
        a, b = (
            _kernel_step(variant, param, grad, bits, step=1),
            _kernel_step(variant, param, grad, typed, step=1),
        )
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1]["exp_avg"], b[1]["exp_avg"].view(torch.uint16))


@pytest.mark.parametrize("nontemporal", [False, True], ids=["plain stores", "streaming stores"])
@pytest.mark.parametrize("precision", NARROW)
def test_the_narrow_floor_touches_every_element_and_each_blocks_scales(precision, nontemporal):
    # Two threads, and a last block that is not whole: every element is copied, every scale touched once.
    n = 2**17 + sp.BLOCK + 5
    param, grad16, out = torch.zeros(n), torch.randn(n).half(), torch.zeros(n, dtype=torch.float16)
    state = sp.zeros_state(n, precision)
    try:
        memory_floor(param, grad16, state["exp_avg"], state["exp_avg_sq"], out=out, threads=2,
                     exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
                     nontemporal=nontemporal)  # fmt: skip
    except ValueError as err:  # a CPU without AVX2 has no streaming stores, and says so
        assert nontemporal and "AVX2" in str(err)
        return
    assert torch.equal(out, grad16), "the floor copies the gradient bits to the output, all of them"
    for name in ("exp_avg", "exp_avg_sq"):  # zeros before: every byte of the moments read and written once
        assert torch.equal(state[name].view(torch.uint8), torch.ones(state[name].view(torch.uint8).shape,
                                                                      dtype=torch.uint8)), name  # fmt: skip
    if precision == "int8":
        for name in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.equal(state[name], torch.ones(sp.blocks(n))), f"{name}: each block's scale once"
    with pytest.raises(ValueError, match="narrow moments is defined for 16-bit gradients"):
        memory_floor(param, grad16.float(), state["exp_avg"], state["exp_avg_sq"],
                     exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"))  # fmt: skip


# ------------------------------------------------------------------------------------------- wrong arguments
def _call(exp_avg, exp_avg_sq, n=3000, **scales):
    param, grad = torch.zeros(n), torch.zeros(n)
    cpu_adam_update(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, **scales)


def test_wrong_moment_dtypes_say_what_to_pass():
    n, codes, roots = 3000, torch.zeros(3000, dtype=torch.int8), torch.zeros(3000, dtype=torch.uint8)
    scales = dict(exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="exp_avg has dtype float16; it must be float32, bfloat16"):
        _call(torch.zeros(n, dtype=torch.float16), torch.zeros(n))
    with pytest.raises(ValueError, match="exp_avg .* is signed: .* torch.int8, not torch.uint8"):
        _call(roots, roots, **scales)
    with pytest.raises(
        ValueError, match="exp_avg_sq holds 8-bit codes of sqrt.* torch.uint8, not torch.int8"
    ):
        _call(codes, codes, **scales)
    with pytest.raises(ValueError, match="exp_avg is bf16 but exp_avg_sq is fp32: both moments"):
        _call(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n))


def test_wrong_scales_say_what_to_pass():
    n, codes, roots = 3000, torch.zeros(3000, dtype=torch.int8), torch.zeros(3000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8-bit moments need exp_avg_scale: an fp32 tensor of 2 elements"):
        _call(codes, roots, exp_avg_sq_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="exp_avg_sq_scale has 3 elements; .* need 2, one per block of 2048"):
        _call(codes, roots, exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(3))
    with pytest.raises(ValueError, match="exp_avg_scale has dtype float64; it must be float32"):
        _call(
            codes, roots, exp_avg_scale=torch.zeros(2, dtype=torch.float64), exp_avg_sq_scale=torch.zeros(2)
        )
    with pytest.raises(ValueError, match="exp_avg_scale is only for 8-bit moments"):
        _call(torch.zeros(n), torch.zeros(n), exp_avg_scale=torch.zeros(2))
