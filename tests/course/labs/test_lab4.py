"""Lab 4 (tuning 调优篇): graded tests. `make lab4` grades your files, `make lab4 LAB_DIR=solutions` the reference.

4.1-4.3 are in C (tuning/csrc/cpu_adam.c); 4.4 is in Python (tuning/state_precision.py, `quantize_blocks`) and
is graded by the tests at the end of this file, on any machine.

Your tuning/csrc/cpu_adam.c is compiled once per task, with the engine's own code standing in for the other two
tasks' regions, so each task is graded on its own: an unfinished tail (4.3) cannot fail the vector loop (4.1), and
the fp16 store (4.2) runs inside a correct loop. Your code is found by the line `/* Lab 4.x: ... */` above it (or
by the BEGIN/END LAB markers of the engine's own file).

4.1 and 4.2 need an x86-64 CPU with AVX2/FMA/F16C and are skipped elsewhere. There 4.3's code is not compiled
into the kernel at all (the vector variant falls back to the scalar loop), so it is tested in a small portable
harness: a scalar loop in steps of 8 stands in for the vector loop and your tail finishes each chunk.
ZO_LAB4_MACHINE=arm64 grades as such a machine would (the graders' own tests use it).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from zero_offload.cli.grade import labkit
from zero_offload.tuning import build as build_module
from zero_offload.tuning import cpu_adam, state_precision

pytestmark = pytest.mark.lab4
LEARNER = "tuning/csrc/cpu_adam.c"  # as the compiler names your file in its errors
ENGINE = Path(__file__).resolve().parents[3] / "src" / "zero_offload" / LEARNER  # the reference regions

if not os.environ.get("ZO_GRADING_LAB") and not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
    # Outside grading, as in tests/modules/test_cpu_adam.py; a grading run fails instead, saying how to get a
    # compiler.
    pytest.skip("no C compiler on this machine", allow_module_level=True)


def _why_no_vector_loop() -> str | None:
    machine = os.environ.get("ZO_LAB4_MACHINE") or platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return f"this machine is {machine}, where the kernel has only its scalar loop"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # no /proc (macOS, Windows): the kernel's own CPU check answers if the loop cannot run
        return None
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    return f"this x86-64 CPU lacks {', '.join(missing)}" if missing else None


WHY_NOT = _why_no_vector_loop()


def needs_vector_loop(task: str):
    where = "grade 4.1 and 4.2 on an x86-64 machine; 4.3 is graded here"
    reason = f"Lab {task} needs an x86-64 CPU with AVX2/FMA/F16C; {WHY_NOT} ({where})"
    if task == "4.3":
        reason = f"Lab 4.3 runs inside the AVX2 loop only on x86-64; {WHY_NOT}: the portable test grades it"
    return pytest.mark.skipif(WHY_NOT is not None, reason=reason)


where_the_vector_loop_cannot_run = pytest.mark.skipif(
    WHY_NOT is None, reason="the AVX2 loop runs on this machine: Lab 4.3 is tested inside it"
)


# ------------------------------------------------------------------ your file, with the engine's other regions
_TITLE = re.compile(r"^[ \t]*/\* Lab (?P<id>4\.\d+): .*\*/\s*$")  # the line a stub keeps above your code
_CODE = re.compile(r"/\*|//|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|[{}]")  # outside comments


def _end_of_stub_region(lines: list[str], start: int) -> int:
    """The line after your code: the next task's title, or the brace that closes the block it stands in."""
    depth, in_comment = 0, False
    for n in range(start + 1, len(lines)):
        line, position = lines[n], 0
        if _TITLE.match(line) or "BEGIN LAB" in line:
            return n
        while position < len(line):
            if in_comment:
                close = line.find("*/", position)
                in_comment, position = close < 0, len(line) if close < 0 else close + 2
                continue
            token = _CODE.search(line, position)
            if token is None or token.group(0) == "//":
                break
            position = token.end()
            if token.group(0) == "/*":
                in_comment = True
            elif token.group(0) in "{}":
                depth += 1 if token.group(0) == "{" else -1
                if depth < 0:
                    return n
    return len(lines)


def _spans(text: str) -> dict[str, tuple[int, int]]:
    """Task id -> [first, last + 1) lines of its code in `text`: marked regions, or a stub's title onwards."""
    lines = text.splitlines(keepends=True)
    try:
        regions = labkit.find_regions(text, LEARNER)
    except labkit.LabMarkerError:  # broken markers: fall back to the titles
        regions = []
    spans = {r.task_id: (r.start - 1, r.end) for r in regions if r.lab == 4}
    for n, line in enumerate(lines):
        title = _TITLE.match(line)
        if title and title["id"] not in spans:
            spans[title["id"]] = (n, _end_of_stub_region(lines, n))
    return spans


def _engine_regions() -> dict[str, tuple[int, list[str]]]:
    text = ENGINE.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    return {
        r.task_id: (r.start, lines[r.start - 1 : r.end])
        for r in labkit.find_regions(text, ENGINE)
        if r.lab == 4
    }


def hybrid_source(text: str, keep: str) -> str:
    """Your file with the engine's regions for every task but `keep`; #line keeps the compiler's line numbers
    those of your file. Unchanged (no #line) when your other regions already are the engine's."""
    lines, spans, engine = text.splitlines(keepends=True), _spans(text), _engine_regions()
    out, position = [], 0
    for task, (start, end) in sorted(spans.items(), key=lambda item: item[1]):
        if task == keep or task not in engine or lines[start:end] == engine[task][1]:
            continue
        first, reference = engine[task]
        out += lines[position:start]
        out += [f'#line {first} "the engine\'s Lab {task}, standing in for yours"\n', *reference]
        out.append(f'#line {end + 1} "{LEARNER}"\n')
        position = end
    if not out:
        return text
    return f'#line 1 "{LEARNER}"\n' + "".join(out + lines[position:])


# Where the AVX2 loop cannot run, zo_adam_update is replaced by one that runs your tail after a scalar loop in
# steps of 8, over two chunks as two threads would split them (the tail must stay inside its own chunk).
_PORTABLE_HEAD = "#define zo_adam_update zo_engine_adam_update\n"
_PORTABLE_TAIL = """
#undef zo_adam_update
static void zo_lab_chunk(const zo_adam_args *a, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) adam_scalar(a, i, i + 8);
#line %(line)d "%(file)s"
%(tail)s
}

int zo_adam_update(const zo_adam_args *a, int variant, int threads) {
    if (variant == ZO_SCALAR) {
        adam_scalar(a, 0, a->n);
        return 0;
    }
    int64_t half = threads > 1 ? ((a->n + 1) / 2 + 63) / 64 * 64 : a->n;
    if (half > a->n) half = a->n;
    zo_lab_chunk(a, 0, half);
    zo_lab_chunk(a, half, a->n);
    return zo_missing_lab() ? -2 : 0;
}
"""


def portable_source(text: str) -> str:
    span = _spans(text).get("4.3")
    if span is None:
        pytest.fail("your Lab 4.3 code is not found: keep the line /* Lab 4.3: the scalar tail */ above it")
    tail = "".join(text.splitlines(keepends=True)[span[0] : span[1]])
    harness = _PORTABLE_TAIL % {"line": span[0] + 1, "file": LEARNER, "tail": tail}
    return f'{_PORTABLE_HEAD}#line 1 "{LEARNER}"\n{hybrid_source(text, "4.3")}{harness}'


def _compiler_errors(source: str, learner: str, error: Exception) -> str:
    """The compiler's first error (one line, for the table) and its first errors with their source lines."""
    if not source.startswith(("#line", _PORTABLE_HEAD)):  # your file as it is: name it as the others do
        source = f'#line 1 "{LEARNER}"\n{source}'
    with tempfile.TemporaryDirectory() as tmp:
        # Your file under the name the #line directives give it, so that the compiler can quote your lines.
        (Path(tmp) / LEARNER).parent.mkdir(parents=True)
        (Path(tmp) / LEARNER).write_text(learner, encoding="utf-8")
        (Path(tmp) / "check.c").write_text(source, encoding="utf-8")
        command = [build_module._compiler(), "-c", *build_module.FLAGS, "-I", str(build_module.CSRC)]
        run = subprocess.run([*command, "check.c", "-o", "check.o"], cwd=tmp, capture_output=True, text=True)
    lines = run.stderr.splitlines()
    first = next((k for k, line in enumerate(lines) if "error:" in line), None)
    if first is None:
        return f"the build failed: {type(error).__name__}: {error}"
    parsed = re.match(r"(?P<file>[^:]+):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<what>.*)", lines[first])
    where = f"{Path(parsed['file']).name}:{parsed['line']}: {parsed['what']}" if parsed else lines[first]
    shown, quoting = [], False  # errors and the source lines quoted under them ("  176 |   foo(w);")
    for line in lines[first:]:
        quote = re.match(r"\s+\d*\s*\|", line)
        quoting = "error:" in line or (quoting and bool(quote))
        if quoting:
            shown.append(line)
    return "\n".join([f"does not compile: {where}", *shown[:6]])


_built: dict[str, object] = {}  # sha256 of the source -> module, or the compiler's message


def compile_kernel(source: str, learner: str):
    """The cffi module for a C source made from your file `learner` (cached); a compile error fails the test
    with the compiler's words."""
    key = hashlib.sha256(source.encode()).hexdigest()
    if key not in _built:
        with tempfile.TemporaryDirectory(prefix="zo-lab4-") as tmp:
            path = Path(tmp) / "cpu_adam.c"
            path.write_text(source, encoding="utf-8")
            try:
                _built[key] = build_module.build(path)
            except build_module.CompilerNotFound as error:
                _built[key] = f"no C compiler to build your kernel with\n{error}"
            except Exception as error:  # cffi wraps the compiler's exit status; its words went to stderr
                _built[key] = _compiler_errors(source, learner, error)
    if isinstance(_built[key], str):
        pytest.fail(_built[key], pytrace=False)
    return _built[key]


def kernel_for(task: str, text: str, *, portable: bool = False):
    """Your file `text` compiled for grading `task`; `portable`: Lab 4.3's harness."""
    return compile_kernel(portable_source(text) if portable else hybrid_source(text, task), text)


def _task(request) -> str:
    return request.node.get_closest_marker("task").args[0]


@pytest.fixture
def kernel(request):
    return kernel_for(_task(request), build_module.SOURCE.read_text(encoding="utf-8"))


@pytest.fixture
def portable_kernel(request):
    return kernel_for(_task(request), build_module.SOURCE.read_text(encoding="utf-8"), portable=True)


# ---------------------------------------------------------------------------------------- running an update
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.1)  # eps large: a wrong scale shows
GUARD = 9  # elements after each array: a loop that runs past its end writes there
SENTINEL = 96.0  # exact in fp32, fp16 and bf16


def _arrays(n, *, seed=0, grad_dtype=torch.float32, out_dtype=None, offset=1):
    """Buffers, and views into them that start `offset` elements in (unaligned) with GUARD elements after."""
    gen = torch.Generator().manual_seed(seed)
    values = {
        "param": torch.randn(n, generator=gen),
        "grad": torch.randn(n, generator=gen).to(grad_dtype),
        "exp_avg": 0.1 * torch.randn(n, generator=gen),
        "exp_avg_sq": 0.01 * torch.rand(n, generator=gen),
    }
    if out_dtype is not None:
        values["out"] = torch.zeros(n, dtype=out_dtype)
    buffers = {}
    for name, value in values.items():
        buffers[name] = torch.full((offset + n + GUARD,), SENTINEL, dtype=value.dtype)
        buffers[name][offset : offset + n] = value
    return buffers, {name: buffer[offset : offset + n] for name, buffer in buffers.items()}


def _update(kernel, views, **kwargs) -> None:
    with mock.patch.object(cpu_adam, "build", lambda: kernel):  # cpu_adam_update's checks, then this kernel
        cpu_adam.cpu_adam_update(
            views["param"],
            views["grad"],
            views["exp_avg"],
            views["exp_avg_sq"],
            out=views.get("out"),
            **kwargs,
        )


def _check_guards(buffers, n, case, offset=1):
    for name, buffer in buffers.items():
        outside = torch.cat([buffer[:offset], buffer[offset + n :]])
        if not bool((outside == SENTINEL).all()):
            raise AssertionError(f"{case}: something was written outside {name}'s {n} elements")


def _check_close(got, want, what, rtol=1e-6, atol=1e-7):
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: element {k} is {float(got[k]):.9g}, the scalar loop gives {float(want[k]):.9g} "
            f"({int(bad.sum())} of {got.numel()} elements differ)"
        )


def _check_fp16(out, param, what):
    expected = param.to(out.dtype)
    same = out.view(torch.int16) == expected.view(torch.int16)
    if not bool(same.all()):
        k = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: out[{k}] is {float(out[k])!r} for the weight {float(param[k])!r}; "
            f"rounded to nearest even it is {float(expected[k])!r}"
        )


def _agree(kernel, n, case, *, threads=1, grad_dtype=torch.float32, out_dtype=None, steps=3, **hyper):
    """Three steps of the vector variant against the scalar loop on the same numbers, unaligned, guarded."""
    hyper = {**HYPER, **hyper}
    runs = {}
    for variant in ("avx2", "scalar"):
        buffers, views = _arrays(n, grad_dtype=grad_dtype, out_dtype=out_dtype)
        for step in range(1, steps + 1):
            _update(kernel, views, step=step, variant=variant, threads=threads, **hyper)
        _check_guards(buffers, n, f"{case}, {variant}")
        runs[variant] = views
    for name in ("exp_avg", "exp_avg_sq", "param"):
        _check_close(runs["avx2"][name], runs["scalar"][name], f"{case}: {name}")
    if out_dtype is not None:  # written at every step: after the last, it is the last weights rounded
        _check_fp16(runs["avx2"]["out"], runs["avx2"]["param"], case)


# ---------------------------------------------------------------------------------------------------- Lab 4.1
@needs_vector_loop("4.1")
@pytest.mark.task("4.1")
def test_the_vector_loop_equals_the_scalar_loop(kernel):
    for n in (8, 64, 1000):
        for adamw, decay in ((False, 0.0), (False, 0.1), (True, 0.1)):
            case = f"n={n}, {'AdamW' if adamw else 'Adam'}, weight_decay={decay}, grad_scale=0.125"
            _agree(kernel, n, case, adamw=adamw, weight_decay=decay, grad_scale=0.125)


@needs_vector_loop("4.1")
@pytest.mark.task("4.1")
def test_the_vector_loop_trains_like_torch_adam_and_adamw(kernel):
    for adamw in (False, True):
        gen = torch.Generator().manual_seed(1)
        ours = torch.randn(1000, generator=gen)
        theirs = ours.clone().requires_grad_()
        reference = (torch.optim.AdamW if adamw else torch.optim.Adam)([theirs], **HYPER)
        m, v = torch.zeros_like(ours), torch.zeros_like(ours)
        for step in range(1, 11):
            grad = torch.randn(1000, generator=gen)
            # The loss-scaled gradient and its factor: a power of two, so the product is exact.
            views = dict(param=ours, grad=grad * 8, exp_avg=m, exp_avg_sq=v)
            _update(
                kernel, views, step=step, adamw=adamw, grad_scale=0.125, variant="avx2", threads=1, **HYPER
            )
            theirs.grad = grad.clone()
            reference.step()
        state = reference.state[theirs]
        for name, got, want in (("exp_avg", m, state["exp_avg"]), ("exp_avg_sq", v, state["exp_avg_sq"]),
                                ("param", ours, theirs.detach())):  # fmt: skip
            error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            optimizer = "torch.optim.AdamW" if adamw else "torch.optim.Adam (L2 decay)"
            assert error < 1e-6, f"{name} after 10 steps: relative error {error:.1e} from {optimizer}"


@needs_vector_loop("4.1")
@pytest.mark.task("4.1")
def test_fp16_and_bf16_gradients_are_read_by_the_vector_loop(kernel):
    for grad_dtype in (torch.float16, torch.bfloat16):
        _agree(kernel, 64, f"{str(grad_dtype).removeprefix('torch.')} gradients", grad_dtype=grad_dtype)


@needs_vector_loop("4.1")
@pytest.mark.task("4.1")
def test_the_loop_starts_at_begin_and_stops_before_the_tail(kernel):
    # Two threads (each gets at least 2^16 elements): the second chunk begins at element 2^16. Length 1003: the
    # engine's tail does the last 3.
    _agree(kernel, 2**17, "n=131072 on 2 threads", threads=2, adamw=True)
    _agree(kernel, 1003, "n=1003 (the last 3 by the engine's tail)", adamw=True)


# ---------------------------------------------------------------------------------------------------- Lab 4.2
@needs_vector_loop("4.2")
@pytest.mark.task("4.2")
def test_the_fp16_copy_is_torchs_round_to_nearest_even(kernel):
    for n in (8, 64, 1000):
        _agree(kernel, n, f"n={n}, fp16 out", out_dtype=torch.float16, adamw=True)


@needs_vector_loop("4.2")
@pytest.mark.task("4.2")
def test_fp16_rounding_edges(kernel):
    # Ties go to even (1 + 2^-11 -> 1, 1 + 3 * 2^-11 -> 1 + 2^-9, 2049 -> 2048), subnormals, the largest fp16 and
    # past it: with lr 0 the weights are only rounded, all of them inside the vector loop (32 elements).
    edges = [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), -(1 + 3 * 2**-11), 2049.0, 2051.0, 2**-24, 3 * 2**-25,
             2**-25, -(2**-25), 6.1e-5, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, float("inf"),
             float("-inf"), -0.0, 1e-9, 0.1, -1 / 3]  # fmt: skip
    values = torch.tensor((edges * 2)[:32])
    views = dict(param=values.clone(), grad=torch.zeros(32), exp_avg=torch.zeros(32), exp_avg_sq=torch.zeros(32),
                 out=torch.full((32,), SENTINEL, dtype=torch.float16))  # fmt: skip
    _update(kernel, views, step=1, lr=0.0, variant="avx2")
    _check_fp16(views["out"], values, "rounding edges")


# ---------------------------------------------------------------------------------------------------- Lab 4.3
LENGTHS = (1, 7, 9, 15, 17, 2**12 + 3)


def _every_length(kernel):
    for n in LENGTHS:
        _agree(kernel, n, f"n={n}", out_dtype=torch.float16)
    _agree(kernel, 2**17 + 3, "n=131075 on 2 threads (the first chunk ends at 65600)", threads=2)


@needs_vector_loop("4.3")
@pytest.mark.task("4.3")
def test_every_length_works_with_the_vector_loop(kernel):
    _every_length(kernel)


@where_the_vector_loop_cannot_run
@pytest.mark.task("4.3")
def test_every_length_works_in_the_portable_harness(portable_kernel):
    _every_length(portable_kernel)


# ---------------------------------------------------------------------------------------------------- Lab 4.4
# Your tuning/state_precision.py, quantize_blocks, against a trusted form: hand-computed blocks, and per block in
# double precision scale = max |x|, code = x * top / scale, which your fp32 codes must round to nearest even.
def _quantize(x: torch.Tensor, signed: bool):
    codes, scales = state_precision.quantize_blocks(x, signed=signed)
    want = torch.int8 if signed else torch.uint8
    assert codes.dtype == want, f"the codes are {codes.dtype}, they should be {want} (signed={signed})"
    assert codes.numel() == x.numel(), f"{codes.numel()} codes for {x.numel()} elements"
    n_blocks = -(-x.numel() // 2048)
    assert scales.numel() == n_blocks, f"{scales.numel()} scales for {x.numel()} elements: one per 2048"
    return codes.flatten(), scales.flatten().float()


def _exact(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 2048, in double precision: the unrounded codes x * top / scale, and the scales."""
    flat = x.flatten().double()
    exact, scales = torch.zeros_like(flat), []
    for start in range(0, flat.numel(), 2048):
        block = flat[start : start + 2048]
        scale = float(block.abs().max())
        scales.append(scale)
        if scale > 0:
            exact[start : start + 2048] = block * top / scale
    return exact, torch.tensor(scales, dtype=torch.float64)


def _check_codes(x: torch.Tensor, signed: bool, case: str) -> None:
    top = 127 if signed else 255
    codes, scales = _quantize(x, signed)
    exact, want_scales = _exact(x, top)
    bad_scale = scales.double() != want_scales
    if bool(bad_scale.any()):
        b = int(bad_scale.nonzero()[0])
        raise AssertionError(
            f"{case}: block {b} (elements {2048 * b}...) has scale {float(scales[b]):.9g}, its largest |x| "
            f"is {float(want_scales[b]):.9g}"
        )
    got = codes.double()
    # Within a hair of a tie, fp32's x * (top / scale) may round the other way than exact arithmetic.
    near_tie = (exact - exact.floor() - 0.5).abs() < 1e-4
    wrong = (got != torch.round(exact)) & ~(near_tie & ((got - exact).abs() <= 0.5 + 1e-4))
    if bool(wrong.any()):
        k = int(wrong.nonzero()[0])
        raise AssertionError(
            f"{case}: element {k} = {float(x.flatten()[k]):.9g} (block {k // 2048}, scale "
            f"{float(want_scales[k // 2048]):.9g}) has code {int(codes[k])}; x * {top} / scale = "
            f"{float(exact[k]):.6f}, rounded to nearest even {int(torch.round(exact[k]))} "
            f"({int(wrong.sum())} of {x.numel()} codes differ)"
        )
    # The round trip: each value comes back within half a code step of its block, scale / (2 * top).
    per_element = want_scales.repeat_interleave(2048)[: x.numel()]
    error = (x.flatten().double() - got * per_element / top).abs()
    over = error > per_element / (2 * top) * (1 + 1e-4)
    assert not bool(over.any()), f"{case}: {int(over.sum())} values come back further than scale / {2 * top}"


def _moments(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m-like and sqrt(v)-like values whose size changes from block to block (1e-6 ... 10)."""
    gen = torch.Generator().manual_seed(seed)
    size = 10.0 ** torch.randint(-6, 2, (-(-n // 2048),), generator=gen).float()
    size = size.repeat_interleave(2048)[:n]
    return torch.randn(n, generator=gen) * size, torch.rand(n, generator=gen) * size


@pytest.mark.task("4.4")
def test_hand_computed_blocks_round_to_nearest_even():
    # Block 0: scale 127, so code = x exactly (127 / 127 = 1): ties 62.5 -> 62, 63.5 -> 64, 1.5 -> 2, 2.5 -> 2,
    # -0.5 -> 0, -1.5 -> -2. Block 1: scale 2, 127 / 2 = 63.5: 1 -> 63.5 -> 64, -0.5 -> -31.75 -> -32. The tail
    # (5 elements): scale 4, 127 / 4 = 31.75: 1 -> 31.75 -> 32, 0.1 -> 3.175 -> 3.
    x = torch.zeros(2 * 2048 + 5)
    x[:8] = torch.tensor([127.0, 62.5, 63.5, 1.5, 2.5, -0.5, -1.5, -127.0])
    x[2048:2052] = torch.tensor([2.0, 1.0, -0.5, -2.0])
    x[4096:4101] = torch.tensor([0.1, 1.0, -4.0, 0.0, 2.0])
    codes, scales = _quantize(x, signed=True)
    assert scales.tolist() == [127.0, 2.0, 4.0], (
        f"the scales are {scales.tolist()}, one block's largest |x| each"
    )
    want = {0: 127, 1: 62, 2: 64, 3: 2, 4: 2, 5: 0, 6: -2, 7: -127, 8: 0, 2048: 127, 2049: 64, 2050: -32,
            2051: -127, 4096: 3, 4097: 32, 4098: -127, 4099: 0, 4100: 64}  # fmt: skip
    got = {k: int(codes[k]) for k in want}
    assert got == want, f"codes (element: code) {got}, they should be {want}"
    assert int(codes.abs().sum()) == sum(abs(c) for c in want.values()), "a zero element got a code"


@pytest.mark.task("4.4")
def test_sqrt_v_gets_unsigned_codes_up_to_255():
    # sqrt(v) >= 0: all 256 codes for the range [0, scale], so 1/255 of the block's largest is code 1, not 0.
    x = torch.zeros(2048)
    x[:7] = torch.tensor([255.0, 1.0, 3.0, 0.5, 1.5, 254.5, 100.5])
    codes, scales = _quantize(x, signed=False)
    assert scales.tolist() == [255.0]
    got = codes[:7].tolist()
    assert got == [255, 1, 3, 0, 2, 254, 100], f"codes {got}: sqrt(v) uses 0...255 (x * 255 / scale)"
    assert int(codes[7:].sum()) == 0
    small = torch.full((2048,), 1e-3)
    small[0] = 0.1
    codes, _ = _quantize(small, signed=False)
    assert int(codes[1]) == 3, f"1/100 of the block's largest has code {int(codes[1])}, 255 / 100 rounds to 3"


@pytest.mark.task("4.4")
def test_every_block_has_its_own_scale():
    # One block of large values must not take the resolution of the others: blocks of 2048 from element 0.
    for n, seed in ((1, 0), (2047, 1), (2048, 2), (2049, 3), (3 * 2048 + 77, 4), (20_000, 5)):
        m, root_v = _moments(n, seed)
        _check_codes(m, True, f"m, n={n}")
        _check_codes(root_v, False, f"sqrt(v), n={n}")
    m, _ = _moments(3 * 1000, 6)
    _check_codes(m.view(3, 1000), True, "m of shape (3, 1000), blocks over the flat order")


@pytest.mark.task("4.4")
def test_zero_blocks_have_scale_zero_and_codes_zero():
    for signed in (True, False):
        codes, scales = _quantize(torch.zeros(2048 + 10), signed)
        assert scales.tolist() == [0.0, 0.0] and int(codes.abs().sum()) == 0, "zeros: scales 0, codes 0"
        x = torch.zeros(3 * 2048)
        x[2048:4096] = torch.linspace(0.0, 1.0, 2048)  # zero blocks around one that is not
        _check_codes(x, signed, f"a zero block on each side of another, signed={signed}")


@pytest.mark.task("4.4")
def test_tiny_blocks_still_get_full_codes():
    # 127 / 1e-37 is beyond fp32's largest number (3.4e38): these blocks need the other order of operations.
    for signed in (True, False):
        x = torch.tensor([1e-37, 5e-38, 2.5e-38, 7e-38] * 512)
        if signed:
            x[1::2] *= -1
        _check_codes(x, signed, f"a block whose largest |x| is 1e-37, signed={signed}")
