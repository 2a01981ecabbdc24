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
# 7. 导言的"常见误区"表，逐条变成带数字的规则；
# 8. 优化器状态的精度：m、v 存成 bf16 或 8 位，省下的字节、降不下来的 v、速度和训练损失。
#
# 所有数字都在这台机器上现场测出；同一台机器上别的程序也在跑时计时会抖，所以每个比较都交替测量、取中位数。
# 图保存在仓库根目录的 `out/lessons/04/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会缩小问题规模，只用于快速检查笔记本能否跑通（`python tools/run_lessons.py --smoke 04`）。

# %%
import os
import platform
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the bench's progress bars are for the terminal, not the notebook

import torch
from IPython.display import Image, display

from zero_offload import plots
from zero_offload.basics import estimate_model_states
from zero_offload.cli import main as zo_cli
from zero_offload.cli.bench import adam as bench
from zero_offload.lessons import tuning_kernel, tuning_partial, tuning_plots, tuning_threads
from zero_offload.tuning import advisor, bandwidth, build, cpu_adam_update, perfmodel, plan_report
from zero_offload.tuning.cpu_adam import memory_floor, supported_variants
from zero_offload.tuning.cpuinfo import cpu_model
from zero_offload.units import format_gb
from zero_offload.workloads import load_corpus

# %%
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


flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()  # no /proc: macOS
print(f"{cpu_model()}, {platform.machine()}, {CORES} cores; torch {torch.__version__}; smoke mode: {SMOKE}")
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
# `zero_offload/lessons/tuning_kernel.py` 的 `raw_kernel` 先按 `cpu_adam.h` 里的结构体 `zo_adam_args` 填好指针和超参数，计时只包含 C 调用；
# 每一轮把每种内核、每个尺寸各测一次，取各轮的中位数。

# %%
SWEEP_SIZES = [2**k for k in (range(12, 19, 2) if SMOKE else range(12, 24))]  # 4K .. 8M parameters
SWEEP_ELEMENTS = 2**20 if SMOKE else 4 * 2**20  # elements per timing: small arrays are called many times
sweep_gbs = tuning_kernel.roofline_sweep(KERNEL, SWEEP_SIZES, elements=SWEEP_ELEMENTS, rounds=3 if SMOKE else 7)
print(tuning_kernel.format_sweep(sweep_gbs, SWEEP_SIZES))

# %%
show(tuning_plots.roofline_sweep(sweep_gbs, SWEEP_SIZES, tuning_kernel.SWEEP_KINDS), "adam_roofline_sweep.png")

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
show(tuning_plots.implementations(impl_ms, impl_floor, IMPL_N), "adam_implementations.png")

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
print("\n".join(tuning_kernel.source_excerpt("for (; i + 8 <= end; i += 8)", "END LAB 4.1")))
print("    ...")
print("\n".join(tuning_kernel.source_excerpt("BEGIN LAB 4.3", "END LAB 4.3")))

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
N_CHECK, STEPS_CHECK = 100_003, 10  # an odd length: the tail runs too
print(f"{N_CHECK:,} parameters, {STEPS_CHECK} steps, lr 1e-3, weight decay 0.01, gradient x 8 then grad_scale 1/8\n")
print(tuning_kernel.parity_report(N_CHECK, STEPS_CHECK))  # run_ours / run_torch: the same seeded gradients

# %% [markdown]
# 尾巴：长度 n = 8k + r 时，向量循环做前 8k 个，标量循环做最后 r 个。把长度为 n 的视图放在一块更长的缓冲里，
# 后面留几个"哨兵"值，检查每个元素都更新了、哨兵一个没动：

# %%
print(f"{'n':>5}{'vector loop':>13}{'scalar tail':>13}{'all updated':>13}{'guard intact':>14}")
for n, vector, tail, updated, intact in tuning_kernel.tail_rows((1, 7, 8, 9, 15, 16, 17, 1003)):
    print(f"{n:>5}{vector:>13}{tail:>13}{updated!s:>13}{intact!s:>14}")

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
EDGES = tuning_kernel.EDGES  # ties, subnormals, overflow, inf, -0.0, nan
values = torch.cat([torch.tensor(EDGES), torch.randn(100_000) * torch.logspace(-8, 6, 100_000)])
print(f"{values.numel():,} values: {len(EDGES)} edge cases (ties, subnormals, overflow, inf, nan) + random ones\n")
for dtype, variant, same, n in tuning_kernel.rounding_rows(values):
    print(f"{dtype:<9} {variant:<7} bit-identical to torch: {same:,} of {n:,}")
ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11])
print(f"\nties: fp16 {ties.tolist()} -> {ties.half().tolist()}; "
      f"bf16 {[1 + 2**-8, 1 + 3 * 2**-8]} -> {torch.tensor([1 + 2**-8, 1 + 3 * 2**-8]).bfloat16().tolist()}")

# %% [markdown]
# ### 运行时分派、线程与分块
#
# 内核**不用** `-march=native` 编译。x86 的向量函数各自带 `__attribute__((target("avx2,fma,f16c")))`，
# 文件的其余部分是可移植的 C；`zo_adam_update` 在运行时用 `__builtin_cpu_supports` 问 CPU 支持什么，
# 默认（`variant="auto"`）选最快的那个。于是同一个编译产物能在任何 x86-64 上运行，在 ARM（Apple silicon）上只编译出标量循环。
# 要一个这台 CPU 没有的变体，得到的是一条说清楚的错误，而不是非法指令崩溃。下面依次要 avx512 和 avx2：有 AVX-512 的 CPU 上两个都能跑；
# 没有 AVX-512 时，第一行是 `ValueError: this CPU cannot run the 'avx512' variant; use 'auto' or 'scalar'`。

# %%
n = 1024
for variant in ("avx512", "avx2"):
    try:
        cpu_adam_update(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, variant=variant)
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
    compile_s, again_s = tuning_kernel.compile_and_reload_seconds()  # in a temporary ZO_CACHE_DIR
    print(f"compile into an empty cache: {compile_s:.1f} s; the same build() again: {again_s * 1e6:.0f} us")

# %% [markdown]
# ### 用 sanitizer 检查越界
#
# C 代码里的越界读写不会抛异常，它悄悄地读到别人的数据、写坏别人的内存。Python 这一层在调用前检查每个张量的 dtype、
# 设备、长度和连续性，但内核本身也要经得起检查：`ZO_CPU_ADAM_SANITIZE=1` 用 AddressSanitizer 和 UBSan 编译它
# （另一个缓存键），越界访问或未定义行为会立即停下并报告位置。Python 不是用 ASan 编译的，所以要预先加载 `libasan`。
# 下面在子进程里故意绕过 Python 的检查，让内核在 1000 个元素的缓冲上更新 1003 个：

# %%
print(tuning_kernel.ASAN_SCRIPT.strip())  # run in a child process with n = 1000, then 1003
if SMOKE:
    print("smoke mode: skipped (it compiles the kernel with sanitizers)")
else:
    for count in (1000, 1003):
        print(tuning_kernel.sanitizer_report(count, ROOT))

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
# 字节数是差距的下限：torch 的流水线每个参数搬 48 字节，一遍扫描 28 字节。实测倍数比 48/28 更大时（一台忙的机器上可以大得多），多出的部分来自
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
THREAD_KINDS = tuning_threads.thread_kinds(THREAD_N)  # C fp32, C fp32 -> fp16, torch fused, memory floor
rates = tuning_threads.thread_sweep(THREAD_KINDS, THREAD_N, MAX_THREADS, THREAD_ROUNDS)
print(tuning_threads.format_threads(rates, THREAD_KINDS, THREAD_N, MAX_THREADS, THREAD_ROUNDS, CORES))

# %%
show(tuning_plots.threads(rates, THREAD_KINDS, MAX_THREADS, CORES, THREAD_N), "adam_threads.png")

# %% [markdown]
# 在一台空闲的机器上：一个核能同时等待的缓存行数有限，所以一个线程常常跑不满内存带宽，第二个线程还有用；
# 几个线程一起把内存通道占满之后，曲线就平了，再加线程只是让更多的核一起排队等内存。超过核数之后，线程还要轮流占用核：
# 内核按线程**静态**切分工作，被挤下核的那一段决定整步的时间，吞吐只会持平或下降。大服务器上同理，只是饱和点在几十个线程。
#
# 如果上表里 1 个线程最快，连不做运算的内存下限在 2 个线程时也更慢，先别急着下结论：可能是别的程序占着一个核
# （第二个线程排不上核，整步就要等它），也可能是这台机器本身的特点（第 4 章附录 4.A.2 记下了一台空闲的虚拟机上正是这样）。
# 用 `uptime` 看负载、用 `taskset` 换核、换 `ZO_CPU_ADAM_THREADS` 各量几次，再看是哪一种。
#
# 线程还有固定成本。每次调用要做 Python 这一层的检查、经过 cffi，多线程时还要创建、回收线程。用小张量量一下每次调用的开销：

# %%
for t in (1, 2):
    per_call = tuning_threads.call_overhead_us(t, n=1024)  # fp32 in, fp16 out, 200 calls a timing
    print(f"cpu_adam_update on 1,024 parameters, {t} thread(s): {per_call:.0f} us a call")

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
contention = tuning_threads.Contention(CONTEND_N, seconds=0.1 if SMOKE else 0.3)
pair_medians = contention.measure(CONTEND_PAIRS, rounds=2 if SMOKE else 3)  # alone, then together, each round
print(tuning_threads.format_contention(pair_medians, CONTEND_N, CORES))

# %% [markdown]
# 最后一列把两边一起跑时各自保住的速度（占单独跑时的比例）加起来：两边互不妨碍时是 2.0，越低说明互相挤得越厉害。
# 线程数加起来不超过核数、机器上又没有别的程序时，两边各用各的核，只差共享的内存带宽和缓存；
# 超过核数时，操作系统让线程轮流上核：Adam 的一段工作被挤下核，另一段只能等它；PyTorch 的每个并行区也要等它最慢的那个线程。
# 在一台还跑着别的程序的机器上，核本来就不够分，哪一行都会变慢，而且每次执行的结果都不一样；即使机器空闲，
# 虚拟机的核也未必像裸机那样互不相干。所以计时要交替、要取中位数，结论要看机制，不能看一次的数字。
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
print(tuning_partial.partial_config(0.25))  # the configuration of one run
partial = {ratio: tuning_partial.partial_run(PARTIAL_MODEL, ratio, PARTIAL_STEPS, CORPUS) for ratio in RATIOS}
print(tuning_partial.format_partial(partial, PARTIAL_MODEL, PARTIAL_STEPS))

# %%
show(tuning_plots.partial_offload(partial, PARTIAL_MODEL), "partial_offload.png")

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
for path in plan_report.save_plots(one_gpu, wl13_recompute, OUT):
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
show(tuning_plots.step_parts(batches, times, wl13.seq_len), "step_parts_vs_batch.png")

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
print(tuning_partial.format_calibration(hw_here, partial))  # predicted with hw_here against section 5's runs

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
print(plan_report.format_layouts(advisor.plan_layouts(A100, wl70)))

# %% [markdown]
# ## 7. 导言的"常见误区"，逐条变成规则
#
# `advisor.advise()` 把导言那张表的每一行写成一条带数字的规则，`zo plan --stage S --offload O` 对你选的配置逐条检查。
# 下面每条误区配一个会触发它的场景：

# %%
def show_advice(title: str, hw, wl, stage: int, offload: str, rules=None) -> None:
    print(tuning_partial.format_advice(title, hw, wl, stage, offload, rules))


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

# %% [markdown]
# ## 8. 优化器状态的精度：bf16 与 8 位的 m、v
#
# **要点**：主权重留在 fp32，只把 m、v 压窄，主机上的优化器状态从 12 字节/参数降到 8（bf16）或约 6（8 位，每 2048 个一块、每块一个尺度）；
# 一遍扫描要搬的字节从 28 降到 20 或约 16。本节依次看：编码与按块的尺度、窄格式的 v 为什么降不下来、这台机器上的速度、训练出来的损失。
# 对应第 4 章 4.6、4.7 节和实验 4.4。
#
# 先看按块量化买到了什么：一个张量里第一块的数比其余的大一千倍。每块一个尺度时，小数那几块的误差在它们自己的码间隔以内；
# 整个张量一个尺度时，小数全被舍入成 0，误差和它们自己一样大（`tuning_moments.round_trip_errors`，编码用的是实验 4.4 要写的 `quantize_blocks`）：

# %%
from zero_offload.cli.bench.adam import STATE_BYTES as MOMENT_BYTES, pass_bytes
from zero_offload.lessons import tuning_moments
from zero_offload.tuning.state_precision import BLOCK, PRECISIONS

print(f"{'m, v stored as':<16}{'host B/param (master + m + v)':>32}{'one pass B/param':>18}")
for precision in PRECISIONS:
    print(f"{precision:<16}{4 + MOMENT_BYTES[precision]:>32.3f}{pass_bytes(precision):>18.3f}")

x = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(0)) * 1e-3
x[:BLOCK] *= 1000  # the first block's values are a thousand times the others'
print()
for name, value in tuning_moments.round_trip_errors(x).items():
    print(f"{name:<28}{value:.3g}")

# %% [markdown]
# 再看 v。Adam 的 v ← β₂v + (1−β₂)g² 每步只挪 0.1%，小于 bf16 的半个间距（相对于数本身约 0.2%～0.4%），也小于 8 位码的半个间隔，
# 就近舍入之后又回到原处。下面一块 v 的第 0 个元素每步都有梯度（它是块内最大值，决定 8 位的尺度），第 1 个元素从 v₀/4 起没有梯度，本该按 0.999ᵗ 衰减：

# %%
DECAY_STEPS = 200 if SMOKE else 2000
decay = tuning_moments.decay_without_gradients(1e-4, DECAY_STEPS)
for precision, history in decay.items():
    print(f"{precision}: v[1] after 1 step {history[0]:.4g}, after {DECAY_STEPS} steps {history[-1]:.4g}")
show(tuning_plots.moment_decay(decay), "moment_decay.png")

# %% [markdown]
# fp32 的 v 一路下降；bf16 与 8 位的 v 第一步之后就停在原处。梯度变小之后分母仍然偏大、更新偏小。随机舍入可以修正这一点，本引擎没有实现，
# 所以默认仍是 fp32，窄格式要在收敛曲线上与 fp32 对照（本节最后一格）。
#
# ### 速度：字节少了，这台机器上快了多少
#
# `make bench` 的 "states" 一节（`bench.moment_precisions`）在同一轮里交替测三种存法的卸载更新，每种旁边是它自己的内存下限
# （同样的字节，不做运算）。"vs fp32" 是 fp32 那一行的毫秒数除以这一行的：

# %%
MOMENTS_N = 262_144 if SMOKE else 8_000_000
moments_speed = bench.moment_precisions(MOMENTS_N, rounds=3 if SMOKE else 7, threads=2)
torch.set_num_threads(1)
bench.print_moment_precisions(moments_speed)

# %% [markdown]
# 读这张表看两列。"of floor" 是这一行离它自己的下限多远：fp32 那一行在内存带宽上，贴近 100%；如果窄格式的行明显低于 100%，
# 它们就不再受内存限制，而是受运算限制（解码、开方、除法、重新编码），省下的字节没有变成省下的时间。"vs fp32" 就是这件事的结果：
# 字节之比（28/20 = 1.4，28/16 = 1.75）是它的上限，运算够快时才能接近。在忙碌的双核虚拟机上，这两列会随负载变化。
#
# ### 训练：损失差多少
#
# 先在这里跑一个短的：TinyGPT "tiny"，阶段 2 + 卸载，C Adam，三种存法，同一个种子：

# %%
LIVE_STEPS = 20 if SMOKE else 150
live = {p: tuning_moments.train_tinygpt(p, seed=0, steps=LIVE_STEPS, corpus=CORPUS) for p in PRECISIONS}
torch.set_num_threads(1)
for precision, run in live.items():
    gap = run["val_loss"] / live["fp32"]["val_loss"] - 1
    print(f"{precision}: host optimizer states {run['host_optimizer_bytes_per_param']:.3f} B/param, "
          f"held-out loss after {LIVE_STEPS} steps {run['val_loss']:.4f} ({gap:+.2%} vs fp32)")

# %% [markdown]
# 一个种子、一百多步说明不了多少。`tools/measure_moment_convergence.py` 做了完整的比较：TinyGPT 500 步（fp32 计算与 fp16 加损失缩放各一组）、
# `examples/finetune_llama` 的 Llama 200 步，每种存法 3 个种子。它的输出提交在 `course/measured/moment-convergence.txt`（每一步的损失在同名 .json 里），
# 图由同一个脚本画出：

# %%
MEASURED = ROOT / "course" / "measured" / "moment-convergence.txt"
print(MEASURED.read_text())
display(Image(filename=str(ROOT / "course" / "figures" / "moment-convergence.png")))

# %% [markdown]
# 表里 "vs fp32" 是三个种子的平均验证损失相对 fp32 的差，"per seed" 是每个种子与同种子 fp32 的差，"spread" 是三个种子之间的极差。
# 种子之间的差和存法之间的差放在一起看：存法的差比种子的差小，就说不出谁更好。第 4 章 4.6 节引用的就是这个文件。

# %% [markdown]
# ## 小结
#
# - Adam 每个参数搬 28 字节、做十几次运算，算术强度约 0.5 FLOP/字节，远低于 CPU 的平衡点：任何一遍扫描的实现都以内存带宽为上限；
#   `zo_memory_floor` 量出这个上限，AVX2 内核在 DRAM 大小的数组上贴着它走，标量循环则受算术限制。
# - 内核：8 路 AVX2 + FMA、不要求对齐的读写、标量尾巴；F16C 与整数通道里的 bf16 就近舍入，与 PyTorch 逐位相同；
#   运行时分派（不用 `-march=native`），ARM 上只有标量变体；线程按 64 个元素的整数倍切分；构建缓存按源码哈希；ASan/UBSan 一个环境变量打开。
# - 卸载后的更新一遍扫描 28 字节，PyTorch 分四遍要 48 字节并且每步新分配一块 fp32 梯度。
# - 线程数加到内存饱和为止；CPU Adam、PyTorch、数据加载的线程加起来不要超过核数。
# - 部分卸载按比例把主机的字节、PCIe 流量和 CPU 时间挪回设备，训练结果不变。
# - m、v 存成 bf16 或按块的 8 位，主机上的优化器状态从 12 降到 8 或约 6 字节/参数；就近舍入吞掉 v 每步 0.1% 的衰减，默认仍是 fp32。
# - 性能模型：计算 6·P·tokens / (TFLOP/s·MFU)，PCIe 下行、上行各 2 字节/参数（全双工：串行相加，重叠取较长的一个方向），
#   CPU Adam = 主机上的参数 / 这个 rank 的吞吐（只用自己插槽的内存带宽），串行求和、重叠取最大；
#   13B 单卡：设备 26 GB 的 fp16 权重加激活，主机 16 + 4 字节/参数 = 260 GB。
#
# ## 接下来：实验 4
#
# 在仓库根目录运行 `make lab4` 为实验 4 评分（`make lab4 LAB_DIR=solutions` 看参考答案）。前三个任务在
# `labs/lab4/tuning/csrc/cpu_adam.c` 里，评分时你的 C 文件被现场编译；第四个在 `labs/lab4/tuning/state_precision.py` 里，是纯 Python：
#
# | 任务 | 内容 | 位置 |
# |---|---|---|
# | Lab 4.1 | AVX2 + FMA 的 fp32 向量循环 | `adam_avx2` |
# | Lab 4.2 | 用 F16C 把 8 个新权重舍入成 fp16 写出 | `store8_out` |
# | Lab 4.3 | 标量尾巴：不足 8 个的元素 | `adam_avx2` 末尾 |
# | Lab 4.4 | 按 2048 个一块量化一个矩：每块的尺度、就近舍入的码、m 有符号、√v 无符号 | `quantize_blocks` |
#
# 4.1、4.2 需要支持 AVX2/FMA/F16C 的 x86-64 CPU，在 ARM（包括 Apple silicon）上会被跳过并说明原因；4.3 在 ARM 上用一个可移植的小程序评分；4.4 是纯 Python，在任何机器上评分。
#
# ## 练习
#
# 1. 把第 1 节的尺寸扫描改成 2 个线程。缓存里的 GB/s 和 DRAM 里的 GB/s 各变了多少？为什么一个变得多、一个变得少？
# 2. bf16 梯度进、bf16 权重出的一遍扫描是多少字节/参数？用 `cpu_adam_update(..., grad=bf16, out=bf16)` 测一下，和 fp16 的比。
# 3. 在第 6 节的 13B 单卡场景里，链路带宽降到多少 GB/s 时，批 1 完全重叠的一步里 PCIe 才成为瓶颈？先用公式算，再用 `zo plan --link` 验证。
# 4. 你的机器有多少核、多少内存通道？运行 `zo plan --preset this-cpu --calibrate --params 1B`，再把 `--threads` 从 1 加到核数，
#    CPU Adam 的吞吐在第几个线程饱和？
# 5. 第 8 节的衰减实验里，把 β₂ 改成 0.99、0.9。bf16 的 v 从哪个 β₂ 起开始跟着衰减？用半个间距（相对约 2⁻⁹～2⁻⁸）先算，再运行验证。
