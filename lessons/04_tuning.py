# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 第 4 课 调优篇：卸载之后慢在哪，怎么把 CPU 那一侧做快
#
# 本笔记本配合 `course/04-tuning.md` 使用。第 3 课让 ZeRO-Offload 跑通了，本课回答"快不快"：
#
# 1. Adam 的屋顶线（roofline）：每个参数多少字节、多少次浮点运算，这台机器的平衡点在哪，各种 Adam 实现离内存带宽下限多远；
# 2. C 内核里发生了什么：AVX2 + FMA 的向量循环、标量尾巴、F16C 与 bf16 的就近舍入、运行时分派、构建缓存、sanitizer；
# 3. 卸载后的一遍扫描（one pass）：fp16 梯度进、fp16 权重出，与 PyTorch 分几遍做的流水线比；
# 4. 线程数：什么时候再加线程也没用，以及别和 PyTorch 抢核；
# 5. 部分卸载（`offload_optimizer.ratio`）：每一层存储的字节与 CPU 上 Adam 的耗时随比例怎么变；
# 6. 性能模型与 `zo plan`：13B 模型放进一张 80 GB 的卡，预测每步时间，再在这台机器上校准、与引擎实测对照；
# 7. 导言的"常见误区"表，逐条变成带数字的规则。
#
# 所有数字都在这台机器上现场测出；同一台机器上别的程序也在跑时计时会抖，所以每个比较都交替测量、取中位数。
# 图保存在仓库根目录的 `out/lessons/04/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会缩小问题规模，只用于快速检查笔记本能否跑通（`python tools/run_lessons.py --smoke 04`）。

# %%
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the bench's progress bars are for the terminal, not the notebook

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Image, display

import zero_offload as zo
from zero_offload import bench, plots
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.basics import estimate_model_states
from zero_offload.cli import main as zo_cli
from zero_offload.tuning import adam_update, advisor, bandwidth, build, parallel, perfmodel, plan_report
from zero_offload.tuning.cpu_adam import memory_floor, supported_variants
from zero_offload.units import format_bytes, format_gb
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

SMOKE = os.environ.get("ZO_SMOKE") == "1"
# Training runs and most timings use one torch thread, as lesson 3 does: on a 2-core machine that runs anything
# else, a 2-thread parallel region waits for a thread that is not scheduled. Sections 1 and 3 compare on two, as `make bench`.
torch.set_num_threads(1)
ROOT = Path.cwd().parent if Path.cwd().name == "lessons" else Path.cwd()
OUT = ROOT / "out" / "lessons" / "04"
OUT.mkdir(parents=True, exist_ok=True)
CORPUS = load_corpus()
KERNEL = build.build()  # the compiled C Adam (cffi): KERNEL.lib holds the functions of cpu_adam.h
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def show(fig, name: str) -> None:
    plots.show(fig, OUT / name)  # saved under out/lessons/04/ and displayed


def cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # macOS: no /proc; the kernel's own check (supported_variants) still answers
        return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


flags = cpu_flags()
print(f"{cpu_name()}, {platform.machine()}, {CORES} cores; torch {torch.__version__}; smoke mode: {SMOKE}")
print("CPU flags:", ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "fma", "f16c", "avx512f")))
print(f"C Adam variants this CPU runs: {', '.join(supported_variants())}")
print(f"figures go to {OUT.relative_to(ROOT)}/")

# %% [markdown]
# ## 1. Adam 的屋顶线：字节、浮点运算、平衡点
#
# 一个 fp32 参数的一步 Adam（梯度也是 fp32）：读 w、g、m、v，写回 w、m、v，每个 4 字节，共 **28 字节**；
# 算术是十几次浮点运算。卸载后的更新读 fp16 梯度、多写一份 fp16 权重，字节数也是 28；如果类型转换各自单独扫一遍，
# 字节数就多出一大截。先把账算清楚：

# %%
# Bytes a parameter: (read, written) per pass. A cast reads one dtype and writes another; an in-place scale reads
# and writes fp32; the Adam pass reads w, g, m, v and writes w, m, v.
PASSES = {
    "fp32 step: Adam over fp32 gradients": [("Adam", 16, 12)],
    "offload step, one pass: fp16 g in, fp16 w out": [("Adam + casts", 2 + 12, 12 + 2)],
    "engine's offload step, one pass: fp32 partition in, fp16 w out": [("Adam + cast", 4 + 12, 12 + 2)],
    "offload step, torch pipeline": [("upcast g", 2, 4), ("scale g", 4, 4), ("fused Adam", 16, 12),
                                     ("downcast w", 4, 2)],
}
# Flops per element (a divide and a square root count as one each): g*scale 1; m = b1*m + (1-b1)*g 3;
# v = b2*v + (1-b2)*g*g 4; sqrt(v)/bc2 + eps 3; w -= step * m/denom 3. AdamW's w *= 1 - lr*wd adds one.
FLOPS = 14
print(f"{'update':<64}{'passes':>7}{'read':>6}{'write':>6}{'bytes':>7}{'flop/byte':>11}")
for name, passes in PASSES.items():
    read, written = sum(p[1] for p in passes), sum(p[2] for p in passes)
    print(f"{name:<64}{len(passes):>7}{read:>6}{written:>6}{read + written:>7}{FLOPS / (read + written):>11.2f}")

# %% [markdown]
# 算术强度约 14 / 28 ≈ 0.5 FLOP/字节。它是不是"内存受限"（memory-bound），要和机器的**平衡点**比：
# 每从内存搬来一个字节的时间里，CPU 能做多少次浮点运算。两个数都在这台机器上量：
#
# - 算力：PyTorch 的 fp32 矩阵乘（它几乎把 FMA 单元用满）；
# - 内存带宽：`zo_memory_floor`，它按 Adam 的访问模式读写同样的 28 字节/参数，却几乎不做运算，是任何一遍扫描的 Adam 都快不过的下限。

# %%
FLOOR_N = 2_000_000 if SMOKE else 8_000_000  # 16 bytes a parameter of buffers: 128 MiB, four times the L3
floor_buffers = [torch.zeros(FLOOR_N) for _ in range(4)]
peak_flops = bandwidth.matmul_tflops(device="cpu", size=512 if SMOKE else 1024, repeats=7) * 1e12
floor_seconds = bandwidth.median_seconds(lambda: memory_floor(*floor_buffers, threads=1), repeats=7)
floor_bytes_per_s = 28 * FLOOR_N / floor_seconds
floor_buffers.clear()  # 128 MiB
machine_balance = peak_flops / floor_bytes_per_s
print("one thread:")
print(f"  fp32 matmul                {peak_flops / 1e9:6.1f} GFLOP/s")
print(f"  memory floor (28 B/param)  {floor_bytes_per_s / 1e9:6.1f} GB/s  ({FLOOR_N:,} parameters)")
print(f"  machine balance            {machine_balance:6.1f} flop/byte")
print(f"  Adam                       {FLOPS / 28:6.2f} flop/byte  -> Adam is {machine_balance / (FLOPS / 28):.0f}x "
      "below the balance: memory-bound")

# %% [markdown]
# 平衡点是 Adam 强度的好几倍：只看峰值算力，Adam 必然受内存带宽限制（这里只用一个核；多个核时算力和带宽都会涨，
# 但算力涨得更快，平衡点只会更高）。但 Adam 的运算里有开方和除法，
# 它们比乘加慢得多，所以"Adam 自己的算力上限"比矩阵乘低。最直接的办法是把同一个内核放在不同大小的数组上跑：
# 数组小到能放进缓存时，内存不是瓶颈，测到的就是算术的上限；数组远大于最后一级缓存时，测到的是内存的上限。
#
# 为了量内核本身（而不是 Python 的参数检查），下面直接通过 cffi 调用 C 函数 `zo_adam_update`：
# 先按 `cpu_adam.h` 里的结构体 `zo_adam_args` 填好指针和超参数，计时只包含 C 调用。

# %%
FFI, LIB = KERNEL.ffi, KERNEL.lib
VARIANT_ID = {"scalar": 0, "avx2": 1, "avx512": 2}


def raw_kernel(n: int, variant: str = "avx2", threads: int = 1, floor: bool = False):
    """A zero-argument call of the C function on its own fresh fp32 buffers (no Python checks on the timed path)."""
    w, g, m, v = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    args = FFI.new("zo_adam_args *")
    args.param, args.exp_avg, args.exp_avg_sq = (FFI.cast("float *", t.data_ptr()) for t in (w, m, v))
    args.grad, args.out, args.n = FFI.cast("void *", g.data_ptr()), FFI.NULL, n
    args.grad_dtype = args.out_dtype = args.adamw = 0  # fp32 gradients, no 16-bit output, Adam with L2 decay
    args.beta1, args.one_minus_beta1, args.beta2, args.one_minus_beta2 = 0.9, 0.1, 0.999, 0.001
    args.eps, args.weight_decay, args.decay, args.grad_scale = 1e-8, 0.0, 1.0, 1.0
    args.step_size, args.bias_correction2_sqrt = 1e-3 / (1 - 0.9), math.sqrt(1 - 0.999)  # step 1
    keep = (w, g, m, v, args)  # the closure keeps the buffers alive
    if floor:
        return lambda keep=keep: LIB.zo_memory_floor(keep[-1], threads)
    return lambda keep=keep: LIB.zo_adam_update(keep[-1], VARIANT_ID[variant], threads)


SWEEP_SIZES = [2**k for k in (range(12, 19, 2) if SMOKE else range(12, 24))]  # 4K .. 8M parameters
SWEEP_KINDS = {"C scalar": dict(variant="scalar"), "C avx2": dict(variant="avx2"), "memory floor": dict(floor=True)}
SWEEP_ELEMENTS = 2**20 if SMOKE else 4 * 2**20  # elements per timing: small arrays are called many times
SWEEP_ROUNDS = 3 if SMOKE else 7
calls = {(kind, n): raw_kernel(n, **kw) for kind, kw in SWEEP_KINDS.items() for n in SWEEP_SIZES}
sweep = {key: [] for key in calls}
for _ in range(SWEEP_ROUNDS):  # every round visits every (kind, size): a busy spell hits all of them alike
    for (kind, n), fn in calls.items():
        repeat = max(1, SWEEP_ELEMENTS // n)
        fn()
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        sweep[kind, n].append((time.perf_counter() - started) / repeat)
del calls
sweep_gbs = {key: 28 * key[1] / statistics.median(times) / 1e9 for key, times in sweep.items()}
print(f"{'parameters':>11}{'working set':>13}" + "".join(f"{k + ' GB/s':>20}" for k in SWEEP_KINDS))
for n in SWEEP_SIZES:
    print(f"{n:>11,}{format_bytes(16 * n):>13}" + "".join(f"{sweep_gbs[k, n]:>20.1f}" for k in SWEEP_KINDS))
in_cache = statistics.median(sweep_gbs["C avx2", n] for n in SWEEP_SIZES if 16 * n <= 2**20)
in_dram = sweep_gbs["C avx2", SWEEP_SIZES[-1]]
print(f"\nC avx2: {in_cache:.1f} GB/s with the working set in L2, {in_dram:.1f} GB/s at {format_bytes(16 * SWEEP_SIZES[-1])}"
      f" ({in_cache / in_dram:.1f}x); C scalar: {statistics.median(sweep_gbs['C scalar', n] for n in SWEEP_SIZES):.1f}"
      " GB/s at every size")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2))
ws = np.array(SWEEP_SIZES) * 16 / 2**20
for kind, style in zip(SWEEP_KINDS, ("s-", "o-", "k--"), strict=True):
    ax.plot(ws, [sweep_gbs[kind, n] for n in SWEEP_SIZES], style, label=kind, markersize=4)
for size, label in ((1, "L2 (1 MiB a core)"), (32, "L3 (32 MiB)")):
    ax.axvline(size, color="gray", linewidth=1, linestyle=":")
    ax.text(size * 1.1, ax.get_ylim()[1] * 0.92, label, fontsize=8, color="gray")
ax.set_xscale("log", base=2)
ax.set_xlabel("working set: w, g, m, v (MiB)")
ax.set_ylabel("GB/s at 28 bytes a parameter")
ax.set_title("One thread: the same kernel in cache and in DRAM")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
show(fig, "adam_roofline_sweep.png")

# %% [markdown]
# 读这张图（缓存大小是这台 AMD EPYC 的：每核 1 MiB L2，共享 32 MiB L3；你的机器用 `lscpu` 查）：
#
# - **标量循环**在任何大小上都差不多一样慢：它受算术限制（每个元素一次开方、两次除法，一个一个地做），内存再快也帮不上它；
# - **AVX2 循环**在缓存里快得多（一条指令做 8 个元素），数组超出 L3 后掉下来，贴着内存下限走：这时它受内存带宽限制，
#   算术已经藏在了访存后面；
# - 所以真实规模的模型（几百万到几十亿参数，状态远大于任何缓存）上，一个好的 CPU Adam 能做到的就是这条虚线。
#
# 接下来在 8M 个参数上比较所有实现，2 个线程（与 `make bench` 相同的代码：`bench.adam_implementations`），
# 每一轮把每个实现各测 3 次，共若干轮，取中位数。

# %%
IMPL_N = 262_144 if SMOKE else 8_000_000
adam_results = bench.adam_implementations(IMPL_N, rounds=3 if SMOKE else 7, threads=2)
torch.set_num_threads(1)
impl_ms, impl_floor = adam_results["median_ms"], adam_results["floor_ms"]
naive_ms, fused_ms = impl_ms["naive (basics.Adam)"], impl_ms["torch fused"]
print(f"Adam step over {IMPL_N:,} fp32 parameters, torch on 2 threads; medians of interleaved rounds\n")
print(f"{'implementation':<26}{'ms':>8}{'GB/s':>7}{'vs naive':>10}{'vs fused':>10}{'of floor':>10}")
for name, ms in {**impl_ms, "memory floor": impl_floor}.items():
    print(f"{name:<26}{ms:>8.2f}{28 * IMPL_N / ms / 1e6:>7.1f}{naive_ms / ms:>9.1f}x{fused_ms / ms:>9.2f}x"
          f"{impl_floor / ms:>10.0%}")
for name, why in adam_results["skipped"].items():
    print(f"{name}: not measured ({why})")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4))
names = list(impl_ms)
gbs = [28 * IMPL_N / impl_ms[n] / 1e6 for n in names]
colors = ["tab:blue" if n.startswith("ours") else "tab:gray" for n in names]
ax.barh(names, gbs, color=colors)
for y, value in enumerate(gbs):
    ax.text(value, y, f" {value:.1f}", va="center", fontsize=8)
floor_gbs = 28 * IMPL_N / impl_floor / 1e6
ax.axvline(floor_gbs, color="black", linestyle="--", label=f"memory floor {floor_gbs:.1f} GB/s")
ax.invert_yaxis()
ax.set_xlim(0, 1.15 * max(max(gbs), floor_gbs))
ax.set_xlabel("GB/s (28 bytes a parameter)")
ax.set_title(f"Adam step, {IMPL_N / 1e6:.1f}M fp32 params, 2 threads")
ax.legend(fontsize=8, loc="upper right")
show(fig, "adam_implementations.png")

# %% [markdown]
# - 朴素实现（第 1 课的 `basics.Adam`）每个公式一个 torch 运算，每个运算扫一遍内存并分配临时张量，远离下限；
#   `foreach` 把多个张量合并成一次调用，但每个公式仍是一遍扫描；
# - `torch.optim.Adam(fused=True)` 与我们的 AVX2 内核都是一遍扫描，都贴近内存下限：算术已经不是问题；
# - 我们的**标量**变体比 torch 的融合 Adam 慢好几倍：它是正确性的参照，不是给你用的。同一份 C 代码，差别全在向量化；
# - `ours avx2 x1` 和 `x2` 的差别说明一个线程离内存下限还有多远，第 4 节专门看线程。
#
# `make bench` 用同样的代码在 16.7M 个参数上跑一遍（还包括下面第 3 节的卸载更新和一次训练步的开销），
# 结果写进 `out/bench/results.json`。装了 DeepSpeed 时它也会测 `DeepSpeedCPUAdam` 作参照。

# %% [markdown]
# ## 2. C 内核里发生了什么
#
# `src/zero_offload/tuning/csrc/cpu_adam.c` 不到 400 行。核心是 AVX2 循环（它就是实验 4.1 要你写的部分），直接从源文件里取出来看：

# %%
SOURCE_LINES = build.SOURCE.read_text().splitlines()


def excerpt(first: str, last: str) -> list[str]:
    """The source lines from the first one containing `first` through the next one containing `last`."""
    start = next(i for i, line in enumerate(SOURCE_LINES) if first in line)
    end = next(i for i in range(start, len(SOURCE_LINES)) if last in SOURCE_LINES[i])
    return SOURCE_LINES[start : end + 1]


print("\n".join(excerpt("for (; i + 8 <= end; i += 8)", "END LAB 4.1")))
print("    ...")
print("\n".join(excerpt("BEGIN LAB 4.3", "END LAB 4.3")))

# %% [markdown]
# 逐行的道理：
#
# - `_mm256_loadu_ps`：一次读 8 个 fp32。带 `u` 的是不要求 32 字节对齐的读：引擎传进来的是一整块缓冲按单元切出的视图，
#   起点只保证 4 字节对齐；在现代 CPU 上，地址恰好对齐时 `loadu` 与对齐的 `load` 一样快，地址不对齐时也不会出错；
# - `load8_grad`：梯度可以是 fp32、fp16（F16C 的 `_mm256_cvtph_ps` 一条指令升成 8 个 fp32）或 bf16（bf16 就是 fp32 的高 16 位，
#   整数左移 16 位即可），再乘上 `scale`（1/损失缩放 × 裁剪系数），去缩放不需要单独一遍；
# - `_mm256_fmadd_ps(a, b, c)` = a·b + c，乘和加一条指令、**只舍入一次**。所以向量循环与标量循环的结果不逐位相同，
#   差在最后一位左右；标量循环用 `-ffp-contract=off` 编译，禁止编译器自己合成 FMA，它是测试用的参照；
# - `_mm256_fnmadd_ps(a, b, c)` = c − a·b，就是 `w -= step_size * (m / denom)`；
# - 循环每次前进 8 个元素，剩下不足 8 个的交给**标量尾巴**（实验 4.3）。没有尾巴，长度不是 8 的倍数时最后几个参数永远不更新；
#   把循环条件写成 `i < end`，就会读写数组末尾之外的内存。
#
# 先验证它算得对：与 `torch.optim.Adam`、`torch.optim.AdamW` 对照 10 步，再看向量与标量两个变体差多少。

# %%
def run_ours(n, steps, *, adamw, variant, out_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        adam_update(w, g * 8, m, v, step=step, lr=1e-3, weight_decay=0.01, adamw=adamw, grad_scale=1 / 8,
                    out=out, variant=variant, threads=1)
    return w, out


def run_torch(n, steps, *, adamw, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen).requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([w], lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        w.grad = torch.randn(n, generator=gen)
        opt.step()
    return w.detach()


N_CHECK, STEPS_CHECK = 100_003, 10  # an odd length: the tail runs too
print(f"{N_CHECK:,} parameters, {STEPS_CHECK} steps, lr 1e-3, weight decay 0.01, gradient x 8 then grad_scale 1/8\n")
for adamw in (False, True):
    reference = run_torch(N_CHECK, STEPS_CHECK, adamw=adamw)
    got = {variant: run_ours(N_CHECK, STEPS_CHECK, adamw=adamw, variant=variant)[0]
           for variant in supported_variants()}
    name = "AdamW" if adamw else "Adam (L2)"
    for variant, w in got.items():
        rel = float(torch.linalg.vector_norm(w - reference) / torch.linalg.vector_norm(reference))
        print(f"{name:<10} {variant:<7} vs torch.optim.{'AdamW' if adamw else 'Adam'}: relative error {rel:.1e}, "
              f"max |diff| {float((w - reference).abs().max()):.1e}")
    if "avx2" in got:
        diff = got["avx2"] != got["scalar"]
        print(f"{name:<10} avx2 vs scalar: {int(diff.sum()):,} of {N_CHECK:,} weights differ, "
              f"max |diff| {float((got['avx2'] - got['scalar']).abs().max()):.1e} (FMA rounds once)\n")

# %% [markdown]
# 尾巴：长度 n = 8k + r 时，向量循环做前 8k 个，标量循环做最后 r 个。把长度为 n 的视图放在一块更长的缓冲里，
# 后面留几个"哨兵"值，检查每个元素都更新了、哨兵一个没动：

# %%
SENTINEL = 12345.0
print(f"{'n':>5}{'vector loop':>13}{'scalar tail':>13}{'all updated':>13}{'guard intact':>14}")
for n in (1, 7, 8, 9, 15, 16, 17, 1003):
    buffers = [torch.full((n + 8,), SENTINEL) for _ in range(3)]
    w, m, v = (b[:n] for b in buffers)
    w.fill_(1.0)
    m.zero_()
    v.zero_()
    adam_update(w, torch.ones(n), m, v, step=1, lr=0.1, variant=supported_variants()[-1], threads=1)
    updated = bool((w != 1.0).all())
    intact = all(bool((b[n:] == SENTINEL).all()) for b in buffers)
    vector = n // 8 * 8 if "avx2" in supported_variants() else 0
    print(f"{n:>5}{vector:>13}{n - vector:>13}{updated!s:>13}{intact!s:>14}")

# %% [markdown]
# ### 就近舍入到偶数：F16C 与整数通道里的 bf16
#
# 卸载的更新在同一遍里把新的 fp32 主权重舍入成 fp16（或 bf16）写进上行缓冲。舍入必须与 PyTorch 的 `.half()`、`.bfloat16()`
# **逐位**相同（round to nearest, ties to even）：设备上的 fp16 权重应当是离 fp32 主权重最近的那个 fp16。换成截断，
# 权重每一步都系统性地偏向 0 一点；而且 C 内核与第 3 课的 Python 流水线写出的 fp16 权重就不再相同。
#
# - fp16：F16C 的 `_mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT)` 一条指令做完 8 个（实验 4.2）；
# - bf16：AVX2 没有 bf16 指令。bf16 是 fp32 的高 16 位，所以在整数通道里做：加上 0x7FFF 再加上第 16 位（保留部分的最低位），
#   右移 16 位，恰好是"就近、平局取偶"；NaN 单独处理，保证它仍是 NaN（否则加法可能把它进位成无穷大）。
#
# lr 设为 0，权重只被舍入，与 torch 的转换逐位比较，包括平局、次正规数、溢出和 NaN：

# %%
EDGES = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2049.0, 2**-24, 3 * 2**-25, 2**-25,
         6.1e-5, 65504.0, 65519.0, 65520.0, 1e6, 3e38, float("inf"), float("-inf"), -0.0, 1e-40, float("nan")]
values = torch.cat([torch.tensor(EDGES), torch.randn(100_000) * torch.logspace(-8, 6, 100_000)])
print(f"{values.numel():,} values: {len(EDGES)} edge cases (ties, subnormals, overflow, inf, nan) + random ones\n")
for dtype, reference in ((torch.float16, values.half()), (torch.bfloat16, values.bfloat16())):
    for variant in supported_variants():
        n = values.numel()
        out = torch.empty(n, dtype=dtype)
        adam_update(values.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, out=out,
                    variant=variant, threads=1)
        both_nan = out.isnan() & reference.isnan()
        same_bits = out.view(torch.int16) == reference.view(torch.int16)
        wrong = int((~(same_bits | both_nan)).sum())
        print(f"{str(dtype).removeprefix('torch.'):<9} {variant:<7} bit-identical to torch: {n - wrong:,} of {n:,}")
ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11])
print(f"\nties: fp16 {ties.tolist()} -> {ties.half().tolist()}; "
      f"bf16 {[1 + 2**-8, 1 + 3 * 2**-8]} -> {torch.tensor([1 + 2**-8, 1 + 3 * 2**-8]).bfloat16().tolist()}")

# %% [markdown]
# ### 运行时分派、线程与分块
#
# 内核**不用** `-march=native` 编译。x86 的向量函数各自带 `__attribute__((target("avx2,fma,f16c")))`，
# 文件的其余部分是可移植的 C；`zo_adam_update` 在运行时用 `__builtin_cpu_supports` 问 CPU 支持什么，
# 默认（`variant="auto"`）选最快的那个。于是同一个编译产物能在任何 x86-64 上运行，在 ARM（Apple silicon）上只编译出标量循环。
# 要一个这台 CPU 没有的变体，得到的是一条说清楚的错误，而不是非法指令崩溃：

# %%
n = 1024
for variant in ("avx512", "avx2"):
    try:
        adam_update(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, variant=variant)
        print(f"variant {variant!r}: ran")
    except ValueError as err:
        print(f"variant {variant!r}: ValueError: {err}")

# %% [markdown]
# 多线程时，`run_threads` 把 [0, n) 切成每个线程一段，每段的长度向上取整到 64 个元素（256 字节的 fp32，4 条 64 字节的缓存行）。
# 这样任何两个线程都不会写同一条缓存行：否则那条缓存行要在两个核之间来回传递所有权（伪共享，false sharing）。
# 调用线程自己做第一段，其余的各开一个 pthread；参数太少（一段就够）时根本不开线程。
#
# ### 构建缓存
#
# 第一次用到时，cffi 调用 C 编译器把 `cpu_adam.c` 编成一个 Python 扩展，放进 `~/.cache/zero_offload/`，文件名里带着
# 源文件、头文件、编译选项、Python 版本和机器架构的哈希：改了源码或选项就是新的键，永远不会加载过期的库。
# `make build` 提前编译。下面在一个临时缓存目录里重新编译一次，比较编译与从缓存加载的时间：

# %%
cached = sorted(p.name for p in build.cache_dir().glob("zo_cpu_adam_*"))
print(f"cache {build.cache_dir()}: {len(cached)} build(s), e.g. {cached[0] if cached else '-'}")
print(f"flags: {' '.join(build.FLAGS)}")
if not SMOKE:  # a compile takes seconds; smoke mode skips it
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        previous = os.environ.get("ZO_CACHE_DIR")
        os.environ["ZO_CACHE_DIR"] = tmp
        try:
            started = time.perf_counter()
            build.build(name="zo_cpu_adam_lesson")  # another module name: not in this process yet, not in tmp
            compile_s = time.perf_counter() - started
            started = time.perf_counter()
            build.build(name="zo_cpu_adam_lesson")
            again_s = time.perf_counter() - started
        finally:
            if previous is None:
                os.environ.pop("ZO_CACHE_DIR")
            else:
                os.environ["ZO_CACHE_DIR"] = previous
    print(f"compile into an empty cache: {compile_s:.1f} s; the same build() again: {again_s * 1e6:.0f} us")

# %% [markdown]
# ### 用 sanitizer 检查越界
#
# C 代码里的越界读写不会抛异常，它悄悄地读到别人的数据、写坏别人的内存。Python 这一层在调用前检查每个张量的 dtype、
# 设备、长度和连续性，但内核本身也要经得起检查：`ZO_CPU_ADAM_SANITIZE=1` 用 AddressSanitizer 和 UBSan 编译它
# （另一个缓存键），越界访问或未定义行为会立即停下并报告位置。Python 不是用 ASan 编译的，所以要预先加载 `libasan`。
# 下面在子进程里故意绕过 Python 的检查，让内核在 1000 个元素的缓冲上更新 1003 个：

# %%
ASAN_SCRIPT = """
import math, sys, torch
from zero_offload.tuning.build import build
k = build(); ffi = k.ffi
N = int(sys.argv[1])
w, g, m, v = (torch.zeros(1000) for _ in range(4))
a = ffi.new("zo_adam_args *")
a.param, a.exp_avg, a.exp_avg_sq = (ffi.cast("float *", t.data_ptr()) for t in (w, m, v))
a.grad, a.out, a.n = ffi.cast("void *", g.data_ptr()), ffi.NULL, N
a.beta1, a.one_minus_beta1, a.beta2, a.one_minus_beta2, a.eps = 0.9, 0.1, 0.999, 0.001, 1e-8
a.step_size, a.bias_correction2_sqrt, a.grad_scale, a.decay = 1e-2, math.sqrt(1e-3), 1.0, 1.0
k.lib.zo_adam_update(a, -1, 1)
print("n =", N, "on 1000 elements: no report")
"""
if SMOKE:
    print("smoke mode: skipped (it compiles the kernel with sanitizers)")
else:
    libasan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0", ZO_CPU_ADAM_SANITIZE="1")
    for count in (1000, 1003):
        run = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, str(count)], env=env,
                             capture_output=True, text=True, timeout=300)
        report = [line.replace(str(ROOT) + "/", "") for line in (run.stdout + run.stderr).splitlines()]
        keep = [line for line in report if "no report" in line or "ERROR: AddressSanitizer" in line
                or " in adam_" in line or "READ of size" in line or "WRITE of size" in line
                or "located" in line]
        print(f"n = {count}: exit code {run.returncode}")
        print(textwrap.indent("\n".join(keep[:6]), "    "))

# %% [markdown]
# n = 1003 时 ASan 在第一次越界读就停下，报告指向 `adam_scalar`，也就是尾巴那一行：缓冲后面紧挨着的 4 个字节已经不属于这个张量。
# 实验 4 的评分测试用另一种办法查越界：在缓冲两端放哨兵值，检查它们没有被改动（上面的表就是这么做的）。

# %% [markdown]
# ## 3. 一遍扫描：卸载后的更新
#
# 卸载后，CPU 上的一步要做四件事：fp16 梯度升成 fp32、乘以 1/S（和裁剪系数）、Adam、把新权重舍入成 fp16 上行。
# 用 PyTorch 拼，就是四遍扫描；C 内核一遍做完。两者都在 2 个线程上，交替测量（`bench.offload_update`，`make bench` 的同一段代码）：

# %%
OFFLOAD_N = 262_144 if SMOKE else 8_000_000
update = bench.offload_update(OFFLOAD_N, rounds=3 if SMOKE else 7, threads=2)
torch.set_num_threads(1)
pipeline_ms = update["median_ms"]["torch: upcast, scale, fused Adam, downcast"]
one_pass_ms = update["median_ms"]["ours, one pass"]
bytes_pipeline = sum(r + w for _, r, w in PASSES["offload step, torch pipeline"])
print(f"{OFFLOAD_N:,} parameters: fp16 gradients in, x 1/1024, Adam, fp16 weights out; 2 threads\n")
print(f"{'update':<44}{'ms':>8}{'bytes/param':>13}{'GB/s':>8}")
for name, ms, nbytes in (("torch: upcast, scale, fused Adam, downcast", pipeline_ms, bytes_pipeline),
                         ("ours, one pass", one_pass_ms, 28), ("memory floor, 16-bit form", update["floor_ms"], 28)):
    print(f"{name:<44}{ms:>8.2f}{nbytes:>13}{nbytes * OFFLOAD_N / ms / 1e6:>8.1f}")
print(f"\none pass is {pipeline_ms / one_pass_ms:.2f}x faster than the torch pipeline; "
      f"the bytes alone predict {bytes_pipeline / 28:.2f}x; one pass runs at {update['floor_ms'] / one_pass_ms:.0%} "
      "of its floor")

# %% [markdown]
# 字节数解释了大部分差距：torch 的流水线每个参数搬 48 字节，一遍扫描 28 字节。实测倍数比 48/28 更大时，多出的部分来自
# 流水线每一步都**新分配**的 4 字节/参数的 fp32 梯度张量（`grad16.float()`）：新分配的页第一次写入时要由操作系统清零、
# 建立映射，这也是内存流量和时间；另外三遍各自是一次 Python 调用，小模型上调用本身的开销也占了一份。第 3 课的引擎（`"cpu_adam": {"impl": "torch"}`）也是分几遍做的：梯度在下行时升精度、累加，
# Adam 之后 `publish` 再单独扫一遍舍入成 fp16。卸载后的默认实现 `"simd"` 把 Adam 与舍入并成一遍
# （`one_pass_offload_step`），引擎每步的 `adam_seconds` 里就包含了舍入。

# %% [markdown]
# ## 4. 线程：内存饱和之后，再多也没用
#
# 在 1 到 2 × 核数个线程上测三种 Adam 的吞吐：C Adam 的 fp32 形式、引擎卸载时用的形式（fp32 梯度分片进、fp16 权重出，30 字节/参数），
# 以及 torch 的融合 Adam（它用 PyTorch 的线程，`torch.set_num_threads`），再加上同样线程数的内存下限。
# 每次计时前先写一块比最后一级缓存大的缓冲，把 Adam 的状态挤出缓存：真实训练里反向传播之后，优化器状态早已不在缓存里。
# 每一轮把每种组合各测一次，取各轮的中位数。（`bandwidth.cpu_adam_sweep` 在你自己的机器上做同样的扫描。）

# %%
MAX_THREADS = CORES if SMOKE else 2 * CORES
THREAD_N = 524_288 if SMOKE else 4_000_000
THREAD_ROUNDS = 3 if SMOKE else 7
flush_src, flush_dst = torch.ones(bandwidth.FLUSH_BYTES // 4), torch.empty(bandwidth.FLUSH_BYTES // 4)
w32, g32, m32, v32 = torch.zeros(THREAD_N), torch.randn(THREAD_N), torch.zeros(THREAD_N), torch.zeros(THREAD_N)
out16 = torch.empty(THREAD_N, dtype=torch.float16)
torch_param = torch.zeros(THREAD_N, requires_grad=True)
torch_param.grad = torch.randn(THREAD_N)
torch_adam = torch.optim.Adam([torch_param], lr=1e-3, fused=True)
THREAD_KINDS = {  # name -> (bytes a parameter, one step on t threads)
    "C fp32": (28, lambda t: adam_update(w32, g32, m32, v32, step=1, lr=1e-3, threads=t)),
    "C fp32 -> fp16": (30, lambda t: adam_update(w32, g32, m32, v32, step=1, lr=1e-3, out=out16, threads=t)),
    "torch fused": (28, lambda t: torch_adam.step()),
    "memory floor": (28, lambda t: memory_floor(w32, g32, m32, v32, threads=t)),
}
thread_times = {(kind, t): [] for kind in THREAD_KINDS for t in range(1, MAX_THREADS + 1)}
for _ in range(THREAD_ROUNDS):
    for t in range(1, MAX_THREADS + 1):
        torch.set_num_threads(t)  # torch's pool is resized here, untimed
        for kind, (_, step) in THREAD_KINDS.items():
            step(t)  # warm: a resized pool starts its threads on first use
            flush_dst.copy_(flush_src)
            started = time.perf_counter()
            step(t)
            thread_times[kind, t].append(time.perf_counter() - started)
torch.set_num_threads(1)
rates = {key: THREAD_N / statistics.median(times) for key, times in thread_times.items()}
print(f"{THREAD_N:,} parameters, cold caches; million parameters/s (GB/s); medians of {THREAD_ROUNDS} rounds\n")
print(f"{'threads':>7}" + "".join(f"{kind:>18}" for kind in THREAD_KINDS))
for t in range(1, MAX_THREADS + 1):
    cells = [f"{rates[k, t] / 1e6:.0f} ({nbytes * rates[k, t] / 1e9:4.1f})" for k, (nbytes, _) in THREAD_KINDS.items()]
    print(f"{t:>7}" + "".join(f"{c:>18}" for c in cells))
best = {kind: max(range(1, MAX_THREADS + 1), key=lambda t, k=kind: rates[k, t]) for kind in THREAD_KINDS}
print("\nfastest thread count: " + ", ".join(f"{k} {t}" for k, t in best.items()))
print(f"C fp32 at {CORES} threads vs 1: {rates['C fp32', CORES] / rates['C fp32', 1]:.2f}x; "
      f"memory floor: {rates['memory floor', CORES] / rates['memory floor', 1]:.2f}x")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
xs = list(range(1, MAX_THREADS + 1))
for kind, style in zip(THREAD_KINDS, ("o-", "s-", "^-", "k--"), strict=True):
    ax.plot(xs, [rates[kind, t] / 1e6 for t in xs], style, label=kind)
ax.axvline(CORES, color="gray", linestyle=":", linewidth=1)
ax.text(CORES, 0, f" {CORES} cores", fontsize=8, color="gray", va="bottom", transform=ax.get_xaxis_transform())
ax.set_xticks(xs)
ax.set_ylim(bottom=0)
ax.set_xlabel("threads")
ax.set_ylabel("million parameters per second")
ax.set_title(f"CPU Adam throughput vs threads ({THREAD_N / 1e6:.1f}M params, cold caches)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
show(fig, "adam_threads.png")

# %% [markdown]
# 在一台空闲的机器上：一个核能同时等待的缓存行数有限，所以一个线程常常跑不满内存带宽，第二个线程还有用；
# 几个线程一起把内存通道占满之后，曲线就平了，再加线程只是让更多的核一起排队等内存。超过核数之后，线程还要轮流占用核：
# 内核按线程**静态**切分工作，被挤下核的那一段决定整步的时间，吞吐只会持平或下降。大服务器上同理，只是饱和点在几十个线程。
#
# 如果上表里 1 个线程最快，连不做运算的内存下限在 2 个线程时也更慢，那是因为这台机器上别的程序正占着一个核：
# 第二个线程排不上核，整步就要等它。共享的机器上多开线程是有风险的。
#
# 线程还有固定成本。每次调用要做 Python 这一层的检查、经过 cffi，多线程时还要创建、回收线程。用小张量量一下每次调用的开销：

# %%
small = [torch.zeros(1024) for _ in range(4)]
small_out = torch.empty(1024, dtype=torch.float16)
for t in (1, 2):
    per_call = bandwidth.median_seconds(
        lambda t=t: [adam_update(*small, step=1, lr=1e-3, out=small_out, threads=t) for _ in range(200)], repeats=5
    ) / 200
    print(f"adam_update on 1,024 parameters, {t} thread(s): {per_call * 1e6:.0f} us a call")

# %% [markdown]
# 引擎每步对每个单元调用一次（`TinyGPT("small")` 有 39 个单元），所以这个固定开销乘以单元数就是每步多出来的时间，
# 性能模型里它是"调用次数 × 每次调用的开销"那一项（第 6 节）。
#
# ### 别和 PyTorch 抢核
#
# 卸载训练里 CPU 上不止 Adam：数据加载、PyTorch 自己的线程（在模拟设备上还有前向、反向的计算）也要核。
# 第 5 模块让 Adam 与设备计算重叠时，两边同时要核。下面让一个后台线程不停地做矩阵乘（模拟设备在算），
# 同时跑 C Adam，比较两边各自单独跑时与一起跑时的速度。线程数的组合有的加起来等于核数，有的超过：

# %%
CONTEND_N = 524_288 if SMOKE else 4_000_000
CONTEND_PAIRS = ((1, 1), (2, 1), (2, 2)) if CORES == 2 else ((1, CORES - 1), (CORES, 1), (CORES, CORES))
contend_buffers = [torch.zeros(CONTEND_N), torch.randn(CONTEND_N).half(), torch.zeros(CONTEND_N),
                   torch.zeros(CONTEND_N), torch.empty(CONTEND_N, dtype=torch.float16)]


def adam_ms(threads: int, seconds: float) -> float:
    """Median ms of the C Adam called again and again for `seconds` (at least 5 calls)."""
    w, g, m, v, out = contend_buffers
    times, until = [], time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < until:
        started = time.perf_counter()
        adam_update(w, g, m, v, step=1, lr=1e-3, out=out, threads=threads)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def matmuls(stop: threading.Event, counter: list) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        torch.mm(a, a)
        counter[0] += 1


def run_pair(torch_threads: int, adam_threads: int | None, seconds: float = 0.1 if SMOKE else 0.3):
    """(matmuls/s, Adam ms) with a matmul loop on torch_threads and, unless None, the C Adam at the same time."""
    torch.set_num_threads(torch_threads)
    stop, counter = threading.Event(), [0]
    worker = threading.Thread(target=matmuls, args=(stop, counter))
    worker.start()
    time.sleep(0.05)  # let the loop get going
    count0, started = counter[0], time.perf_counter()
    ms = adam_ms(adam_threads, seconds) if adam_threads else time.sleep(seconds)
    rate = (counter[0] - count0) / (time.perf_counter() - started)
    stop.set()
    worker.join()
    torch.set_num_threads(1)
    return rate, ms


pair_results = {pair: {"mm alone": [], "adam alone": [], "mm busy": [], "adam busy": []} for pair in CONTEND_PAIRS}
for _ in range(2 if SMOKE else 3):
    for torch_threads, adam_threads in CONTEND_PAIRS:
        r = pair_results[torch_threads, adam_threads]
        r["mm alone"].append(run_pair(torch_threads, None)[0])
        r["adam alone"].append(adam_ms(adam_threads, 0.1 if SMOKE else 0.3))
        rate, ms = run_pair(torch_threads, adam_threads)
        r["mm busy"].append(rate)
        r["adam busy"].append(ms)
print(f"C Adam over {CONTEND_N:,} parameters (fp16 in, fp16 out) and torch.mm 256 x 256 in a loop, {CORES} cores\n")
print(f"{'torch threads':>13}{'Adam threads':>13}{'sum':>5}{'Adam ms alone':>15}{'together':>10}"
      f"{'matmuls/s alone':>17}{'together':>10}{'work done together':>20}")
for (torch_threads, adam_threads), r in pair_results.items():
    med = {k: statistics.median(v) for k, v in r.items()}
    # Each side's speed together as a share of its speed alone, added up: 2.0 if they never got in each other's way.
    work = med["adam alone"] / med["adam busy"] + med["mm busy"] / med["mm alone"]
    print(f"{torch_threads:>13}{adam_threads:>13}{torch_threads + adam_threads:>5}{med['adam alone']:>15.2f}"
          f"{med['adam busy']:>10.2f}{med['mm alone']:>17,.0f}{med['mm busy']:>10,.0f}{work:>20.2f}")

# %% [markdown]
# 最后一列把两边一起跑时各自保住的速度（占单独跑时的比例）加起来：两边互不妨碍时是 2.0，越低说明互相挤得越厉害。
# 线程数加起来不超过核数、机器上又没有别的程序时，两边各用各的核，只差共享的内存带宽和缓存；
# 超过核数时，操作系统让线程轮流上核：Adam 的一段工作被挤下核，另一段只能等它；PyTorch 的每个并行区也要等它最慢的那个线程。
# 在一台还跑着别的程序的机器上，核本来就不够分，哪一行都会变慢，而且每次执行的结果都不一样：这本身就是一个教训，
# 共享机器上的计时要交替、要取中位数，结论要看机制，不能看一次的数字。
# 规则：**CPU Adam 的线程数 + PyTorch 的线程数（`torch.set_num_threads`、`OMP_NUM_THREADS`）+ 数据加载进程数 ≤ 核数**。
# 每个 GPU 一个 rank 时，每个 rank 分到 核数 / GPU 数 个核；引擎用 `"zero_offload": {"cpu_adam": {"threads": ...}}`
# 或环境变量 `ZO_CPU_ADAM_THREADS` 设置，不设时用 `torch.get_num_threads()`。

# %% [markdown]
# ## 5. 部分卸载：`offload_optimizer.ratio`
#
# 全部卸载时，主机要做整个 Adam，设备上却可能还空着几十 GB。`"offload_optimizer": {"device": "cpu", "ratio": r}`
# 只把前 r 份（按单元、按模型顺序）的优化器状态放到主机，其余的留在设备上，由设备自己更新。
# 在 `TinyGPT("small")` 上用 r = 0.25、0.5、1.0 各训练几步，再加一个不卸载的 stage 2 作参照，看每一层的字节、
# PCIe 流量和 CPU 上 Adam 的耗时（`engine.history` 的 `adam_seconds`，只计主机那部分）。C Adam 用 1 个线程。

# %%
PARTIAL_MODEL = "nano" if SMOKE else "small"
PARTIAL_STEPS = 3 if SMOKE else 8
RATIOS = (None, 0.25, 0.5, 1.0)  # None: stage 2 without offload


def partial_config(ratio) -> dict:
    zero = {"stage": 2}
    if ratio is not None:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    return {
        "train_batch_size": 4,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1}},
    }


partial = {}
for ratio in RATIOS:
    engine = zo.initialize(TinyGPT(PARTIAL_MODEL), partial_config(ratio), accelerator=EmulatedAccelerator())
    data = ByteBatches(CORPUS, engine.model.cfg.seq_len)
    losses = []
    for step in range(PARTIAL_STEPS):
        x, y = data.global_batch(step, 4)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.memory_report()
    states = engine.states
    transfers = getattr(states, "transfers", None)
    adam = [h["adam_seconds"] for h in engine.history[1:] if not h["overflow"]]  # step 0 touches fresh pages
    partial[ratio] = dict(
        params=engine.num_params, device=report.measured.device, host=report.measured.host,
        staging=report.host_staging, host_fraction=getattr(states, "host_fraction", 0.0),
        host_units=getattr(states, "host_units", 0), units=len(states.units),
        pcie=0 if transfers is None else (transfers.bytes["d2h"] + transfers.bytes["h2d"]) / PARTIAL_STEPS,
        adam_s=statistics.median(adam) if adam else 0.0, losses=losses,
    )

n_partial = partial[1.0]["params"]
print(f"TinyGPT('{PARTIAL_MODEL}'): {n_partial:,} parameters, fp16, stage 2, {PARTIAL_STEPS} steps\n")
print(f"{'offload ratio':<14}{'host units':>11}{'host share':>11}{'device':>11}{'host':>11}{'staging':>11}"
      f"{'PCIe/step':>11}{'CPU Adam ms':>13}")
for ratio, r in partial.items():
    label = "none" if ratio is None else f"{ratio:g}"
    adam_cell = "-" if ratio is None else f"{r['adam_s'] * 1e3:.2f}"  # no offload: no CPU step at all
    print(f"{label:<14}{r['host_units']:>5} of {r['units']:<4}{r['host_fraction']:>10.1%}{format_bytes(r['device']):>11}"
          f"{format_bytes(r['host']):>11}{format_bytes(r['staging']):>11}{format_bytes(r['pcie']):>11}"
          f"{adam_cell:>13}")
print("\nmax |loss difference| from the full offload over the run: " + ", ".join(
    f"{'no offload' if ratio is None else f'ratio {ratio:g}'} {max(abs(a - b) for a, b in zip(r['losses'], partial[1.0]['losses'], strict=True)):.1e}"
    for ratio, r in partial.items() if ratio != 1.0))

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
labels = ["no offload" if r is None else f"ratio {r:g}" for r in partial]
pos = np.arange(len(labels))
for offset, tier, color in ((-0.2, "device", "tab:red"), (0.2, "host", "tab:blue")):
    values = [partial[r][tier] / 2**20 for r in partial]
    ax1.bar(pos + offset, values, 0.4, color=color, label=f"{tier} (model states)")
    for p, v in zip(pos + offset, values, strict=True):
        ax1.text(p, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
ax1.set_xticks(pos, labels)
ax1.set_ylabel("MiB")
ax1.set_title(f"TinyGPT('{PARTIAL_MODEL}'): bytes per tier")
ax1.legend(fontsize=8)
offloaded = [r for r in partial if r is not None]
adam_ms = [partial[r]["adam_s"] * 1e3 for r in offloaded]
ax2.bar(np.arange(len(offloaded)), adam_ms, 0.5, color="tab:green")
for p, v in enumerate(adam_ms):
    ax2.text(p, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
ax2.set_xticks(np.arange(len(offloaded)), [f"ratio {r:g}" for r in offloaded])
ax2.set_ylabel("ms per step (median)")
ax2.set_title("CPU Adam time per step (adam_seconds)")
show(fig, "partial_offload.png")

# %% [markdown]
# - 主机上的字节、PCIe 流量和 CPU Adam 的时间都大致与主机份额成正比；设备上的字节反方向变化。
#   "主机份额"是按单元取整后的实际比例（`engine.states.host_fraction`），与配置的 r 接近而不一定相等：
#   单元不可分割，缓冲才能保持连续，每一部分的更新仍是一遍扫描；
# - 留在设备上的单元不经过 PCIe：梯度在设备上累加、由设备上的 Adam 更新、就地舍入；
# - 训练的数学没有变，loss 只在舍入误差的量级上不同：主机上是 C 内核（FMA，乘加只舍入一次），设备上是 torch 的融合 Adam，
#   两者在最后一位上可以不同；fp16 训练里这点差别经过舍入成 fp16 的权重传到下一步的 loss。（第 3 课用 `"impl": "torch"`
#   时，卸载与不卸载逐位相同，因为两边是同一个 Adam 实现。）
#
# **什么时候用**：设备上还有空余显存（全部卸载后放得下一部分优化器状态），而 CPU 那一步是每步时间里最长的一段
# （CPU 核少、内存带宽低，或者每步 token 少）。这时留一部分在设备上，CPU 少做、PCIe 少搬，而设备上的 Adam 几乎不花时间
# （HBM 比主机内存快一两个数量级）。下一节的性能模型会算出"最小能放下的 r"。

# %% [markdown]
# ## 6. 性能模型与 `zo plan`
#
# 卸载训练的一步占用四种资源，`perfmodel.py` 把每一种都写成一个公式（P 为参数量，N 为 GPU 数，每个 rank 的分片为 P/N）：
#
# | 资源 | 每步的时间 |
# |---|---|
# | GPU 计算 | 6 · P · tokens FLOPs ÷ (峰值 TFLOP/s × MFU)；有激活重计算时是 8 · P · tokens |
# | GPU 上的 Adam | 留在设备上的参数 × 28 字节 ÷ HBM 带宽 |
# | GPU 之间 | reduce-scatter + all-gather ≈ 2 (N−1)/N · P 个 16 位数；stage 3 是 3 (N−1)/N |
# | PCIe | 下行：卸载的参数 × 2 字节的梯度 ÷ 单向带宽；上行：× 2 字节的权重 ÷ 单向带宽（`offload_param` 每次聚合都要上行）。PCIe 是全双工的，两个方向各有一个拷贝引擎 |
# | CPU Adam | 调用次数 × 每次调用的固定开销 + 主机上的参数 ÷ 这个 rank 的吞吐（它只用自己那个插槽的内存带宽，NUMA） |
#
# 串行（serial）时一步是它们的和，这是本引擎到第 4 模块为止的样子：梯度先下行，CPU 做完 Adam，权重才上行，两个方向不会同时忙，
# PCIe 算 (下行 + 上行) ÷ 带宽。完全重叠（overlapped）时一步是最忙的那一个（第 5 模块的目标）：这一步的梯度在反向里下行，
# 同时上一步的权重在上行，两个方向一起走，PCIe 只算 max(下行, 上行) ÷ 带宽。真实的一步在两者之间。
# 先看 13B 模型放进一张 80 GB 的 A100（`a100-80g` 预设，单卡；主机有两个插槽，这个 rank 只用其中一个的内存带宽）：

# %%
zo_cli(["plan", "--params", "13B", "--gpus", "1", "--stage", "2", "--offload", "optimizer"])

# %% [markdown]
# 对照导言。导言按 13 × (2 + 2 + 4 + 4) = 156 GB 算 13B 的模型状态，漏了 fp32 主权重（第 1 章）。把 `zo plan` 的设备、主机两列拆开：

# %%
A100 = perfmodel.PRESETS["a100-80g"]
one_gpu = replace(A100, gpus=1)  # Hardware and Workload are frozen dataclasses: replace() makes a variant
P13 = 13_000_000_000
wl13 = perfmodel.Workload(P13, batch=1, seq_len=1024)
none13 = estimate_model_states(P13, stage=0, world_size=1, precision="fp16")
p13 = perfmodel.plan(one_gpu, wl13, 2, "optimizer")
print(f"the introduction: 13e9 x (2 + 2 + 4 + 4) = {13 * 12} GB; with the fp32 master weights "
      f"13e9 x 16 = {format_gb(none13.device)} of model states\n")
print("stage 2 + offload_optimizer, one A100-80GB, batch 1 x 1024 tokens:")
print(f"  device: fp16 weights {format_gb(p13.states.device)} ({p13.states.device / P13:.0f} B/param) + activations "
      f"{format_gb(p13.activations)} + gradient buckets {format_gb(p13.buffers)} = {format_gb(p13.device_bytes)} "
      f"of {format_gb(p13.device_usable)} usable")
print(f"  host:   fp32 gradients, master, m, v {format_gb(p13.states.host)} ({p13.states.host / P13:.0f} B/param) "
      f"+ fp16 staging {format_gb(p13.staging)} ({p13.staging / P13:.0f} B/param) = {format_gb(p13.host_bytes)}"
      f" ({p13.host_bytes / P13:.0f} B/param)")
t = p13.time
print(f"\npredicted step: compute {t.compute:.2f} s, PCIe down {t.pcie_down:.2f} s + up {t.pcie_up:.2f} s, "
      f"CPU Adam {t.cpu_adam:.2f} s, GPU Adam {t.gpu_adam:.3f} s -> serial {t.serial:.2f} s, overlapped "
      f"{t.overlapped:.2f} s (bottleneck: {t.bottleneck}; PCIe overlapped: max(down, up) = {t.pcie_duplex:.2f} s)")
spread = replace(one_gpu, numa_spread=True, cpu_adam_threads=13)  # the rank's threads and memory on both sockets
ts = perfmodel.plan(spread, wl13, 2, "optimizer").time
print(f"CPU Adam on one socket of two: {one_gpu.cpu_adam_rank_share() / 1e9:.2f} Gparam/s; spread over both: "
      f"{spread.cpu_adam_rank_share() / 1e9:.2f} Gparam/s, CPU Adam {ts.cpu_adam:.2f} s, overlapped {ts.overlapped:.2f} s "
      f"(bottleneck: {ts.bottleneck})")

# %% [markdown]
# 一个微批次只有 1 × 1024 个 token 时，GPU 只算 0.6 秒左右，而 PCIe 每个方向要搬 26 GB、CPU 要更新 130 亿个参数：卸载的固定开销压过了计算。
# 两个方向同时走时 PCIe 只要 1 秒出头，瓶颈是 CPU 上的 Adam：一个 rank 只用一个插槽的内存带宽，是整台主机的一半。
# `zo plan` 因此推荐部分卸载：设备上还放得下 20% 参数的优化器状态，CPU 和 PCIe 都少做 20%。
#
# 计算随每步 token 数增长，PCIe 和 CPU Adam 不随它变；链路越快，PCIe 那一段越短。批大了，激活值在 80 GB 里放不下，
# 所以下面打开激活重计算（`--recompute`：每个块只留输入，反向时重算一遍前向，计算量变成 8·P·tokens）。
# `zo plan --recompute --plot DIR` 画出这两条曲线（放不下的配置不画）：

# %%
wl13_recompute = replace(wl13, recompute=True)
for path in advisor.save_plots(one_gpu, wl13_recompute, OUT):
    display(Image(filename=str(path)))
print("13B, one A100-80GB, stage 2 + offload_optimizer, activation checkpointing, 1024 tokens a sequence:")
print(f"{'batch':>5}{'fits':>6}{'compute s':>11}{'PCIe down s':>13}{'PCIe up s':>11}{'CPU Adam s':>12}{'serial s':>10}"
      f"{'overlapped s':>14}{'bottleneck':>12}{'offload share of serial':>25}{'spread: bottleneck':>20}")
for batch in (1, 2, 4, 8, 16, 32, 64):
    pb = perfmodel.plan(one_gpu, replace(wl13_recompute, batch=batch), 2, "optimizer")
    tb = pb.time
    on_both = perfmodel.plan(spread, replace(wl13_recompute, batch=batch), 2, "optimizer").time.bottleneck
    print(f"{batch:>5}{'yes' if pb.fits else 'no':>6}{tb.compute:>11.2f}{tb.pcie_down:>13.2f}{tb.pcie_up:>11.2f}"
          f"{tb.cpu_adam:>12.2f}{tb.serial:>10.2f}{tb.overlapped:>14.2f}{tb.bottleneck:>12}"
          f"{(tb.pcie + tb.cpu_adam) / tb.serial:>25.0%}{on_both:>20}")

# %%
batches = [1, 2, 4, 8, 16, 32, 64]
times = [perfmodel.plan(one_gpu, replace(wl13_recompute, batch=b), 2, "optimizer").time for b in batches]
tokens = np.array(batches) * wl13.seq_len
fig, ax = plt.subplots(figsize=(7.5, 4))
pos = np.arange(len(batches))
bottom = np.zeros(len(batches))
for part, color in (("compute", "tab:green"), ("pcie", "tab:orange"), ("cpu_adam", "tab:blue")):
    share = np.array([getattr(t, part) for t in times]) * 1e3 / tokens  # ms per 1,000 tokens
    ax.bar(pos, share * 1e3, 0.6, bottom=bottom, color=color, label={"pcie": "PCIe, down then up (2 + 2 bytes/param)",
           "cpu_adam": "CPU Adam", "compute": "GPU compute (8 P tokens)"}[part])
    bottom += share * 1e3
ax.plot(pos, [t.overlapped * 1e6 / k for t, k in zip(times, tokens, strict=True)], "k_", markersize=22,
        markeredgewidth=2, label="overlapped: the busiest resource")
ax.set_xticks(pos, [str(b) for b in batches])
ax.set_xlabel("micro-batch (sequences of 1024 tokens)")
ax.set_ylabel("ms per 1,000 tokens")
ax.set_title("13B, one A100-80GB, stage 2 + offload: serial step split per token")
ax.legend(fontsize=8)
show(fig, "step_parts_vs_batch.png")

# %% [markdown]
# 计算随批大小线性增长，PCIe 和 CPU Adam 是每步固定的一笔。批大到计算压过它们之后，完全重叠时卸载的代价是零（瓶颈是 GPU），
# 串行时它在每步里所占的份额越来越小（倒数第二列）。最后一列是同一个 rank 把线程和内存铺到两个插槽上时的瓶颈：CPU 那一步短一半，
# GPU 更早成为瓶颈。批太小时，要么加大批（或梯度累积），要么让 CPU Adam 用上更多内存带宽，要么用部分卸载让 CPU 和 PCIe 少做一点；
# 链路再快也没用，完全重叠时 PCIe 不是瓶颈。
#
# ### 在这台机器上校准，与引擎实测对照
#
# 预设里的 CPU Adam 吞吐是按内存带宽估的。`perfmodel.calibrate()`（`zo plan --preset this-cpu --calibrate`）
# 用第 4 节的探针在本机实测：引擎卸载时那种形式（fp32 梯度分片进、fp16 权重出）的 C Adam，冷缓存，1 个线程（与第 5 节的训练一样）。
# 然后用模型预测第 5 节每个 ratio 的 CPU 步，与 `adam_seconds` 的中位数比较：

# %%
hw_here = perfmodel.calibrate(threads=1, precision="fp16", numel=1_000_000 if SMOKE else 4_000_000,
                              repeats=3 if SMOKE else 5)
torch.set_num_threads(1)
print(hw_here.notes)
print(f"CPU Adam: {hw_here.cpu_adam_params_per_s / 1e6:.0f} M params/s, {hw_here.cpu_adam_call_seconds * 1e6:.0f} us "
      f"a call; memory traffic {hw_here.host_memory_gb_per_s:.1f} GB/s; matmul {hw_here.gpu_tflops * 1e3:.0f} GFLOP/s\n")
print(f"{'offload ratio':<14}{'host params':>12}{'calls':>7}{'predicted ms':>14}{'measured ms':>13}{'measured/predicted':>20}")
for ratio, r in partial.items():
    if ratio is None:
        continue
    host_params = r["host_fraction"] * r["params"]
    predicted = perfmodel.cpu_adam_seconds(hw_here, host_params, r["host_units"])
    print(f"{ratio:<14g}{host_params:>12,.0f}{r['host_units']:>7}{predicted * 1e3:>14.2f}{r['adam_s'] * 1e3:>13.2f}"
          f"{r['adam_s'] / predicted:>20.2f}")

# %% [markdown]
# 模型只用两个数（每次调用的开销、每秒更新的参数）就把各个 ratio 的 CPU 步都预测了出来。实测与预测之比偏离 1 的部分来自：
# 校准用的是一样大的张量，训练里的单元却大小不一（层归一化只有几百个参数）；反向刚结束时，有的单元的状态还在缓存里，有的早已不在；
# 还有同一台机器上其他程序在两个时刻的干扰不同。对"谁是瓶颈"这种判断，这个量级的误差足够了。
# 在你的机器上运行 `zo plan --preset this-cpu --calibrate --params ...` 得到同样的校准；有 CUDA 时它还会测 PCIe（锁页与可分页）和矩阵乘。

# %% [markdown]
# ### 卸载在 DP × TP × PP 里的位置（粗略）
#
# `zo plan` 最后还打印一张并行布局表（`parallel.py`）：张量并行（TP，在一台主机之内）和流水线并行（PP）先把模型分成 tp × pp 份，
# ZeRO 再在 dp 个 rank 之间分片；TP 每层要对激活值做 all-reduce，PP 有气泡 (pp−1)/(m+pp−1)，DP 的集合通信跨主机时走主机之间的网络。
# 每种布局训练同一个全局批次，表里是放得下的配置里串行最快的那个（只考虑全部卸载）。70B、激活重计算，一台 DGX A100（8 卡）和两台（16 卡）：

# %%
wl70 = perfmodel.Workload(70_000_000_000, batch=1, seq_len=1024, recompute=True)
print(plan_report.format_layouts(parallel.plan_layouts(A100, wl70)))

# %% [markdown]
# ## 7. 导言的"常见误区"，逐条变成规则
#
# `advisor.advise()` 把导言那张表的每一行写成一条带数字的规则，`zo plan --stage S --offload O` 对你选的配置逐条检查。
# 下面每条误区配一个会触发它的场景：

# %%
def show_advice(title: str, hw, wl, stage: int, offload: str, rules=None) -> None:
    chosen = perfmodel.plan(hw, wl, stage, offload)
    print(f"{title}\n  {wl.params / 1e9:g}B params, batch {wl.batch}, {hw.gpus} x {format_gb(hw.gpu_memory)}, "
          f"host {format_gb(hw.host_memory)}: {chosen.label}, predicted {chosen.time.serial:.3g} s a step")
    for advice in advisor.advise(hw, wl, chosen, perfmodel.plan_all(hw, wl)):
        if rules is None or advice.rule in rules:
            print(textwrap.fill(f"{advice.level}: [{advice.rule}] {advice.message}", 118,
                                initial_indent="  ", subsequent_indent="      "))
    print()


show_advice("1. 'Offload is always faster' -- a 1.3B model that fits on the GPU anyway",
            one_gpu, perfmodel.Workload(1_300_000_000, batch=8), 2, "optimizer", {"offload-not-needed"})
show_advice("   ... and a 13B model with too few tokens a step for the CPU step",
            one_gpu, wl13, 2, "optimizer", {"cpu-step-dominates"})
show_advice("2. 'Forgetting pin_memory'", one_gpu, wl13, 2, "optimizer", {"pin-memory", "pin-memory-limit"})
show_advice("3. 'Stacking stage 3 and every offload' -- 13B on 8 GPUs",
            A100, replace(wl13, batch=8), 3, "optimizer+param", {"offload-param-not-needed", "stage3-traffic"})
show_advice("4. 'Not reserving host memory' -- 13B offloaded to a host with 256 GB",
            replace(one_gpu, host_memory=256 * 10**9), wl13, 2, "optimizer", {"host-memory", "pin-memory-limit"})

# %% [markdown]
# - **卸载不一定更快**：模型本来放得下时，卸载只多出 PCIe 和 CPU 那两段；放不下时，CPU 那一步是否压过计算取决于每步 token 数；
# - **`pin_memory`**：锁页内存才能让拷贝走 DMA、与计算重叠；这条规则要的实测数字（锁页与可分页的带宽）只能在有 CUDA 的机器上测，
#   `make gpu-check` 或 `zo plan --calibrate` 会测；锁得太多（超过主机内存的 80%）反而危险；
# - **stage 3 + `offload_param`**：参数也要每步经 PCIe 上行，流量从 2 + 2 变成 2 + 4 字节/参数；stage 2 + `offload_optimizer` 放得下时就不该用它；
# - **主机内存**：每参数 16 字节的模型状态 + 4 字节的 fp16 中转缓冲 = 20 字节，正是导言"16～20 字节/参数"的上限。
#   13B 需要 260 GB 主机内存，256 GB 的机器放不下。
#
# ## 小结
#
# - Adam 每个参数搬 28 字节、做十几次运算，算术强度约 0.5 FLOP/字节，远低于 CPU 的平衡点：任何一遍扫描的实现都以内存带宽为上限；
#   `zo_memory_floor` 量出这个上限，AVX2 内核在 DRAM 大小的数组上贴着它走，标量循环则受算术限制。
# - 内核：8 路 AVX2 + FMA、不要求对齐的读写、标量尾巴；F16C 与整数通道里的 bf16 就近舍入，与 PyTorch 逐位相同；
#   运行时分派（不用 `-march=native`），ARM 上只有标量变体；线程按 64 个元素的整数倍切分；构建缓存按源码哈希；ASan/UBSan 一个环境变量打开。
# - 卸载后的更新一遍扫描 28 字节，PyTorch 分四遍要 48 字节并且每步新分配一块 fp32 梯度。
# - 线程数加到内存饱和为止；CPU Adam、PyTorch、数据加载的线程加起来不要超过核数。
# - 部分卸载按比例把主机的字节、PCIe 流量和 CPU 时间挪回设备，训练结果不变。
# - 性能模型：计算 6·P·tokens / (TFLOP/s·MFU)，PCIe 下行、上行各 2 字节/参数（全双工：串行相加，重叠取较长的一个方向），
#   CPU Adam = 主机上的参数 / 这个 rank 的吞吐（只用自己插槽的内存带宽），串行求和、重叠取最大；
#   13B 单卡：设备 26 GB 的 fp16 权重加激活，主机 16 + 4 字节/参数 = 260 GB。
#
# ## 接下来：实验 4
#
# 在仓库根目录运行 `make lab4` 为实验 4 评分（`make lab4 LAB_DIR=solutions` 看参考答案）。三个任务都在
# `labs/lab4/tuning/csrc/cpu_adam.c` 里，评分时你的 C 文件被现场编译：
#
# | 任务 | 内容 | 位置 |
# |---|---|---|
# | Lab 4.1 | AVX2 + FMA 的 fp32 向量循环 | `adam_avx2` |
# | Lab 4.2 | 用 F16C 把 8 个新权重舍入成 fp16 写出 | `store8_out` |
# | Lab 4.3 | 标量尾巴：不足 8 个的元素 | `adam_avx2` 末尾 |
#
# 4.1、4.2 需要支持 AVX2/FMA/F16C 的 x86-64 CPU，在 ARM（包括 Apple silicon）上会被跳过并说明原因；4.3 在 ARM 上用一个可移植的小程序评分。
#
# ## 练习
#
# 1. 把第 1 节的尺寸扫描改成 2 个线程。缓存里的 GB/s 和 DRAM 里的 GB/s 各变了多少？为什么一个变得多、一个变得少？
# 2. bf16 梯度进、bf16 权重出的一遍扫描是多少字节/参数？用 `adam_update(..., grad=bf16, out=bf16)` 测一下，和 fp16 的比。
# 3. 在第 6 节的 13B 单卡场景里，链路带宽降到多少 GB/s 时，批 1 完全重叠的一步里 PCIe 才成为瓶颈？先用公式算，再用 `zo plan --link` 验证。
# 4. 你的机器有多少核、多少内存通道？运行 `zo plan --preset this-cpu --calibrate --params 1B`，再把 `--threads` 从 1 加到核数，
#    CPU Adam 的吞吐在第几个线程饱和？
