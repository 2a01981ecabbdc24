"""The C Adam (zero_offload.tuning): every variant against the scalar loop, the scalar loop against torch.optim.

Skipped as a whole where no C compiler exists; the fallback for that case is tested in test_engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from zero_offload.tuning import build as build_module

if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
    pytest.skip("no C compiler on this machine", allow_module_level=True)

from zero_offload.tuning.cpu_adam import (  # noqa: E402
    NORM_ROW,
    CPUAdam,
    cpu_adam_update,
    memory_floor,
    norm_rows,
    squared_norm_of_rows,
    supported_variants,
)

VARIANTS = [
    v
    for bit, v in ((0, "scalar"), (1, "avx2"), (2, "avx512"))
    if build_module.build().lib.zo_cpu_variants() & (1 << bit)
]
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 2**20 + 3]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _tensors(n, seed=0, grad_dtype=torch.float32, offset=0):
    """param, grad, m, v; with `offset` each is a view that starts `offset` elements into a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    values = [
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen).to(grad_dtype),
        torch.zeros(n),
        torch.zeros(n),
    ]
    views = []
    for value in values:
        buffer = torch.empty(n + offset, dtype=value.dtype)
        buffer[offset:] = value
        views.append(buffer[offset:])  # unaligned when offset is odd: the C loop must not assume alignment
    return views


def _run(variant, n, steps=3, threads=1, **kwargs):
    param, grad, m, v = _tensors(
        n, grad_dtype=kwargs.pop("grad_dtype", torch.float32), offset=kwargs.pop("offset", 0)
    )
    out = kwargs.pop("out_dtype", None)
    out = torch.empty(n, dtype=out) if out is not None else None
    for step in range(1, steps + 1):
        cpu_adam_update(
            param, grad, m, v, step=step, variant=variant, threads=threads, out=out, **HYPER, **kwargs
        )
    return param, m, v, out


@pytest.mark.parametrize("adamw", [False, True])
def test_the_scalar_loop_equals_torch_adam_over_100_steps(adamw):
    gen = torch.Generator().manual_seed(1)
    ours = torch.randn(4099, generator=gen)
    theirs = ours.clone().requires_grad_()
    reference = (torch.optim.AdamW if adamw else torch.optim.Adam)([theirs], **HYPER)
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    for step in range(1, 101):
        grad = torch.randn(4099, generator=gen)
        cpu_adam_update(ours, grad, m, v, step=step, adamw=adamw, variant="scalar", **HYPER)
        theirs.grad = grad.clone()
        reference.step()
    # Relative as a norm: torch orders the operations differently (lerp for m), a few ulps apart per step.
    for got, want in ((ours, theirs.detach()), (m, reference.state[theirs]["exp_avg"]),
                      (v, reference.state[theirs]["exp_avg_sq"])):  # fmt: skip
        assert float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)) < 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", LENGTHS)
def test_every_variant_equals_the_scalar_loop_at_every_length(variant, n):
    for got, want in zip(_run(variant, n, offset=1)[:3], _run("scalar", n)[:3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_and_outputs_match_torchs_own_casts(variant, low):
    n = 1037
    param, m, v, out = _run(variant, n, grad_dtype=low, out_dtype=low)
    # The reference reads the same low-precision gradient, upcast by torch.
    p_ref, g_ref, m_ref, v_ref = _tensors(n, grad_dtype=low)
    for step in range(1, 4):
        cpu_adam_update(p_ref, g_ref.float(), m_ref, v_ref, step=step, variant="scalar", **HYPER)
    torch.testing.assert_close(param, p_ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, param.to(low)), "the rounded copy must be torch's round-to-nearest-even cast"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_rounding_edges(variant):
    # Ties, subnormals, the largest fp16 and beyond: written with lr 0, the weights are only rounded.
    values = torch.tensor(
        [1 + 2**-11, 1 + 3 * 2**-11, 2**-24, 3 * 2**-25, 65504.0, 65519.0, 65520.0, -0.0, 1e-9]
    )
    values = values.repeat(3)  # long enough for the vector loop and its tail
    grad = torch.zeros_like(values)
    out = torch.empty_like(values, dtype=torch.float16)
    cpu_adam_update(values.clone(), grad, torch.zeros_like(values), torch.zeros_like(values), step=1, lr=0.0,
                out=out, variant=variant)  # fmt: skip
    assert torch.equal(out, values.to(torch.float16))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_rounding_edges(variant):
    # Ties to even both ways, the carry into the exponent, the largest finite bf16 and past it, inf, nans.
    tie_down, tie_up = 1 + 2**-8, 1 + 3 * 2**-8
    values = torch.tensor(
        [tie_down, tie_up, 2 - 2**-9, 3.3895314e38, 3.4e38, float("inf"), -float("inf"), float("nan"), -0.0]
    )
    # NaNs whose payload sits in the low 16 bits: rounded like numbers they would carry into inf or wrap to 0.
    payloads = torch.tensor([0x7FFFFFFF, -1, 0x7FC0FFFF], dtype=torch.int32).view(torch.float32)
    values = torch.cat([values, payloads]).repeat(3)
    out = torch.empty_like(values, dtype=torch.bfloat16)
    cpu_adam_update(values.clone(), torch.zeros_like(values), torch.zeros_like(values), torch.zeros_like(values),
                step=1, lr=0.0, out=out, variant=variant)  # fmt: skip
    want = values.to(torch.bfloat16)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("nontemporal", [False, True], ids=["plain stores", "streaming stores"])
def test_the_memory_floor_touches_every_byte_and_refuses_other_layouts(nontemporal):
    # Two threads and a tail that is not a whole vector: every byte of w, m and v is read and written back
    # plus one (so that no array is skipped and no store is left out), and the gradient is copied to the output.
    n = 2**17 + 77
    param, grad, m, v = _tensors(n)
    grad16, out = grad.half(), torch.zeros(n, dtype=torch.float16)
    before = [t.clone() for t in (param, m, v)]
    try:
        memory_floor(param, grad16, m, v, out=out, threads=2, nontemporal=nontemporal)
    except ValueError as err:  # a CPU without AVX2 has no streaming stores, and says so
        assert nontemporal and "AVX2" in str(err)
        return
    assert torch.equal(out, grad16), "the 16-bit floor copies the gradient bits to the output, all of them"
    for name, old, new in zip(("param", "exp_avg", "exp_avg_sq"), before, (param, m, v), strict=True):
        plus_one = (old.view(torch.uint8).int() + 1) % 256
        assert torch.equal(new.view(torch.uint8).int(), plus_one), f"{name}: every byte once"
    with pytest.raises(ValueError, match="16-bit gradients with a 16-bit output"):
        memory_floor(param, grad, m, v, out=out)
    with pytest.raises(ValueError, match="grad has 999 elements"):
        memory_floor(param, grad[:999], m, v)


def test_the_kernel_passes_its_tests_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The same tests, with the kernel built with -fsanitize=address,undefined (see build.SANITIZE_FLAGS)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    libasan = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout
    if not os.path.isabs(libasan.strip()):
        pytest.skip("this compiler has no AddressSanitizer runtime (libasan)")
    env = dict(os.environ, LD_PRELOAD=libasan.strip(), ASAN_OPTIONS="detect_leaks=0",
               ZO_CPU_ADAM_SANITIZE="1", ZO_CACHE_DIR=str(tmp_path))  # fmt: skip
    tests = "not sanitizers and not compiler and not changed_source"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "error" not in run.stderr.lower(), run.stderr[-3000:]


@pytest.mark.parametrize("variant", VARIANTS)
def test_threads_give_identical_results(variant):
    results = [_run(variant, 300_001, threads=t)[0] for t in (1, 2, 3, 4)]
    assert all(torch.equal(r, results[0]) for r in results[1:])


def _row_squares(variant, n, threads=1, grad_dtype=torch.float32, offset=0):
    param, grad, m, v = _tensors(n, grad_dtype=grad_dtype, offset=offset)
    rows = torch.full((norm_rows(n),), float("nan"))  # every row must be written
    cpu_adam_update(param, grad, m, v, step=1, variant=variant, threads=threads, grad_scale=0.5, row_squares=rows,
                **HYPER)  # fmt: skip
    reference = _tensors(n, grad_dtype=grad_dtype)[1].double() * 0.5
    return rows, reference


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_update_sums_the_squared_gradient_norm_row_by_row(variant, grad_dtype):
    n = 5 * NORM_ROW + 13  # a short last row
    rows, reference = _row_squares(variant, n, grad_dtype=grad_dtype)
    expected = reference.square().view(-1)
    expected_rows = [float(expected[r : r + NORM_ROW].sum()) for r in range(0, n, NORM_ROW)]
    # fp32 sums of 4096 squares: a few parts in a million (the scalar loop, adding one at a time, the most)
    torch.testing.assert_close(
        rows.double(), torch.tensor(expected_rows, dtype=torch.float64), rtol=3e-5, atol=0
    )
    assert squared_norm_of_rows(rows) == pytest.approx(float(expected.sum()), rel=3e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_row_squares_do_not_depend_on_threads_or_alignment(variant):
    n = 300_001
    first, _ = _row_squares(variant, n)
    for threads, offset in ((2, 0), (3, 1), (4, 5)):
        rows, _ = _row_squares(variant, n, threads=threads, offset=offset)
        assert torch.equal(rows, first), (threads, offset)


def test_row_squares_of_the_wrong_size_are_refused_before_any_memory_is_touched():
    param, grad, m, v = _tensors(NORM_ROW + 1)
    before = param.clone()
    with pytest.raises(ValueError, match="row_squares has 1 elements but .* 2"):
        cpu_adam_update(param, grad, m, v, step=1, row_squares=torch.zeros(1), **HYPER)
    assert torch.equal(param, before)


def test_the_gradient_factor_is_the_same_as_scaling_the_gradient_first():
    param, grad, m, v = _tensors(100)
    p2, m2, v2 = param.clone(), m.clone(), v.clone()
    cpu_adam_update(param, grad, m, v, step=1, grad_scale=0.125, **HYPER)
    cpu_adam_update(p2, grad * 0.125, m2, v2, step=1, **HYPER)
    torch.testing.assert_close(param, p2, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(param=t["param"].half()), "param has dtype float16"),
        (lambda t: t.update(grad=t["grad"].double()), "grad has dtype float64"),
        (lambda t: t.update(exp_avg=torch.zeros(200)[::2]), "exp_avg is not contiguous"),
        (lambda t: t.update(exp_avg_sq=torch.zeros(99)), "exp_avg_sq has 99 elements"),
        (lambda t: t.update(out=torch.empty(100, dtype=torch.int32)), "out has dtype int32"),
    ],
)
def test_bad_tensors_are_refused_before_any_memory_is_touched(change, message):
    param, grad, m, v = _tensors(100)
    tensors = dict(param=param, grad=grad, exp_avg=m, exp_avg_sq=v)
    change(tensors)
    before = {k: t.clone() for k, t in tensors.items()}
    with pytest.raises(ValueError, match=message):
        cpu_adam_update(step=1, **HYPER, **tensors)
    assert all(torch.equal(tensors[k], before[k]) for k in before)


def test_cpu_adam_trains_like_torch_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    b.load_state_dict(a.state_dict())
    ours, theirs = CPUAdam(a.parameters(), **HYPER), torch.optim.AdamW(b.parameters(), **HYPER)
    for _ in range(20):
        x = torch.randn(8, 64)
        for model, optimizer in ((a, ours), (b, theirs)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_no_compiler_is_an_error_that_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("ZO_CACHE_DIR", str(tmp_path))  # nothing cached: it would have to compile
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(build_module, "_loaded", {})
    with pytest.raises(build_module.CompilerNotFound, match="apt-get install gcc"):
        build_module.build()


def test_a_changed_source_is_a_new_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("ZO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build_module, "_loaded", {})
    source = tmp_path / "cpu_adam.c"
    source.write_text(build_module.SOURCE.read_text())
    first = build_module.build(source)
    source.write_text(build_module.SOURCE.read_text() + "\n/* edited */\n")
    second = build_module.build(source)
    assert first.__name__ != second.__name__ and len(list(tmp_path.glob("zo_cpu_adam_*"))) == 2


def test_a_missing_cffi_falls_back_to_torchs_adam_with_a_warning_that_names_it(monkeypatch):
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    from zero_offload.tuning.build import CompilerNotFound, build

    monkeypatch.setitem(sys.modules, "cffi", None)  # `import cffi` now raises ImportError
    with pytest.raises(CompilerNotFound, match="cffi is not installed"):
        build()
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    with pytest.warns(UserWarning, match="cffi is not installed"):
        engine = zo.initialize(torch.nn.Linear(4, 4), config, accelerator=EmulatedAccelerator())
    assert isinstance(engine.optimizer_step.optimizers.host, torch.optim.AdamW)


def _offload_config(**cpu_adam) -> dict:
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "zero_offload": {"cpu_adam": cpu_adam}}  # fmt: skip


def test_the_config_picks_the_kernel_loop_and_refuses_one_this_cpu_lacks(monkeypatch):
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    from zero_offload.config import ConfigError

    def host_optimizer(**cpu_adam):
        model = torch.nn.Linear(4, 4)
        engine = zo.initialize(model, _offload_config(**cpu_adam), accelerator=EmulatedAccelerator())
        return engine.optimizer_step.optimizers.host

    # "fastest", the default: the loop measured fastest on this machine, by name (tuning/variant_choice.py).
    assert host_optimizer().variant in supported_variants()
    assert host_optimizer(variant="widest").variant == "auto"  # what zo_adam_update dispatches to
    assert host_optimizer(variant="scalar").variant == "scalar"
    with pytest.raises(ConfigError, match="variant"):
        zo.config.load_config(_offload_config(variant="sse"))
    monkeypatch.setattr("zero_offload.tuning.cpu_adam.supported_variants", lambda: ["scalar"])
    with pytest.raises(ValueError, match="cannot run the 'avx2' variant.*scalar"):
        host_optimizer(variant="avx2")
