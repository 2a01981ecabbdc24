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
# # 第 2 课 原理篇：把模型状态切开，结果却一点不变
#
# 本笔记本配合 `course/02-principles.md` 使用。第 1 课数清了每个参数的 16 字节；本课把这些字节**切分**到多个进程上，
# 并用测量回答三个问题：每张卡省了多少、通信多了多少、结果是否与不分片完全一样。
#
# 1. 用估算器复现 ZeRO 论文的例子（7.5B 参数、64 张卡），画出每卡显存随卡数的变化；
# 2. 看分片到底长什么样：分片边界会切穿一个参数，末尾有填充，共享的词嵌入只算一次；
# 3. 用 `torchrun` 起两个进程（gloo 后端，本机回环），分别以 stage 0、1、2、3 训练同一个小 GPT，
#    比较 loss 曲线、每个进程的模型状态字节数和每步的通信量；
# 4. 激活重计算：用多大约三分之一的计算，换掉绝大部分激活值；
# 5. 亲眼看 stage 3 的"用前聚合、用后释放"，以及预取（prefetch）改变了什么、没改变什么。
#
# 所有图都保存在仓库根目录的 `out/lessons/02/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会减少训练步数、缩小模型、多进程训练只跑 stage 2，只用于快速检查笔记本能否跑通。

# %%
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch

import zero_offload as zo
from zero_offload import plots
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.basics import estimate_model_states
from zero_offload.principles.partition import ALIGN, build_units, shard_layout
from zero_offload.units import format_bytes
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

SMOKE = os.environ.get("ZO_SMOKE") == "1"
ROOT = Path.cwd().parent if Path.cwd().name == "lessons" else Path.cwd()
OUT = ROOT / "out" / "lessons" / "02"
OUT.mkdir(parents=True, exist_ok=True)


def show(fig, name: str) -> None:
    plots.show(fig, OUT / name)  # saved under out/lessons/02/ and displayed


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, smoke mode: {SMOKE}")
print(f"figures go to {OUT.relative_to(ROOT)}/")

# %% [markdown]
# ## 1. 每张卡要存多少：ZeRO 论文的例子
#
# 设参数量为 Ψ，优化器状态每参数 K 字节（混合精度 Adam：fp32 主权重、m、v，K = 12），N 张卡做数据并行。
# 每张卡的模型状态字节数为：
#
# | 阶段 | 切分了什么 | 每卡字节 |
# |---|---|---|
# | 0（普通数据并行） | 什么都不切 | (2 + 2 + K)Ψ |
# | 1 | 优化器状态 | (2 + 2)Ψ + KΨ/N |
# | 2 | 优化器状态、梯度 | 2Ψ + (2 + K)Ψ/N |
# | 3 | 优化器状态、梯度、参数 | (2 + 2 + K)Ψ/N |
#
# ZeRO 论文（Rajbhandari et al., SC 2020）的图 1 用 Ψ = 7.5B、K = 12、N = 64 举例，四个阶段依次是
# 120、31.4、16.6、1.9 GB。让估算器 `estimate_model_states` 算一遍，再用公式独立核对：

# %%
PSI, K, N = 7_500_000_000, 12, 64
formulas = {
    0: (2 + 2 + K) * PSI,
    1: (2 + 2) * PSI + K * PSI / N,
    2: 2 * PSI + (2 + K) * PSI / N,
    3: (2 + 2 + K) * PSI / N,
}
paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, figure 1 of the ZeRO paper
print(f"Psi = {PSI:,}, K = {K}, N = {N}; bytes per rank, 1 GB = 1e9 B")
print(f"{'stage':<7}{'estimator':>12}{'formula':>12}{'paper':>9}")
for stage, formula in formulas.items():
    device = estimate_model_states(PSI, stage=stage, world_size=N).device
    print(f"{stage:<7}{device / 1e9:>9.2f} GB{formula / 1e9:>9.2f} GB{paper[stage]:>6.1f} GB")
    assert device == formula and round(device / 1e9, 1) == paper[stage]

# %% [markdown]
# 四个数都对得上（论文保留一位小数：31.41 → 31.4，16.64 → 16.6，1.875 → 1.9）。
# 再看每卡字节数怎样随 N 变化。N 从 1 到 1024，横轴取对数：

# %%
world_sizes = np.unique(np.logspace(0, 10, 61, base=2).round().astype(int))
fig, ax = plt.subplots(figsize=(7, 4.4))
for stage, label in ((0, "stage 0 (data parallel)"), (1, "stage 1: optimizer states"),
                     (2, "stage 2: + gradients"), (3, "stage 3: + parameters")):
    per_rank = [estimate_model_states(PSI, stage=stage, world_size=int(n)).device / 1e9 for n in world_sizes]
    ax.plot(world_sizes, per_rank, label=label)
for floor, text in ((4 * PSI, "4 Psi: stage 1 floor"), (2 * PSI, "2 Psi: stage 2 floor")):
    ax.axhline(floor / 1e9, color="gray", linestyle=":", linewidth=1)
    ax.text(1.1, floor / 1e9 * 1.08, text, fontsize=8, color="gray")
ax.axhline(80, color="black", linestyle="--", linewidth=1, label="80 GB device")
ax.axvline(N, color="tab:red", linestyle=":", linewidth=1, label=f"N = {N} (paper's example)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("data-parallel ranks N")
ax.set_ylabel("model states per rank (GB)")
ax.set_title("7.5B parameters, fp16 + Adam (K = 12)")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8)
show(fig, "bytes_per_rank_vs_n.png")

# %% [markdown]
# stage 1 和 stage 2 很快碰到"地板"：不切分的那部分（stage 1 的 fp16 参数与梯度 4Ψ、stage 2 的 fp16 参数 2Ψ）
# 不随 N 减少。只有 stage 3 随 N 一直线性下降，代价是下面第 3 节要测的额外通信。

# %% [markdown]
# ## 2. 分片长什么样
#
# 引擎不是一个参数一个参数地切，而是先把一个**单元**（unit：一个模块自己注册的全部参数）拉平成一段连续的缓冲，
# 补零到能被 N 整除、且每个分片是 8 个元素的整数倍（`ALIGN`），再均分成 N 段，第 r 段归 rank r。
# 于是分片边界可能正好切在某个参数的中间。`shard_layout(numels, world_size, rank)` 返回 rank 的分片
# 在拉平缓冲中的范围，以及分片里有哪些参数片段（`Slice`）。
#
# 例子：一个单元有三个参数，分别有 10、7、5 个元素，共 22 个，分给 3 个 rank：

# %%
numels, world = [10, 7, 5], 3
layouts = [shard_layout(numels, world, rank) for rank in range(world)]
print(f"parameters {numels}: {sum(numels)} elements, ALIGN = {ALIGN}")
print(f"shard = {ALIGN} * ceil({sum(numels)} / ({world} * {ALIGN})) = {layouts[0].shard_numel} elements, "
      f"padded buffer {layouts[0].padded_numel}, padding {layouts[0].padded_numel - sum(numels)}")
for rank, layout in enumerate(layouts):
    pieces = ", ".join(
        f"p{s.param}[{s.param_start}:{s.param_start + s.numel}] -> shard[{s.shard_start}:{s.shard_start + s.numel}]"
        for s in layout.slices
    )
    owned = sum(s.numel for s in layout.slices)
    print(f"rank {rank}: buffer [{layout.start:>2}, {layout.end:>2})  {pieces}"
          + (f"  + {layout.shard_numel - owned} padding" if owned < layout.shard_numel else ""))

# %%
colors = ["tab:blue", "tab:orange", "tab:green"]
fig, ax = plt.subplots(figsize=(8, 2.8))
offset = 0
for index, numel in enumerate(numels):
    ax.barh(0, numel, left=offset, color=colors[index], edgecolor="white", label=f"parameter p{index} ({numel})")
    offset += numel
pad = layouts[0].padded_numel - offset
ax.barh(0, pad, left=offset, color="lightgray", hatch="//", edgecolor="white", label=f"padding ({pad})")
for rank, layout in enumerate(layouts):
    ax.axvline(layout.start, color="black", linewidth=2)
    ax.text((layout.start + layout.end) / 2, 0.5, f"rank {rank}", ha="center", va="bottom")
ax.axvline(layouts[-1].end, color="black", linewidth=2)
ax.set_ylim(-0.5, 1.5)
ax.set_yticks([])
ax.set_xlabel("element of the unit's flat buffer")
ax.set_title("One unit cut into 3 equal shards: p0 and p1 straddle shard boundaries")
ax.legend(fontsize=8, ncol=4, loc="upper center")
show(fig, "shard_layout.png")

# %% [markdown]
# rank 1 的分片里既有 p0 的最后 2 个元素，又有 p1 的前 6 个；rank 2 拿到 p1 的最后一个元素、整个 p2 和 2 个填充元素。
# 填充只出现在整个单元的末尾。这就是实验 **Lab 2.1** 要写的函数。
#
# 现在对真实模型做同样的事：`build_units(TinyGPT("nano"), 3, rank)` 为每个注册了参数的模块建一个单元。
# `TinyGPT` 的输出层 `lm_head` 与词嵌入 `wte` 共享同一个权重张量（weight tying），它只属于第一个注册它的模块，
# 因此只存一份、只归约一次、只更新一次。

# %%
nano = TinyGPT("nano")
per_rank = [build_units(nano, 3, rank) for rank in range(3)]
units = per_rank[0]
unique = {id(p): p for p in nano.parameters()}
print(f"TinyGPT('nano'): {len(list(nano.named_modules()))} modules, {len(units)} units, "
      f"{len(unique)} distinct parameter tensors, {nano.cfg.num_params():,} parameters")
print(f"lm_head.weight is wte.weight: {nano.lm_head.weight is nano.wte.weight}; "
      f"'lm_head' has a unit of its own: {any(u.name == 'lm_head' for u in units)}")
print(f"\n{'unit':<16}{'params':>7}{'elements':>10}{'padded':>8}{'shard':>7}   pieces on rank 0 | 1 | 2")
for index, unit in enumerate(units):
    pieces = " | ".join(str(len(per_rank[r][index].layout.slices)) for r in range(3))
    print(f"{unit.name:<16}{len(unit.params):>7}{unit.numel:>10,}{unit.padded_numel:>8,}{unit.shard_numel:>7,}"
          f"   {pieces}")
total = sum(u.numel for u in units)
padded = sum(u.padded_numel for u in units)
assert total == nano.cfg.num_params()  # the tied weight is counted once
print(f"\n{total:,} elements, padded to {padded:,}: {padded - total} padding elements "
      f"({(padded - total) / total:.3%}); every rank stores {padded // 3:,} elements of each sharded state")

# %% [markdown]
# 第一个单元 `wte` 里只有一个参数，但 `lm_head` 用的也是它。`lm_head` 没有自己的单元，所以参数总数等于
# `cfg.num_params()`：共享的权重只数一次。填充随单元数增加，但与模型相比微不足道（一个 LayerNorm 的权重与偏置共 128 个元素，
# 分给 3 个 rank 时补成 3 × 48 = 144 个）。内存报告会把它们单独列出来，不藏进估算里。

# %% [markdown]
# ## 3. 两个进程，四个阶段：同样的 loss，不同的内存和通信
#
# 现在真正分布式地训练。`zo train` 是引擎自带的训练脚本，用 `torchrun` 启动时每个 rank 取全局批次中属于自己的那几行
# （按 rank 顺序），所以不论几个进程，每一步看到的都是同一个全局批次。下面对 stage 0、1、2、3 各跑一次：
# 同一个 fp16 配置，只改 `zero_optimization.stage`；两个进程，gloo 后端，只绑定 127.0.0.1，每次用一个空闲端口。
#
# 每次运行后读取 `<out>/summary.json`，并从 rank 0 打印的 `engine.memory_report()` 里取出每个进程的模型状态字节数。

# %%
STEPS = 3 if SMOKE else 12
STAGES = (2,) if SMOKE else (0, 1, 2, 3)
BASE = {
    "train_batch_size": 8,  # 4 rows per rank
    "fp16": {"enabled": True, "initial_scale_power": 12},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
ZERO = {"reduce_bucket_size": 200_000, "overlap_comm": True}  # several buckets per backward, sent asynchronously


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def zo_train(name: str, zero: dict, steps: int = STEPS) -> dict:
    """`torchrun --nproc_per_node 2 -m zero_offload.cli train` with BASE + `zero`; the summary plus rank 0's stdout."""
    run_dir = OUT / "train" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps({**BASE, "zero_optimization": zero}, indent=2), encoding="utf-8")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "zero_offload.cli", "train", "--config", str(config_path),
        "--model", "tiny", "--steps", str(steps), "--out", str(run_dir),
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    summary["stdout"], summary["wall_s"] = proc.stdout, time.perf_counter() - start
    return summary


runs = {}
for stage in STAGES:
    runs[stage] = zo_train(f"stage{stage}", {"stage": stage, **ZERO})
    print(f"stage {stage}: {runs[stage]['steps']} steps in {runs[stage]['wall_s']:.1f} s "
          f"(including start-up of 2 ranks), {runs[stage]['ms_per_step']:.0f} ms/step")
print("\nrank 0's report, stage", STAGES[-1])
print(runs[STAGES[-1]]["stdout"])

# %% [markdown]
# ### 3.1 loss：逐步相同
#
# 四次运行用的是同样的数据、同样的初始权重、同样的数学：分片只改变"谁存哪一段、谁更新哪一段"。
# 比较每一步的 loss：

# %%
reference = runs[STAGES[0]]["losses"]
print(f"{'stage':<7}{'first loss':>11}{'last loss':>11}{'skipped':>9}{f'max |loss - stage {STAGES[0]}|':>23}")
for stage, run in runs.items():
    diff = max(abs(a - b) for a, b in zip(run["losses"], reference, strict=True))
    print(f"{stage:<7}{run['losses'][0]:>11.4f}{run['losses'][-1]:>11.4f}{run['skipped_steps']:>9}{diff:>23.1e}")

# %% [markdown]
# 差值是 0：不是"在误差范围内"，而是逐位相同。这并非理所当然。fp16 下求平均的顺序（先除后加还是先加后除）、
# 同一个梯度分两次舍入，都会让结果差一两个 ulp。这里各阶段都先把梯度除以 N 再求和，两个 fp16 数相加只舍入一次，
# 所以 all-reduce 与 reduce-scatter 得到的每个元素完全相同。`tests/modules/test_zero.py` 用更严格的方式检查等价性：
# 与**单进程**在整批数据上训练的结果比较最终权重，并逐步比较梯度范数（第 2 章 2.8 节）。

# %% [markdown]
# ### 3.2 每个进程的模型状态：实测与估算
#
# rank 0 打印的报告里，`device` 一行是模型状态的估算值与账本实测值。对照 `estimate_model_states(Ψ, stage, world_size=2)`：

# %%
def reported_device(stdout: str) -> tuple[str, str]:
    """The (estimated, measured) device column of the trainer's memory report."""
    match = re.search(r"^device\s+(\d[\d.]* \S+)\s+(\d[\d.]* \S+)\s*$", stdout, re.MULTILINE)
    return match.group(1), match.group(2)


n_params = runs[STAGES[0]]["params"]
units2 = build_units(TinyGPT("tiny"), 2, 0)
padding2 = sum(u.padded_numel for u in units2) - n_params
print(f"TinyGPT('tiny'): {n_params:,} parameters, {len(units2)} units, padding with 2 ranks: {padding2} elements")
print(f"\n{'stage':<7}{'formula (bytes/param)':<26}{'estimate':>11}{'reported':>11}{'measured':>11}")
rule = {0: "16", 1: "4 + 12/2 = 10", 2: "2 + 14/2 = 9", 3: "16/2 = 8"}
for stage, run in runs.items():
    estimate = estimate_model_states(n_params, stage=stage, world_size=2).device
    reported, measured = reported_device(run["stdout"])
    print(f"{stage:<7}{rule[stage]:<26}{format_bytes(estimate):>11}{reported:>11}{measured:>11}")
    assert reported == measured == format_bytes(estimate)

# %% [markdown]
# 账本按张量的真实存储统计，与估算一致。这个模型的每个单元在 N = 2 时恰好不需要填充，所以连字节都相同；
# N = 3 时会多出几十个填充元素，`tests/modules/test_zero.py` 检查的正是"实测 = 估算 + 报告的填充"。
#
# 注意 stage 0 的 12.73 MiB 与第 1 课单进程时相同：普通数据并行每个进程都存完整的 16 字节/参数。
#
# ### 3.3 通信量
#
# `engine.comm.elements` 记录每种集合通信搬了多少元素（每个 rank 的视角）。计数约定与 ZeRO 论文一致：对 P 个元素的缓冲做
# reduce-scatter 或 all-gather，记 P。（环形算法里每个 rank 实际发送 (N−1)/N × P，N 大时趋近 P。）
#
# 理论值（Ψ 为参数量，这里含填充，N = 2 时填充为 0）：
#
# | 阶段 | 每步的集合通信 | 论文的计数 |
# |---|---|---|
# | 0 | 对梯度 all-reduce | 2Ψ（all-reduce = reduce-scatter + all-gather） |
# | 1、2 | 梯度 reduce-scatter Ψ；更新后参数 all-gather Ψ | 2Ψ |
# | 3 | 梯度 reduce-scatter Ψ；前向 all-gather Ψ；反向再 all-gather Ψ | 3Ψ |
#
# 我们的计数器对一次 P 元素的 all-reduce 只记 P（它是一个调用），而论文把它算作 2P，因为环形 all-reduce 的流量
# 就是一次 reduce-scatter 加一次 all-gather。stage 3 还有一处细节：共享的词嵌入在前向中用了两次（`wte` 和 `lm_head`），
# 两次之间已经释放，所以要多聚合一次 `wte` 单元。

# %%
psi = sum(u.padded_numel for u in units2)
tied = units2[0].padded_numel  # the wte unit: gathered again for lm_head
theory_counter = {0: {"all_reduce": psi}, 1: {"reduce_scatter": psi, "all_gather": psi},
                  2: {"reduce_scatter": psi, "all_gather": psi},
                  3: {"reduce_scatter": psi, "all_gather": 2 * psi + tied}}
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
per_step = {}
print(f"Psi = {psi:,} elements; the tied embedding's unit = {tied:,} elements\n")
print(f"{'stage':<7}" + "".join(f"{c:>16}" for c in COLLECTIVES) + f"{'control':>9}{'counted / Psi':>15}"
      f"{'paper / Psi':>13}")
for stage, run in runs.items():
    traffic = {k: v / run["steps"] for k, v in run["traffic_elements"].items()}
    per_step[stage] = traffic
    counted = sum(traffic.get(c, 0) for c in COLLECTIVES)
    paper_count = counted + traffic.get("all_reduce", 0)  # the paper counts an all-reduce twice
    print(f"{stage:<7}" + "".join(f"{traffic.get(c, 0):>16,.0f}" for c in COLLECTIVES)
          + f"{traffic.get('control', 0):>9.0f}{counted / psi:>15.3f}{paper_count / psi:>13.3f}")
    assert {c: traffic[c] for c in COLLECTIVES if c in traffic} == theory_counter[stage]

# %% [markdown]
# - stage 0：计数器记 Ψ，按论文的约定是 2Ψ；
# - stage 1、2：reduce-scatter Ψ + all-gather Ψ = 2Ψ，与普通数据并行**一样多**：切分优化器状态和梯度不增加通信；
# - stage 3：3Ψ 再加上共享词嵌入的一次额外聚合（这个小模型里词嵌入占了 4%，所以是 3.04Ψ），是前两者的 1.5 倍。
#
# `control` 是每步几个单元素的小消息：溢出标志（MAX all-reduce）、梯度平方和（求全局范数）、训练脚本求 loss 的平均。
# stage 0 在 all-reduce 之后每个 rank 的梯度都相同，不必再交换溢出标志和范数，所以只有 loss 那一个。

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.4))
x = np.arange(len(per_step))
width = 0.38
top = 0.0
for side, factor in enumerate((1, 2)):  # left: as engine.comm counts; right: an all-reduce counted twice
    bottom = np.zeros(len(per_step))
    for collective, color in zip(COLLECTIVES, ("tab:purple", "tab:blue", "tab:orange"), strict=True):
        scale = factor if collective == "all_reduce" else 1
        heights = np.array([per_step[s].get(collective, 0) * scale / psi for s in per_step])
        ax.bar(x + (side - 0.5) * width, heights, width, bottom=bottom, color=color,
               hatch="" if side == 0 else "//", edgecolor="white",
               label=collective.replace("_", "-") if side == 0 else None)
        bottom += heights
    for xi, total in zip(x, bottom, strict=True):
        ax.text(xi + (side - 0.5) * width, total, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
    top = max(top, bottom.max())
handles, labels = ax.get_legend_handles_labels()
handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//"))
labels.append("hatched: the paper's count (all-reduce = 2 x P)")
ax.set_xticks(x, [f"stage {s}" for s in per_step])
ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
ax.set_ylabel("elements per step per rank / Psi")
ax.set_title("Collective traffic per step, tiny GPT on 2 ranks")
ax.legend(handles, labels, fontsize=8, loc="upper left", ncol=2)
ax.grid(alpha=0.3, axis="y")
show(fig, "traffic_per_stage.png")

# %% [markdown]
# 左边的实心柱是计数器的原始读数，右边带斜线的柱按论文的约定把 all-reduce 算两次。按论文的口径，
# stage 0、1、2 都是 2Ψ，stage 3 是 3Ψ（加词嵌入的一次额外聚合）。
#
# 每步耗时（`ms_per_step`）在这台 2 核机器上主要由两个进程抢两个核决定，通信走本机回环，
# 它的差别说明不了 GPU 集群上的快慢，这里不作比较。

# %% [markdown]
# ## 4. 激活重计算：用计算换显存
#
# 第 1 课测过：不做任何处理时，激活值约为 2·(16L + 2)·b·s·h 字节（fp16），与批大小成正比。激活重计算
# （activation checkpointing）在前向时只保留每个 Transformer 块的**输入**，块内部的中间结果一律不存；
# 反向走到某个块时，先用保存的输入把这个块的前向再算一遍，得到它的激活，再做它的反向。
# 于是激活从"L 个块的全部"降到"L 个块的输入 + 一个块的全部"，代价是多做一次前向。
#
# 在配置里加一个 `"activation_checkpointing": {}` 节就打开它（DeepSpeed 的键名）。下面在一个进程里比较两个引擎：
# 前向之后的激活字节数、前向加反向期间的峰值（减去模型状态）、每步耗时（两个引擎交替运行，取中位数；计时期间 PyTorch 只用一个线程：
# 别的程序同时占着这两个核时，多线程之间的相互等待会让单步耗时成倍抖动，单线程的数字稳定得多），以及 loss。

# %%
AC_MODEL, AC_BATCH, AC_STEPS = ("nano", 4, 2) if SMOKE else ("small", 4, 6)
ac_base = {"train_batch_size": AC_BATCH, "fp16": {"enabled": True, "initial_scale_power": 12},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
variants = {"keep activations": ac_base, "recompute": {**ac_base, "activation_checkpointing": {}}}
cfg_ac = TinyGPT(AC_MODEL).cfg
data_ac = ByteBatches(load_corpus(), cfg_ac.seq_len)
engines, accels, fc_calls = {}, {}, {}
for name, config in variants.items():
    accels[name] = EmulatedAccelerator()
    model = TinyGPT(AC_MODEL)
    engines[name] = zo.initialize(model, config, accelerator=accels[name])
    fc_calls[name] = 0

    def count(*_, name=name):
        fc_calls[name] += 1

    for block in model.blocks:
        block.fc.register_forward_hook(count)  # the MLP's first layer runs once per block forward

results = {name: {"loss": [], "acts": [], "peak": [], "fwd_s": [], "fwd_bwd_s": [], "step_s": []} for name in variants}
threads = torch.get_num_threads()
torch.set_num_threads(1)  # steady timings on a busy machine (see above)
for step in range(AC_STEPS + 1):  # step 0 warms up and is left out of the timings
    x, y = data_ac.global_batch(step, AC_BATCH)
    for name, engine in engines.items():  # interleaved, so that load from elsewhere hits both alike
        accel, r = accels[name], results[name]
        states = accel.memory_stats().in_use
        accel.reset_peak()
        fc_before = fc_calls[name]
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), y)
        t_fwd = time.perf_counter()
        acts = accel.memory_stats().by_category["activations"]
        engine.backward(loss)
        t1 = time.perf_counter()
        peak = accel.memory_stats().peak - states
        engine.step()
        t2 = time.perf_counter()
        r["loss"].append(loss.item())
        r["acts"].append(acts)
        r["peak"].append(peak)
        r["fc"] = fc_calls[name] - fc_before
        if step > 0:
            r["fwd_s"].append(t_fwd - t0)
            r["fwd_bwd_s"].append(t1 - t0)
            r["step_s"].append(t2 - t0)
torch.set_num_threads(threads)

L, tokens = cfg_ac.n_layer, AC_BATCH * cfg_ac.seq_len
print(f"TinyGPT('{AC_MODEL}'): L = {L}, h = {cfg_ac.d_model}, batch {AC_BATCH} x {cfg_ac.seq_len} tokens, "
      f"{engines['recompute'].num_params:,} parameters")
print(f"{'':<18}{'acts after fwd':>15}{'peak fwd+bwd':>14}{'block fwds/step':>17}{'fwd ms':>8}"
      f"{'fwd+bwd ms':>12}{'step ms':>9}")
median_ms = {name: {key: statistics.median(r[key]) * 1e3 for key in ("fwd_s", "fwd_bwd_s", "step_s")}
             for name, r in results.items()}
for name, r in results.items():
    ms = median_ms[name]
    print(f"{name:<18}{format_bytes(r['acts'][-1]):>15}{format_bytes(r['peak'][-1]):>14}{r['fc']:>17}"
          f"{ms['fwd_s']:>8.0f}{ms['fwd_bwd_s']:>12.0f}{ms['step_s']:>9.0f}")
keep, rec = results["keep activations"], results["recompute"]
fwd, fwd_bwd = median_ms["keep activations"]["fwd_s"], median_ms["keep activations"]["fwd_bwd_s"]
print(f"\nlosses identical: {keep['loss'] == rec['loss']}  ({keep['loss'][0]:.4f} -> {keep['loss'][-1]:.4f})")
print(f"activations after forward: {rec['acts'][-1] / keep['acts'][-1]:.1%} of keeping them all; "
      f"block inputs alone: L*b*s*h*2 = {format_bytes(L * tokens * cfg_ac.d_model * 2)}")
print(f"forward + backward with recomputation: x{median_ms['recompute']['fwd_bwd_s'] / fwd_bwd:.2f} measured; "
      f"x{(fwd_bwd + fwd) / fwd_bwd:.2f} if it costs one more forward (backward/forward here = "
      f"{(fwd_bwd - fwd) / fwd:.1f}); x1.33 if backward = 2 x forward")
assert keep["loss"] == rec["loss"] and rec["fc"] == 2 * keep["fc"]

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
names = list(results)
pos = np.arange(len(names))
for offset, (key, label) in zip((-0.2, 0.2), (("acts", "activations after forward"),
                                              ("peak", "peak during forward + backward")), strict=True):
    values = [results[n][key][-1] / 2**20 for n in names]
    ax1.bar(pos + offset, values, 0.4, label=label)
    for p, v in zip(pos + offset, values, strict=True):
        ax1.text(p, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
ax1.set_xticks(pos, names)
ax1.set_ylabel("MiB above the model states")
ax1.set_title("Device memory (emulated, fp16 storage)")
ax1.legend(fontsize=8)
for offset, (key, label) in zip((-0.2, 0.2), (("fwd_bwd_s", "forward + backward"),
                                              ("step_s", "whole step (with Adam)")), strict=True):
    values = [median_ms[n][key] for n in names]
    ax2.bar(pos + offset, values, 0.4, label=label)
    for p, v in zip(pos + offset, values, strict=True):
        ax2.text(p, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
ax2.set_xticks(pos, names)
ax2.set_ylabel(f"ms, median of {AC_STEPS} steps, 1 thread")
ax2.set_title("Time per step")
ax2.legend(fontsize=8)
show(fig, "recompute.png")

# %% [markdown]
# - **内存**：前向之后，重计算只剩每个块的输入（L·b·s·h 个元素，fp16 下每个 2 字节）和块外面的一点（最后的 LayerNorm）；
#   反向期间的峰值是这些再加上**一个块**重算出来的激活。不重计算时，前向之后的激活就是峰值。
# - **计算**：每个块的前向做了两次（上表 "block fwds/step" 一列由钩子计数，恰好翻倍）。一次训练步的计算量约为
#   前向 1 份、反向 2 份（对输入和对权重各求一次梯度），重计算多出 1 份前向，所以是 4/3 ≈ 1.33 倍。
#   实测的倍数取决于这台机器上反向与前向的实际耗时之比：反向若不止前向的 2 倍，多出的一次前向占比就小于 1/3。
#   上面按实测的前向、反向时间推算了"多一次前向"应有的倍数，可以与实测对照；机器当时的负载也会让数字上下浮动。
# - **结果**：loss 逐位相同。重计算不改变数学，只改变什么时候算、存什么。
#
# 注意模拟设备只给 autograd **保存**的张量记账；反向中临时的激活梯度不在账上，真实 GPU 上的峰值还要再高一些。

# %% [markdown]
# ## 5. stage 3：用前聚合，用后释放
#
# stage 3 每个 rank 平时只存参数的 1/N。一个模块要算之前，引擎的前向预钩子（forward pre-hook）把它所在单元的
# 分片 all-gather 成完整的参数；模块算完，前向钩子立刻释放这块存储。反向时，反向预钩子再聚合一次，
# 这个单元的梯度全部产生后再释放。下面在一个进程里（N = 1，"分片"就是整个单元，聚合是一次本地拷贝，
# 但分配与释放的过程与多进程时完全一样）记录每个模块开始计算时设备上参数类别的字节数。
#
# `stage3_prefetch_bucket_size` 控制**预取**：聚合一个单元时，顺便异步发起后面若干单元的聚合，总量不超过这么多元素，
# 让通信与当前模块的计算重叠。前向和反向的顺序各自来自它们的第一次（那一次只记录、不预取），所以要看第二步。

# %%
E_MODEL, E_BATCH = ("nano" if SMOKE else "tiny"), 4
data_e = ByteBatches(load_corpus(), TinyGPT(E_MODEL).cfg.seq_len)
traces, checks = {}, {}
for bucket in (1, 200_000, 500_000_000):  # no prefetch, about one block ahead, everything (10x DeepSpeed's 5e7)
    accel = EmulatedAccelerator()
    model = TinyGPT(E_MODEL)
    engine = zo.initialize(model, {**ac_base, "train_batch_size": E_BATCH,
                                   "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": bucket}},
                           accelerator=accel)
    trace = []

    def record(module, *_, trace=trace, accel=accel):
        trace.append(accel.memory_stats().by_category["parameters"])

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            # Registered after the engine's hooks, so these run once the unit has been gathered.
            module.register_forward_pre_hook(record)
            module.register_full_backward_pre_hook(record)
    for step in range(2):
        trace.clear()
        x, y = data_e.global_batch(step, E_BATCH)
        at_rest = accel.memory_stats().by_category["parameters"]
        logits = engine(x)
        after_forward = accel.memory_stats().by_category["parameters"]
        engine.backward(lm_loss(logits, y))
        gathered = [u.gathered for u in engine.states.units]
        after_backward = accel.memory_stats().by_category["parameters"]
        engine.step()
    traces[bucket] = list(trace)
    checks[bucket] = (at_rest, after_forward, after_backward, max(trace), sum(gathered), len(gathered))

print(f"{'stage3_prefetch_bucket_size':>29}{'at rest':>12}{'after fwd':>12}{'after bwd':>12}{'max in use':>12}"
      f"{'units gathered after bwd':>26}")
for bucket, (rest, fwd, bwd, top, n_gathered, n_units) in checks.items():
    print(f"{bucket:>22,}{format_bytes(rest):>12}{format_bytes(fwd):>12}{format_bytes(bwd):>12}"
          f"{format_bytes(top):>12}{f'{n_gathered} of {n_units}':>26}")
    assert rest == fwd == bwd and n_gathered == 0

# %%
fig, ax = plt.subplots(figsize=(8, 4))
for bucket, trace in traces.items():
    ax.step(range(len(trace)), np.array(trace) / 2**20, where="post", label=f"stage3_prefetch_bucket_size {bucket:,}")
ax.axhline(checks[1][0] / 2**20, color="black", linestyle="--", linewidth=1, label="the shards alone (at rest)")
n_forward = len(traces[1]) // 2
ax.axvline(n_forward - 0.5, color="gray", linestyle=":")
ax.text(n_forward * 0.5, ax.get_ylim()[1] * 0.98, "forward", ha="center", va="top")
ax.text(n_forward * 1.5, ax.get_ylim()[1] * 0.98, "backward", ha="center", va="top")
ax.set_xlabel("module about to run (in order)")
ax.set_ylabel("parameter bytes on the device (MiB)")
ax.set_title("ZeRO-3 on one rank: gather before use, release after")
ax.legend(fontsize=8, loc="center right")
ax.grid(alpha=0.3)
show(fig, "stage3_gather_release.png")

# %% [markdown]
# - 前向之前、前向之后、反向之后，设备上的参数字节数相同：只有分片。反向之后没有一个单元处于"已聚合"状态
#   （`engine.states.units[i].gathered` 全是 False）。
# - 不预取（`stage3_prefetch_bucket_size` = 1）时，任一时刻最多只多出正在用的那个单元，曲线是锯齿；
#   预取得越多，峰值越高：DeepSpeed 的默认值 5 亿元素对小模型等于"一开始就把后面的全取来"。
#   预取用显存换时间：聚合提前发出，与计算重叠。
# - 反向部分同样随预取量升高，而且基线比前向高出一个 `wte` 单元。反向最先运行的是 `lm_head`，它聚合了共享的
#   词嵌入单元；这个单元的梯度要等到最后 `wte` 的反向做完才完整，所以它一直留到反向结束。反向的预取顺序是
#   第一次反向记录下来的顺序（以这个共享单元开头），不是前向顺序的简单倒序。
#
# 预取改变的是**什么时候**通信，不是通信多少。多进程时计数器才有东西可数，所以下面用两个进程再跑一次 stage 3，
# 关掉预取，与第 3 节的 stage 3（默认值，全部预取）比较：

# %%
if 3 in runs:
    no_prefetch = zo_train("stage3_no_prefetch", {"stage": 3, **ZERO, "stage3_prefetch_bucket_size": 1})
    print(f"{'stage 3':<26}{'all_gather/step':>16}{'reduce_scatter/step':>21}{'last loss':>11}")
    for label, run in (("prefetch (default)", runs[3]), ("stage3_prefetch_bucket_size 1", no_prefetch)):
        t = run["traffic_elements"]
        print(f"{label:<26}{t['all_gather'] / run['steps']:>16,.0f}{t['reduce_scatter'] / run['steps']:>21,.0f}"
              f"{run['losses'][-1]:>11.4f}")
    assert no_prefetch["traffic_elements"] == runs[3]["traffic_elements"]
    assert no_prefetch["losses"] == runs[3]["losses"]
    print("same elements moved, same losses: prefetching only moves the gathers earlier")
else:
    print("smoke mode: stage 3 was not run on 2 ranks, so there is nothing to compare")

# %% [markdown]
# ## 小结
#
# - ZeRO 的三个阶段依次切分优化器状态、梯度、参数。7.5B 参数、64 张卡时，每卡从 120 GB 降到 31.4、16.6、1.9 GB；
#   只有 stage 3 随 N 一直下降。
# - 引擎按单元（一个模块的参数）拉平、补零到 N 个等长分片（8 个元素的倍数）；分片可以切穿参数；共享的权重只算一次。
# - 两个进程上，stage 0～3 的 loss 逐位相同；每个进程的模型状态实测等于估算：16、10、9、8 字节/参数。
# - 通信量：stage 0 的 all-reduce 按论文计 2Ψ，stage 1、2 是 reduce-scatter Ψ + all-gather Ψ = 2Ψ，
#   stage 3 是 3Ψ（外加共享词嵌入的一次额外聚合），是前者的 1.5 倍。
# - 激活重计算只保留每块的输入，激活显存大幅下降，每个块多做一次前向（约多 1/3 计算），结果不变。
# - stage 3 在模块用前聚合、用后释放；预取只把聚合提前，搬运的元素数不变，峰值显存随预取量上升。
#
# ## 接下来：实验 2
#
# 在仓库根目录运行 `make lab2` 为实验 2 评分（`make lab2 LAB_DIR=solutions` 看参考答案的满分表）。四个任务：
#
# | 任务 | 内容 | 文件 |
# |---|---|---|
# | Lab 2.1 | 分片范围：分片大小、填充、分片里的参数片段 | `labs/lab2/principles/partition.py` |
# | Lab 2.2 | 把梯度 reduce-scatter 进本 rank 拥有的分片（求平均） | `labs/lab2/principles/zero.py` |
# | Lab 2.3 | 更新后的参数分片 all-gather 回完整参数 | `labs/lab2/principles/zero.py` |
# | Lab 2.4 | stage 3 在一个层前后的聚合与释放 | `labs/lab2/principles/zero.py` |
#
# 卡住时运行 `grep -rn "Lab 2.4"`，就能同时找到实验桩、第 2 章里讲解它的段落和评分测试。
# 原理的完整推导见 `course/02-principles.md`。
