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
# # 第 5 课 实战篇：把拷贝和 CPU 藏起来，再把整套训练跑通
#
# 本笔记本配合 `course/05-practice.md` 使用。前四课让 ZeRO-Offload 跑对、跑快；本课把它们拼成能用的训练：
#
# 1. 三种调度并排：串行（第 3 模块）、重叠流水线（`overlap_offload`）、延迟参数更新（DPU），看时间线和每步时间；
# 2. 重叠什么时候有用：每步 token 数变大时设备的活变多、Adam 不变；分核（`cores="split"`）与共核（`"shared"`）；
#    再用第 4 课的性能模型看一张真 GPU 上的同一件事；
# 3. 重叠流水线与串行逐位相同；
# 4. DPU 的代价：晚一步的梯度，loss 曲线差多少；
# 5. NVMe 层：优化器状态放进文件，每一层存储的字节、磁盘上的文件、与 CPU 层逐位相同、每步多花的时间，以及磁盘满了会怎样；
# 6. 一个设备预算下能训练的最大模型：不卸载对 stage 3 + 全部卸载，与论文的 13B 对 1.4B 对照；
# 7. `zo train`：两个回环"节点"上的训练、断点续训，以及杀掉一个 rank 之后发生什么。
#
# 所有数字都在这台机器上现场测出。这台机器只有 2 个核，而且可能同时有别的程序在跑，计时会抖：
# 每个比较都交替测量、取中位数，结论看机制和量级，不看一次的小数点。
# 图保存在仓库根目录的 `out/lessons/05/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会缩小问题规模、跳过多进程的部分，只用于快速检查笔记本能否跑通
# （`python tools/run_lessons.py --smoke 05`）。

# %%
import contextlib
import errno
import io
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are for the terminal; child processes inherit this

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Image, display

import zero_offload as zo
from zero_offload import plots
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.basics import estimate_model_states
from zero_offload.cli import main as zo_cli
from zero_offload.practice.largest import host_memory_available, largest_without_offload, offloaded_run
from zero_offload.practice.nvme import NVMeError, SwapFiles
from zero_offload.practice.run_dir import newest_complete
from zero_offload.practice.schedules import _restored_threads, compare_schedules, split_cores
from zero_offload.practice.timeline import STAGES, plot_timeline
from zero_offload.tuning import perfmodel
from zero_offload.units import format_bytes, format_gb
from zero_offload.workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus

SMOKE = os.environ.get("ZO_SMOKE") == "1"
# One torch thread, as in lessons 3 and 4: on a 2-core machine that runs anything else, a 2-thread parallel region
# waits for a thread that is not scheduled. compare_schedules sets its own threads and gives them back.
torch.set_num_threads(1)
ROOT = Path.cwd().parent if Path.cwd().name == "lessons" else Path.cwd()
OUT = ROOT / "out" / "lessons" / "05"
OUT.mkdir(parents=True, exist_ok=True)
CORPUS = load_corpus()
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
MIB = 2**20


def show(fig, name: str) -> None:
    plots.show(fig, OUT / name)  # saved under out/lessons/05/ and displayed


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


print(f"{cpu_name()}, {CORES} cores; torch {torch.__version__}; smoke mode: {SMOKE}")
print(f"figures go to {OUT.relative_to(ROOT)}/")

# %% [markdown]
# ## 1. 三种调度：串行、重叠、延迟一步
#
# 第 3 模块的一步是**串行**的：反向期间每个桶一归约完，就在设备自己的线程上经 PCIe 下行（D2H）、在主机上累加；
# 反向结束后 CPU 对整个分区做 Adam，新的权重再上行（H2D）。CPU 跑 Adam 时设备在等，设备跑反向时 CPU 在等：
#
# ```
# serial      device  | forward | backward |..........................| forward ...
#             link               D2H D2H D2H                    H2D H2D
#             CPU                            | Adam over everything |
# ```
#
# 第 5 模块的两个开关都在配置的 `"zero_offload"` 一节里：
#
# - `"overlap_offload": true`（`practice/pipeline.py`）：每个单元的梯度一算出来就经**拷贝流**下行，CPU 的**主机队列**马上累加、
#   做这个单元的 Adam、把新权重交给**上传流**上行。第 k 个单元做 Adam 时，第 k+1 个在下行，第 k−1 个在上行。
#   主机上的中转缓冲轮流使用（`SlotRing`，默认两个槽即双缓冲，`"staging_slots"` 可调）：一个槽只有在读它的人读完之后才能再写；
# - `"delayed_param_update": {"enabled": true, "start_step": N}`（`practice/dpu.py`）：从第 N 步起，第 t 步的 Adam
#   在第 t+1 步的前向、反向**期间**跑，第 t+1 步用的是晚一步的权重（论文的 DPU）；
# - `"cores": {"device": [0], "host": [1]}`：这台机器上没有 GPU，设备是模拟的，它的计算也在 CPU 上。
#   把设备的计算（本线程、PyTorch 的算子）钉在 0 号核，主机的 Adam 和拷贝钉在 1 号核，才像"GPU 和 CPU 是两块芯片"。
#
# ```
# overlapped  device  | forward | backward ......... |   | forward ...
#             link        D2H(k) D2H(k+1) ... H2D(k-1) H2D(k)
#             CPU            Adam(k) Adam(k+1) ...  Adam(last)
# delayed     device  | forward t+1 | backward t+1 | forward t+2 ...
#             CPU     | Adam(t) ............ |  Adam(t+1) .......
# ```
#
# `practice.schedules.compare_schedules` 用同一个模型、同样的数据建三个引擎（stage 2 + `offload_optimizer`、fp32、C Adam），
# 一轮里三个调度各跑几步，交替若干轮，取每步时间的中位数；每轮结束时 `engine.synchronize()`，DPU 还在路上的那次更新算进它自己这一轮。
# 加速比取每一轮里两个调度之比的中位数（每轮把先后倒过来），因为这台机器几秒之内就能整体快慢一两成。
# 重叠与 DPU 用 4 个主机暂存槽（`"staging_slots": 4`，默认 2 即双缓冲；为什么要 4 个，见 2.4 节）。
# 先看 `make bench` 用的那个设置：10.8M 参数的模型，批 1、每条 8 个字节。每步的 token 极少，设备的活少、Adam 的份额大（"重优化器"），分核：

# %%
S_MODEL = "nano" if SMOKE else "10m"
S_ROUNDS, S_STEPS = (2, 2) if SMOKE else (7, 4)
S_SEQ = 8
split = compare_schedules(S_MODEL, batch=1, seq_len=S_SEQ, steps=S_STEPS, rounds=S_ROUNDS, cores="split",
                          out_dir=OUT)
cores_split = split_cores()
print(f"TinyGPT('{S_MODEL}'): {split['params']:,} parameters, batch 1 x {S_SEQ} tokens, fp32, stage 2 + CPU offload; "
      f"device on core(s) {cores_split[0]}, host on {cores_split[1]}")
print(f"median ms per step over {S_ROUNDS} interleaved rounds of {S_STEPS} steps\n")
print(f"{'schedule':<16}{'ms/step':>9}{'vs serial':>11}   (each round's own ratio, median over rounds)")
for name, ms in split["median_ms"].items():
    speedup = statistics.median(r["serial"] / r[name] for r in split["per_round_ms"])
    print(f"{name:<16}{ms:>9.1f}{speedup:>10.2f}x")

# %% [markdown]
# `compare_schedules` 也画了每个引擎最后 16 步的时间线（`engine.timeline(path)`，一条泳道一个阶段）。
# 16 步是交替的几轮，每轮几步，中间的空白是另外两个引擎在跑：

# %%
for path in split["plots"].values():
    display(Image(filename=path))

# %% [markdown]
# 这几张图把一步压得太扁。下面用同样的配置再建三个引擎，轮流各跑几步，把**一步**放大，并从时间线里按阶段量出每一步各花了多少：
# 前向、反向、CPU 上 Adam 忙了多久（所有 Adam 片段之和），以及反向结束之后设备还要等多久（"反向之后的尾巴"：
# 串行时是 Adam + 上行；重叠时是没藏住的那部分 Adam 与上行；DPU 时是等上一步的 Adam 收尾、发布权重）。
#
# 每个引擎跑完自己那几步就 `engine.synchronize()`：DPU 的最后一次更新若还在主机队列上，就会和下一个引擎的步同时跑，
# 拖慢别人、也让自己的下一步白捡一次"不用等"（`compare_schedules` 也是这样做的）。

# %%
def offload_config(*, batch: int = 1, overlap: bool = False, dpu_start: int | None = None, cores=None,
                   precision: str = "fp32", clip: float = 0.0, bucket: int = 1_000_000, slots: int = 4) -> dict:
    """Stage 2 + CPU offload, the C Adam; module 5's switches under "zero_offload" (compare_schedules' config)."""
    extension = {"cpu_adam": {"impl": "simd"}, "overlap_offload": overlap}
    if overlap:
        extension["staging_slots"] = slots
    if dpu_start is not None:
        extension["delayed_param_update"] = {"enabled": True, "start_step": dpu_start}
    if cores is not None:
        extension["cores"] = {"device": cores[0], "host": cores[1]}
    config = {
        "train_batch_size": batch,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        # Buckets of about one block, reduced as soon as they fill: gradients leave while backward runs.
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                              "reduce_bucket_size": bucket},
        "zero_offload": extension,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return config


SCHEDULE_SWITCHES = {"serial": {}, "overlapped": {"overlap": True}, "delayed (DPU)": {"overlap": True, "dpu_start": 2}}


def step_spans(engine, step: int):
    return [s for s in engine.timeline()[0] if s.step == step]


def phases(spans) -> dict:
    """ms of forward, backward, the host's Adam (busy), and the tail: from the end of backward to the step's last span."""
    ms = {stage: sum((s.end - s.start) * 1e3 for s in spans if s.stage == stage) for stage in ("forward", "backward", "Adam")}
    backward_end = max(s.end for s in spans if s.stage == "backward")
    ms["tail after backward"] = max(0.0, (max(s.end for s in spans) - backward_end) * 1e3)
    return ms


def zoom(cores: str, rounds: int, block: int) -> dict:
    """Three engines taking turns, `block` steps each a round: each step's wall time and phases, and the spans
    of each engine's median step. A turn ends with engine.synchronize(), so that no update still in flight
    runs during the next engine's turn; the first round (warm-up) and the first step of every turn (it has no
    update of the step before to wait for) are not counted."""
    with _restored_threads():  # the engines pin this thread and set torch's threads: give both back afterwards
        if cores == "shared":
            torch.set_num_threads(CORES)
        pinned = split_cores() if cores == "split" else None
        data = ByteBatches(CORPUS, S_SEQ, seed=0)
        engines = {name: zo.initialize(TinyGPT(gpt_config(S_MODEL, seq_len=S_SEQ), seed=0),
                                       offload_config(cores=pinned, **switches), accelerator=EmulatedAccelerator())
                   for name, switches in SCHEDULE_SWITCHES.items()}
        walls = {name: {} for name in engines}
        for turn in range(rounds):
            for name, engine in engines.items():
                for k in range(block):
                    step = engine.global_steps
                    x, y = data.global_batch(step, 1)
                    started = time.perf_counter()
                    engine.backward(lm_loss(engine(x), y))
                    engine.step()
                    if turn > 0 and k > 0:
                        walls[name][step] = (time.perf_counter() - started) * 1e3
                engine.synchronize()
        result = {}
        for name, engine in engines.items():
            measured = sorted(walls[name])
            per_step = {step: phases(step_spans(engine, step)) for step in measured}
            median_step = sorted(measured, key=lambda k: walls[name][k])[len(measured) // 2]
            result[name] = {
                "wall": statistics.median(walls[name][k] for k in measured),
                **{p: statistics.median(per_step[k][p] for k in measured) for p in per_step[measured[0]]},
                "spans": step_spans(engine, median_step),
                "steps": len(measured),
            }
        return result


def print_phases(zoomed: dict) -> None:
    print(f"{'schedule':<16}{'step (wall)':>12}{'forward':>9}{'backward':>10}{'CPU Adam':>10}{'tail after backward':>21}")
    for name, r in zoomed.items():
        print(f"{name:<16}{r['wall']:>12.1f}{r['forward']:>9.1f}{r['backward']:>10.1f}{r['Adam']:>10.1f}"
              f"{r['tail after backward']:>21.1f}")


ZOOM_ROUNDS, ZOOM_BLOCK = (2, 3) if SMOKE else (4, 4)  # at most 16 steps an engine: what its timeline keeps
zoom_split = zoom("split", ZOOM_ROUNDS, ZOOM_BLOCK)
print(f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores; medians (ms) over "
      f"{zoom_split['serial']['steps']} steps of each schedule\n")
print_phases(zoom_split)


# %%
def draw_steps(zoomed: dict, title: str, name: str) -> None:
    """One step of each schedule (the one with the median wall time), lanes per stage, time from its first span."""
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors, strict=False))
    lanes = [s for s in STAGES if any(span.stage == s for r in zoomed.values() for span in r["spans"])]
    fig, axes = plt.subplots(len(zoomed), 1, figsize=(10, 1.1 + 0.42 * len(lanes) * len(zoomed)), sharex=True)
    for ax, (schedule, r) in zip(axes, zoomed.items(), strict=True):
        origin = min(s.start for s in r["spans"])
        for lane, stage in enumerate(lanes):
            bars = [((s.start - origin) * 1e3, max((s.end - s.start) * 1e3, 0.05)) for s in r["spans"] if s.stage == stage]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[stage])
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{schedule}: {r['wall']:.0f} ms a step (median)", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time within the step (ms)")
    fig.suptitle(title, fontsize=10)
    show(fig, name)


draw_steps(zoom_split, f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores: one step of each schedule",
           "one_step_split.png")

# %% [markdown]
# 读这张图和上面的表：
#
# - **串行**：D2H 的竖条落在反向期间，但它们是在反向自己的线程上一个接一个做的（第 3 模块：每个桶归约完，钩子里就下行、累加），
#   占的是反向的时间；Adam 和 H2D 全在反向之后，设备等着。"反向之后的尾巴"几乎就是 CPU Adam 加上上行；
# - **重叠**：下行、累加、Adam、上行都搬到了主机那个核上（下行走拷贝流，上行走另一条上传流：上行要等本单元的 Adam，
#   若与下行排在同一条按序执行的流里，下一个单元的下行就得跟着等），在反向还没结束时就开始，尾巴只剩几毫秒。
#   但主机上 Adam 的片段比串行时长得多（它还顺手算了每个单元的梯度范数），反向也不比串行时短：分核只把"算"分开了，
#   两个核共用同一份内存带宽和 L3 缓存，而在批 1 的小批次上，反向和 Adam 都是搬内存的活
#   （第 4 章 4.4 节：这台机器上 2 个线程只比 1 个快 1.16 倍）。藏起来的时间，有一部分又以"两边都变慢"的形式还了回来；
# - **DPU**：上一步的 Adam 出现在这一步的最前面，与前向同时跑；这一步的反向每做完一个单元，那个单元的新权重就上行，
#   尾巴只剩等最后几个单元落地。
#
# 重叠最多能省下的，是串行时的那条尾巴（加上反向里那些就地的下行与累加）；它占一步的比例，决定了重叠值不值得。下一节让这个比例变化。

# %% [markdown]
# ## 2. 重叠什么时候有用
#
# ### 2.1 每步的 token 数：设备的活随它长，Adam 不长
#
# Adam 每步更新所有参数一次，与批多大无关；前向、反向的计算随每步 token 数（批 × 序列长）线性增长。
# 同一个模型、同样分核，改变批和序列长，看三种调度的每步时间：

# %%
TOKEN_SHAPES = [(1, 8), (1, 32)] if SMOKE else [(1, 8), (1, 32), (1, 128), (4, 128)]
sweep = {}
for batch, seq_len in TOKEN_SHAPES:
    sweep[batch, seq_len] = compare_schedules(S_MODEL, batch=batch, seq_len=seq_len, steps=2 if SMOKE else 3,
                                              rounds=2 if SMOKE else 5, cores="split")
print(f"TinyGPT('{S_MODEL}'), split cores; median ms per step (interleaved rounds)\n")
print(f"{'batch x seq':>12}{'tokens':>8}{'serial':>9}{'overlapped':>12}{'DPU':>8}{'overlapped vs serial':>22}{'DPU vs serial':>15}")
for (batch, seq_len), r in sweep.items():
    ms = r["median_ms"]
    print(f"{f'{batch} x {seq_len}':>12}{batch * seq_len:>8}{ms['serial']:>9.1f}{ms['overlapped']:>12.1f}"
          f"{ms['delayed (DPU)']:>8.1f}{r['overlapped_vs_serial']:>21.2f}x{ms['serial'] / ms['delayed (DPU)']:>14.2f}x")
adam_ms = zoom_split["serial"]["Adam"]
print(f"\nCPU Adam over the whole partition, serial schedule, batch 1 x {S_SEQ} (section 1): {adam_ms:.1f} ms a step "
      "at every batch size")

# %%
tokens = [b * s for b, s in sweep]
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for name, style in (("serial", "o-"), ("overlapped", "s-"), ("delayed (DPU)", "^-")):
    ax.plot(tokens, [r["median_ms"][name] for r in sweep.values()], style, label=name)
ax.axhline(adam_ms, color="gray", linestyle="--", linewidth=1, label=f"CPU Adam alone ({adam_ms:.0f} ms)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(tokens, [f"{b}x{s}" for b, s in sweep])
ax.set_xlabel("tokens a step (batch x sequence length)")
ax.set_ylabel("ms per step (median)")
ax.set_title(f"TinyGPT('{S_MODEL}'), split cores: the device's work grows, Adam's does not")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
show(fig, "step_time_vs_tokens.png")

# %% [markdown]
# 读这张图：
#
# - Adam 是每步固定的一笔（虚线），token 越多，它在一步里的份额越小；串行时反向之后的尾巴也就越不值得藏；
# - token 最少的时候 Adam 的份额最大，重叠（和 DPU）省得最多；token 一多，三条曲线就并到一起，批 4 × 128 时几乎没有差别；
# - 即使批 1 × 8 个 token，模拟设备的前向、反向也比 Adam 长：反向要把每个参数的梯度写一遍、分桶、下行，
#   这是与参数量成正比的一笔内存流量，不随 token 变少而消失。所以这台机器上没有一个点是"CPU 那一步是瓶颈"的，
#   DPU 比重叠多藏的只是与前向同时跑的那一小段；
# - 比值会在几次执行之间起伏几个百分点。拿一个比值和"藏住整条尾巴"能省下的上限比一比（第 1 节的表），超出上限的部分只能是噪声。
#
# ### 2.2 共用核：两段活抢同一份资源
#
# `cores="shared"` 时不钉核：设备的计算和 CPU 的 Adam 都用两个核（PyTorch 2 个线程、C Adam 2 个线程）。
# 串行时每一段都独占两个核；重叠时两段同时要核，操作系统只能让它们轮流上核，而且仍然共用一份内存带宽：

# %%
shared = compare_schedules(S_MODEL, batch=1, seq_len=S_SEQ, steps=S_STEPS, rounds=S_ROUNDS, cores="shared")
print(f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}; median ms per step\n")
print(f"{'cores':<8}{'serial':>9}{'overlapped':>12}{'DPU':>8}{'overlapped vs serial':>22}{'DPU vs serial':>15}")
for label, r in (("split", split), ("shared", shared)):
    ms = r["median_ms"]
    print(f"{label:<8}{ms['serial']:>9.1f}{ms['overlapped']:>12.1f}{ms['delayed (DPU)']:>8.1f}"
          f"{r['overlapped_vs_serial']:>21.2f}x{ms['serial'] / ms['delayed (DPU)']:>14.2f}x")
zoom_shared = zoom("shared", ZOOM_ROUNDS, ZOOM_BLOCK)
print(f"\nphases with shared cores (ms, medians over {zoom_shared['serial']['steps']} steps):")
print_phases(zoom_shared)

# %%
draw_steps(zoom_shared, f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, shared cores: one step of each schedule",
           "one_step_shared.png")

# %% [markdown]
# 共核时，串行的每一段都能用两个核；但两个线程对这种搬内存的活帮助有限（第 4 章 4.4 节：1.16 倍），串行的一步并没有快多少。
# 要点在重叠那一行：Adam 与反向同时要这两个核，对照上表，重叠时的反向和 Adam 都比串行时长。串行时没有哪个核闲着，
# 重叠只能把一段的核换给另一段，省下的只有串行时**闲着**的那部分资源（这里几乎没有）。
# 分核时，反向期间至少主机那个核是闲的，重叠才有东西可省；但两个核仍共用内存带宽。
# 真机上 GPU 和 CPU 是两块芯片，各有各的内存（HBM 与 DDR），这种互相拖慢要小得多；分核是这台机器上对它最接近的模拟，
# 但内存带宽仍是共用的。`make bench` 在分核与共核两种设置下都报告重叠对串行的比值。
#
# ### 2.3 同一件事放到一张真 GPU 上
#
# 模拟设备的"GPU"是一个 CPU 核，矩阵乘每秒几十 GFLOP；一张 A100 是几百 TFLOP。同样的 Adam，放在真机上就占了一步的大头。
# 用第 4 课的性能模型（`zo plan` 背后的 `perfmodel`）看 13B、一张 A100-80GB、stage 2 + 卸载优化器、激活重计算：
# 串行是各段之和，完全重叠（重叠流水线 + DPU 的理想情况）是最忙的那一段。

# %%
A100 = replace(perfmodel.PRESETS["a100-80g"], gpus=1)
print("13B, one A100-80GB, stage 2 + offload_optimizer, activation checkpointing, 1024 tokens a sequence (model, not measured)\n")
print(f"{'batch':>5}{'GPU s':>8}{'PCIe down s':>13}{'PCIe up s':>11}{'CPU Adam s':>12}{'serial s':>10}{'overlapped s':>14}"
      f"{'serial / overlapped':>21}{'bottleneck':>12}")
for batch in (1, 2, 4, 8, 16, 64):
    t = perfmodel.plan(A100, perfmodel.Workload(13_000_000_000, batch=batch, recompute=True), 2, "optimizer").time
    print(f"{batch:>5}{t.compute:>8.2f}{t.pcie_down:>13.2f}{t.pcie_up:>11.2f}{t.cpu_adam:>12.2f}{t.serial:>10.2f}"
          f"{t.overlapped:>14.2f}{t.serial / t.overlapped:>20.2f}x{t.bottleneck:>12}")

# %% [markdown]
# 真机上 PCIe 与 CPU Adam 是秒级的，与 GPU 计算同一个量级，重叠能把一步缩短一半以上；批小时（1、2）PCIe 或 CPU 是瓶颈，
# 这时即使完全重叠，一步也不会短于 CPU 那一段：重叠把它藏在计算后面，却不能让它变短（要么加大批，要么部分卸载，第 4 章）。
# 批很大时 GPU 是瓶颈，卸载的代价趋近于零，重叠省下的比例又变小。这台模拟设备上的每个点都在"GPU 是瓶颈"那一端。

# %% [markdown]
# ### 2.4 暂存槽：两个够不够
#
# 梯度分片下行到主机的暂存槽里，槽要等读它的 Adam 做完才能再写；设备上的分片也要等下行读完才能放掉。
# 双缓冲（2 个槽）时，只要主机落后两个单元，反向就停下来等（`_keep_until`：设备上等着下行的分片不超过槽数）。
# 主机的活是一阵一阵来的：大单元（MLP 的两个矩阵）挨着到达时它就落后。同样的设置，只把槽数从 4 改回 2：

# %%
two_slots = compare_schedules(S_MODEL, batch=1, seq_len=S_SEQ, steps=S_STEPS, rounds=S_ROUNDS, cores="split", slots=2)
print(f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores; median ms per step\n")
print(f"{'staging slots':<15}{'serial':>9}{'overlapped':>12}{'DPU':>8}{'overlapped vs serial':>22}")
for label, r in (("4", split), ("2", two_slots)):
    ms = r["median_ms"]
    print(f"{label:<15}{ms['serial']:>9.1f}{ms['overlapped']:>12.1f}{ms['delayed (DPU)']:>8.1f}"
          f"{r['overlapped_vs_serial']:>21.2f}x")

# %% [markdown]
# 多两个槽的代价：主机多两块最大单元大小的锁页缓冲，设备上最多多留两个梯度分片（这里各几 MB）；换来的是主机一时落后时反向不必停。
# 串行一列不受槽数影响（它不走流水线），两次之间它的差别就是计时起伏的大小；所以比较的是各自那一次里的"重叠/串行"。

# %% [markdown]
# ## 3. 重叠只改变"什么时候"，不改变"算什么"
#
# 流水线把同样的运算换了个时间做：同样的梯度、同样的 Adam、同样的舍入。所以它与串行必须**逐位**相同。
# 两种情形：fp32、不裁剪（Adam 在反向期间就开始，单元一个接一个）；fp16 + 梯度裁剪（要先有全局范数，Adam 只能等到反向之后）。

# %%
BIT_MODEL, BIT_STEPS = ("nano", 3) if SMOKE else ("tiny", 6)
BIT_BUCKET = 50_000  # several buckets even in these small models: the first unit's gradient leaves early


def train_engine(config: dict | None, model: str, steps: int, *, batch: int, engine=None):
    """Train `steps` steps of TinyGPT(model) with `config` (or go on with `engine`); the engine and the losses."""
    engine = engine or zo.initialize(TinyGPT(model, seed=0), config, accelerator=EmulatedAccelerator())
    data = ByteBatches(CORPUS, gpt_config(model).seq_len, seed=0)
    losses = []
    for _ in range(steps):
        x, y = data.global_batch(engine.global_steps, batch)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def weights(engine) -> dict:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


for label, kwargs in (("fp32, no clipping", {}), ("fp16, clipping 1.0", {"precision": "fp16", "clip": 1.0})):
    runs = {overlap: train_engine(offload_config(batch=4, overlap=overlap, bucket=BIT_BUCKET, **kwargs), BIT_MODEL,
                                  BIT_STEPS, batch=4)
            for overlap in (False, True)}
    (serial_engine, serial_losses), (overlap_engine, overlap_losses) = runs[False], runs[True]
    pcie = [dict(e.states.transfers.bytes) for e in (serial_engine, overlap_engine)]
    print(f"{label}: TinyGPT('{BIT_MODEL}'), {BIT_STEPS} steps")
    print(f"  losses equal: {serial_losses == overlap_losses}; every weight bit-identical (torch.equal): "
          f"{same_weights(weights(serial_engine), weights(overlap_engine))}")
    print(f"  bytes over the link, serial {pcie[0]}, overlapped {pcie[1]}")
    adam = [s for s in overlap_engine.timeline()[0] if s.step == BIT_STEPS - 1 and s.stage == "Adam"]
    backward = [s for s in overlap_engine.timeline()[0] if s.step == BIT_STEPS - 1 and s.stage == "backward"][0]
    print(f"  overlapped, last step: {len(adam)} Adam calls (one a unit), the first {1e3 * (adam[0].start - backward.end):+.1f} ms "
          "from the end of backward\n")

# %% [markdown]
# 两种情形都逐位相同，链路上的字节也一样，只是走得更早。最后一行看出差别：不裁剪时第一个单元的 Adam 在反向结束**之前**
# 就开始了（负数）；要裁剪时每个单元都要等全局范数，Adam 在反向之后才开始（正数），但下行仍然与反向重叠，
# 上行与后面单元的 Adam 重叠。fp16 时还要先检查溢出，道理相同。
# 实验 5.1、5.2 的评分测试用的就是这种"与串行逐位相同"的对照，还用"闸门"和"扣住一条队列、等另一条做完能做的"让一个漏掉的等待每次都读到错的数据。

# %% [markdown]
# ## 4. 延迟参数更新：晚一步的梯度，代价是多少
#
# DPU 的第 t+1 步在上一步的权重上算梯度：w(t+2) = Adam(w(t+1), g(w(t)))。前 `start_step` 步照常同步，
# 因为训练刚开始时更新大、晚一步的梯度伤害最大（论文在几十步之后才打开 DPU）。
# 在 tiny GPT 上训练几百步：不用 DPU、从第 10 步起用、从第 100 步起用，三条 loss 曲线放在一起；最后在 8 个留出批次上评估。

# %%
DPU_MODEL, DPU_STEPS, DPU_BATCH = ("nano", 24, 8) if SMOKE else ("tiny", 300, 8)
DPU_STARTS = (None, 10) if SMOKE else (None, 10, 100)
held_out = ByteBatches(CORPUS, gpt_config(DPU_MODEL).seq_len, seed=0, split="val")


@torch.no_grad()
def evaluate(engine, batches: int = 8) -> float:
    return statistics.mean(lm_loss(engine(x), y).item() for x, y in (held_out.global_batch(i, DPU_BATCH) for i in range(batches)))


dpu_runs = {}
for start in DPU_STARTS:
    label = "no DPU" if start is None else f"DPU from step {start}"
    config = offload_config(batch=DPU_BATCH, overlap=True, dpu_start=start)
    config["zero_offload"]["cpu_adam"]["threads"] = 1
    started = time.perf_counter()
    engine, losses = train_engine(config, DPU_MODEL, DPU_STEPS, batch=DPU_BATCH)
    seconds = time.perf_counter() - started
    engine.synchronize()  # the last update is still in flight: land it before reading the weights
    dpu_runs[label] = {"start": start, "losses": losses, "eval": evaluate(engine), "seconds": seconds}

plain = dpu_runs["no DPU"]["losses"]
print(f"TinyGPT('{DPU_MODEL}'), batch {DPU_BATCH}, AdamW lr 1e-3, overlapped, {DPU_STEPS} steps\n")
print(f"{'run':<20}{'first differing step':>22}{'mean loss, last 50':>20}{'held-out loss':>15}{'wall s':>8}")
for label, r in dpu_runs.items():
    differ = next((i for i, (a, b) in enumerate(zip(r["losses"], plain, strict=True)) if a != b), None)
    print(f"{label:<20}{'-' if differ is None else differ:>22}{statistics.mean(r['losses'][-50:]):>20.4f}"
          f"{r['eval']:>15.4f}{r['seconds']:>8.1f}")
for label, r in dpu_runs.items():
    if r["start"] is not None:
        s = r["start"]
        same = r["losses"][: s + 1] == plain[: s + 1]
        print(f"{label}: losses of steps 0..{s} identical to no DPU: {same}; step {s + 1}: "
              f"{r['losses'][s + 1]:.6f} against {plain[s + 1]:.6f}")

# %%
def smooth(values, window: int = 10) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
window = 5 if SMOKE else 10
for (label, r), color in zip(dpu_runs.items(), ("black", "tab:red", "tab:blue"), strict=False):
    steps = np.arange(len(r["losses"]))
    ax1.plot(steps, r["losses"], color=color, alpha=0.2, linewidth=0.8)
    ax1.plot(steps[window - 1:], smooth(r["losses"], window), color=color, label=label)
    if r["start"] is not None:
        ax1.axvline(r["start"], color=color, linestyle=":", linewidth=1)
        ax2.plot(steps[window - 1:], smooth(np.array(r["losses"]) - np.array(plain), window), color=color, label=label)
ax1.set_xlabel("step")
ax1.set_ylabel(plots.LOSS_LABEL)
ax1.set_title(f"TinyGPT('{DPU_MODEL}'): training loss ({window}-step mean; raw faint)")
ax1.legend(fontsize=8)
ax2.axhline(0, color="black", linewidth=1)
ax2.set_xlabel("step")
ax2.set_ylabel("loss with DPU - loss without")
ax2.set_title(f"The cost of a one-step-stale gradient ({window}-step mean)")
ax2.legend(fontsize=8)
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
show(fig, "dpu_loss.png")

# %% [markdown]
# - 到 `start_step` 为止（含第 `start_step` 步），三条曲线逐位相同：那几步的前向用的是同一份权重；从第 `start_step` + 1 步起，
#   前向看到的权重晚一次更新，loss 开始不同；
# - 晚一步不是"差一点点"：在这个 0.8M 参数的小模型上、学习率 1e-3、几百步之内，DPU 的 loss 明显落在后面；
#   越早打开，落后越多；从第 100 步起打开时，曲线在打开之后先往上抬了一段，再继续下降。
#   一个合理的解释是：Adam 的学习率让训练贴着稳定性的边缘走，而晚一步的梯度相当于一个延迟的反馈，让同样的学习率更容易来回振荡。
#   笔记本没有把原因拆开；能确定的是，这里测到的代价不是舍入误差的量级；
# - DPU 换来的是时间：CPU 的 Adam 从关键路径上拿掉了（第 1 节的时间线）。在这台机器上 Adam 只占一步的一小部分，
#   这笔交易不划算；在 2.3 节那种 CPU 是瓶颈的真机配置上，它能把一步缩短到 max(GPU, CPU)。
#
# 落后这么多，会不会是引擎算错了？用纯 PyTorch 写一个"晚一步"的参照（`torch.optim.AdamW`，与 `tests/test_pipeline.py` 里的写法相同）：
# 每一步先把模型换成"前向该看到的"那份权重算梯度，再换回当前的权重，让 AdamW 用这个梯度更新。

# %%
def stale_reference(start: int, steps: int) -> list[float]:
    """Plain torch: the gradient of step t is taken on the weights before the last update once t > start."""
    model = TinyGPT(DPU_MODEL, seed=0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    data = ByteBatches(CORPUS, gpt_config(DPU_MODEL).seq_len, seed=0)
    visible, losses = [p.detach().clone() for p in params], []
    for step in range(steps):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, visible, strict=True):
                p.copy_(v)
        x, y = data.global_batch(step, DPU_BATCH)
        loss = lm_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, c in zip(params, current, strict=True):
                p.copy_(c)
        optimizer.step()
        visible = [p.detach().clone() for p in params] if step + 1 <= start else current
    return losses


ours = dpu_runs["DPU from step 10"]["losses"]
reference_losses = stale_reference(10, DPU_STEPS)
print(f"DPU from step 10, {DPU_STEPS} steps: the engine (C Adam) against plain torch with a one-step-stale gradient")
print(f"  mean loss of the last 50 steps: engine {statistics.mean(ours[-50:]):.4f}, "
      f"reference {statistics.mean(reference_losses[-50:]):.4f}")
print(f"  largest |loss difference| over all steps: {max(abs(a - b) for a, b in zip(ours, reference_losses, strict=True)):.1e}")

# %% [markdown]
# 两者只差在浮点舍入上（引擎用的是第 4 章的 C Adam，FMA 只舍入一次）：落后是"晚一步的梯度"本身的代价。
# 论文说 DPU 在几十步之后打开对收敛没有影响，那是在大模型、带预热的学习率、上万步的训练上；在你的模型上，打开前先这样量一次。

# %% [markdown]
# ## 5. NVMe 层：优化器状态放进文件
#
# `"offload_optimizer": {"device": "nvme", "nvme_path": DIR, "buffer_count": B}` 把 fp32 主权重、m、v（每参数 12 字节）
# 放进 `DIR/zero_offload_rank<R>/` 下的文件，每个**子组**（按模型顺序把整个单元装到 `sub_group_size` 个元素为止）三个文件。
# 主机上只留 fp32 梯度分区、上行的中转缓冲，以及 B 个子组大小的槽。一步里，读线程提前把后面的子组读进槽里，主线程对当前子组做 Adam，
# 写线程把做完的子组写到旁边的临时文件里、刷到盘上（fsync）。所有 rank 都写完所有子组之后，临时文件才一起改名替换旧文件。
#
# 同一个模型、同样的数据，CPU 层与 B = 1、2、4 的 NVMe 层交替各训练几步：

# %%
NV_MODEL, NV_STEPS, NV_SUB_GROUP = ("nano", 3, 20_000) if SMOKE else ("small", 6, 1_000_000)
NV_BATCH = 2
nvme_root = Path(tempfile.mkdtemp(prefix="zo-nvme-"))  # on this machine's disk; a real run names its NVMe drive


def nvme_config(tier: str, buffers: int = 4) -> dict:
    offload = {"device": "cpu"}
    if tier == "nvme":
        offload = {"device": "nvme", "nvme_path": str(nvme_root / f"buffers{buffers}"), "buffer_count": buffers}
    return {
        "train_batch_size": NV_BATCH,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": offload, "sub_group_size": NV_SUB_GROUP},
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1}},
    }


tiers = {"CPU tier": nvme_config("cpu")} | {f"NVMe, {b} buffer(s)": nvme_config("nvme", b) for b in (1, 2, 4)}
nv_engines = {name: zo.initialize(TinyGPT(NV_MODEL, seed=0), cfg, accelerator=EmulatedAccelerator())
              for name, cfg in tiers.items()}
nv_data = ByteBatches(CORPUS, gpt_config(NV_MODEL).seq_len, seed=0)
nv_ms = {name: [] for name in nv_engines}
for _ in range(NV_STEPS):  # one step of each tier in turn
    for name, engine in nv_engines.items():
        x, y = nv_data.global_batch(engine.global_steps, NV_BATCH)
        started = time.perf_counter()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        nv_ms[name].append((time.perf_counter() - started) * 1e3)

cpu_engine = nv_engines["CPU tier"]
reference = weights(cpu_engine)
n_params = cpu_engine.num_params
print(f"TinyGPT('{NV_MODEL}'): {n_params:,} parameters, fp16, stage 2, sub_group_size {NV_SUB_GROUP:,}, "
      f"{NV_STEPS} steps each, interleaved\n")
print(f"{'tier':<20}{'sub-groups':>11}{'host':>12}{'nvme':>12}{'staging':>11}{'files':>7}{'on disk':>12}"
      f"{'ms/step':>9}{'Adam + I/O ms':>15}{'same weights':>14}")
for name, engine in nv_engines.items():
    report, states = engine.memory_report(), engine.states
    files = sorted(states.files.dir.iterdir()) if hasattr(states, "files") else []
    on_disk = sum(f.stat().st_size for f in files)
    groups = len(states.groups) if hasattr(states, "groups") else "-"
    print(f"{name:<20}{groups:>11}{format_bytes(report.measured.host):>12}{format_bytes(report.measured.nvme):>12}"
          f"{format_bytes(report.host_staging):>11}{len(files):>7}{format_bytes(on_disk):>12}"
          f"{statistics.median(nv_ms[name][1:]):>9.1f}"
          f"{statistics.median(h['adam_seconds'] for h in engine.history[1:]) * 1e3:>15.1f}"
          f"{str(same_weights(weights(engine), reference)):>14}")
nv4 = nv_engines["NVMe, 4 buffer(s)"]
print(f"\nfiles of {nv4.states.files.dir.relative_to(nvme_root)}: "
      + ", ".join(f"{f.name} ({format_bytes(f.stat().st_size)})" for f in sorted(nv4.states.files.dir.iterdir())[:6]) + ", ...")
print("\nengine.memory_report() of the NVMe tier with 4 buffers:")
print(nv4.memory_report())

# %% [markdown]
# - 12 字节/参数的主权重、m、v 都到了 NVMe 一列，磁盘上的文件正好是这么多字节（每个子组 3 个文件）；
#   主机上剩下 fp32 梯度分区（4 字节/参数）和 B 个槽（每个槽 12 字节 × 最大的子组）。槽越少，主机越省；
# - 每个权重都与 CPU 层逐位相同（`same weights`）：同样的 Adam，在同样的张量上，一个单元一次调用，只是状态从文件里来、回到文件里去；
# - 代价是时间：每步要把全部状态读一遍、写一遍（2 × 12 字节/参数），写还要 fsync 到盘上。这台虚拟机的"盘"是一块虚拟磁盘；
#   `Adam + I/O` 一列是引擎记的每步 Adam 加上等读写的时间（中位数）。读其实很快：文件上一步刚写过，还在操作系统的页缓存里；
#   慢的是写，fsync 要等数据真的落盘。槽多了，读可以提前、写可以滞后，但盘的写入带宽是上限：
#   每步的时间由它决定时，B 再大也没用。真的 NVMe 盘每秒几 GB，状态大到页缓存装不下时，读也要真的去盘上取。
#
# 一步的时间线（`NVMe read`、`Adam`、`NVMe write` 三条泳道）：

# %%
last = nv4.global_steps - 1
nv_spans = [s for s in nv4.timeline()[0] if s.step == last]
display(Image(filename=str(plot_timeline([nv_spans], OUT / "nvme_timeline.png",
                                         title=f"NVMe tier, 4 buffers: step {last} of TinyGPT('{NV_MODEL}')"))))

# %% [markdown]
# ### 磁盘满了会怎样
#
# 一步里任何一次读写失败，所有 rank 都不替换任何文件：临时文件删掉，Adam 的步数退回，上行缓冲从文件里重新舍入，
# 这一步在每个 rank 上都抛出 `NVMeError`。下面让 2 个槽的那个引擎在第三个子组的写入时遇到"磁盘已满"（ENOSPC），
# 其余照常：

# %%
nv2 = nv_engines["NVMe, 2 buffer(s)"]
files = nv2.states.files
failing_group = min(2, len(nv2.states.groups) - 1)  # the third sub-group: two are written by then


def full_at_the_third_group(group, state, data):
    if group == failing_group and state == "master":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(files.path(group, state)))
    return SwapFiles.write(files, group, state, data)


files.write = full_at_the_third_group  # this engine's files only
steps_before = nv2.global_steps
try:
    train_engine(None, NV_MODEL, 1, batch=NV_BATCH, engine=nv2)
except NVMeError as err:
    message = str(err).replace(str(nvme_root), "<nvme_path>")
    print("NVMeError:\n" + textwrap.fill(message, 116, subsequent_indent="  "))
del files.write  # the class's write again
print(f"\nglobal_steps {steps_before} -> {nv2.global_steps}; weights still those of the CPU tier at step "
      f"{cpu_engine.global_steps}: {same_weights(weights(nv2), reference)}; temporary files left: "
      f"{len([p for p in files.dir.iterdir() if p.name.endswith('.tmp')])}")
nv2.zero_grad()  # drop the gradients of the step that was not taken, then train on
for engine in (nv2, cpu_engine):
    train_engine(None, NV_MODEL, 1, batch=NV_BATCH, engine=engine)
print(f"after one more step on each: the same weights as the CPU tier: {same_weights(weights(nv2), weights(cpu_engine))}")
shutil.rmtree(nvme_root)
del nv_engines, nv2, nv4, cpu_engine

# %% [markdown]
# 失败的那一步没有发生：步数没动，文件和设备上的权重都还是上一步的，没有留下临时文件；`engine.zero_grad()` 丢掉那一步的梯度，
# 腾出空间后接着训练，结果与从没出过错一样。`initialize` 还会先检查 `nvme_path` 可写、放得下两倍的状态（每个文件在替换前有两份），
# 放不下就在第 0 步报错，说明要多少字节、有多少。进程被杀掉呢？这些文件不是检查点：下一次 `initialize` 清掉留下的临时文件，
# 用模型的权重把所有文件重写一遍。断点续训靠的是检查点（第 7 节），NVMe 层与 CPU 层的检查点可以互相加载。

# %% [markdown]
# ## 6. 一个设备预算下能训练多大的模型
#
# ZeRO-Offload 论文的标题数字：一张 32 GB 的 V100 上训练 130 亿参数，而 PyTorch 只能到 14 亿，约 10 倍。
# 这里的设备是模拟的，预算 512 MB（`largest.py`）：
#
# - **不卸载**：stage 0、bf16，设备上每参数 16 字节（权重、梯度、fp32 主权重、m、v）加激活值；
#   固定 8 层、批 1 × 32，对宽度（64 的倍数）二分，找出能训练一步的最宽模型；
# - **卸载**：stage 3 + `offload_param` + `offload_optimizer`，设备上一次只留大约一层的权重；限制模型的是主机内存。

# %%
BUDGET = 64 * MIB if SMOKE else 512 * MIB
LAYERS = 2 if SMOKE else 8
OFFLOAD_MODEL = "small" if SMOKE else "100m"
started = time.perf_counter()
alone = largest_without_offload(BUDGET, n_layer=LAYERS)
alone_s = time.perf_counter() - started
print(f"device budget {format_bytes(BUDGET)}; without offload (stage 0, bf16, {LAYERS} layers, batch 1 x 32):")
print(f"  largest that trains: d_model {alone['d_model']}, {alone['params']:,} parameters, device peak "
      f"{format_bytes(alone['device_peak'])} (bisection took {alone_s:.0f} s)")
print("  the next width (+64):\n" + textwrap.fill(alone["next_oom"], 116, initial_indent="    ", subsequent_indent="    "))
offloaded = offloaded_run(OFFLOAD_MODEL, budget=BUDGET, steps=3)
print(f"\nwith stage 3 + offload_param + offload_optimizer: TinyGPT('{OFFLOAD_MODEL}'), {offloaded['params']:,} parameters")
print(f"  3 steps in {offloaded['seconds']:.1f} s, losses {', '.join(f'{v:.3f}' for v in offloaded['losses'])}; "
      f"device peak {format_bytes(offloaded['device_peak'])} of {format_bytes(BUDGET)}; host {format_bytes(offloaded['host_bytes'])} "
      f"({offloaded['host_bytes'] / offloaded['params']:.1f} bytes a parameter)")
print(f"  {offloaded['params'] / alone['params']:.1f}x the parameters of the largest model without offload")

# %% [markdown]
# 卸载之后，设备上的峰值与模型大小关系不大（一层的权重、梯度桶、激活值），限制模型的是主机内存。
# 笔记本只训练了一个不大的模型，免得占满这台机器的内存；`1b` 预设（10 亿参数）要多少，用估算器算：

# %%
P1B = gpt_config("1b").num_params()
P13B = 13_000_000_000
available = host_memory_available()
total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
print(f"{'model':<24}{'configuration':<34}{'device':>11}{'host':>11}  (model states, one rank)")
for label, params in ((f"'1b' ({P1B / 1e9:.2f}B)", P1B), ("13B", P13B)):
    for conf, kwargs in (("stage 0, bf16", dict(stage=0)),
                         ("stage 3 + both offloads, bf16", dict(stage=3, offload_optimizer="cpu", offload_param="cpu"))):
        est = estimate_model_states(params, world_size=1, precision="bf16", **kwargs)
        print(f"{label:<24}{conf:<34}{format_gb(est.device):>11}{format_gb(est.host):>11}")
one_b = estimate_model_states(P1B, stage=3, world_size=1, offload_optimizer="cpu", offload_param="cpu", precision="bf16")
need_1b = one_b.host + 2 * P1B  # + the bf16 model the engine copies its weights from, as offloaded_run checks
host_limit = 0.9 * total / (need_1b / P1B)  # 10% left for the system, as zo plan leaves it
print(f"\ntraining '1b' with offload needs about {format_gb(need_1b)} of host memory "
      f"({need_1b / P1B:.0f} bytes a parameter); this machine has {format_gb(total)} "
      f"({format_gb(available)} available at this moment)")
print(f"largest model 90% of this host could hold at that rate: about {host_limit / 1e9:.2f}B parameters, "
      f"{host_limit / alone['params']:.0f}x the largest without offload")

# %% [markdown]
# 每参数 18 字节在主机上（bf16 权重 2、fp32 梯度分区 4、主权重 4、m 4、v 4），再加引擎初始化时复制权重用的那份 bf16 模型 2 字节，
# 正好落在导言"16～20 字节/参数"的范围里。`1b` 要 20 GB 左右的主机内存：笔记本不跑它，`make demo` 和 `make bench` 会真的训练它几步。
#
# 论文的数字用第 4 课的性能模型也能对照：一张 V100-32GB（`v100-32g` 预设），批 1 × 1024、激活重计算，
# 不卸载时设备放 16 字节/参数，卸载后放 2 字节/参数的 fp16 权重加激活值和梯度桶。对参数量二分：

# %%
V100 = replace(perfmodel.PRESETS["v100-32g"], gpus=1)


def largest_fitting(stage: int, offload: str) -> int:
    low, high = 10**8, 10**12  # parameters: the first fits, the second does not
    while high - low > 10**7:
        mid = (low + high) // 2
        fits = perfmodel.plan(V100, perfmodel.Workload(mid, batch=1, recompute=True), stage, offload).fits
        low, high = (mid, high) if fits else (low, mid)
    return low


v100_plain, v100_offload = largest_fitting(0, "none"), largest_fitting(2, "optimizer")
print(f"one V100-32GB ({format_gb(V100.gpu_memory)}), batch 1 x 1024, activation checkpointing (model):")
print(f"  without offload (stage 0):        {v100_plain / 1e9:5.1f}B parameters   (the paper measured 1.4B with PyTorch)")
print(f"  stage 2 + offload_optimizer:      {v100_offload / 1e9:5.1f}B parameters   (the paper trained 13B)")
print(f"  ratio {v100_offload / v100_plain:.1f}x; with offload the host needs "
      f"{format_gb(perfmodel.plan(V100, perfmodel.Workload(v100_offload, recompute=True), 2, 'optimizer').host_bytes)}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
bars = {"no offload\n(measured)": alone["params"], f"offload, '{OFFLOAD_MODEL}'\n(measured)": offloaded["params"],
        "offload, '1b'\n(not run here)": P1B, "host limit\n(estimate)": host_limit}
ax1.bar(range(len(bars)), list(bars.values()), color=["tab:red", "tab:blue", "tab:blue", "lightgray"])
for i, v in enumerate(bars.values()):
    ax1.text(i, v, f"{v / 1e6:,.0f}M", ha="center", va="bottom", fontsize=8)
ax1.set_xticks(range(len(bars)), list(bars), fontsize=8)
ax1.set_yscale("log")
ax1.set_ylabel("parameters")
ax1.set_title(f"Emulated device, {format_bytes(BUDGET)} budget")
v100_bars = {"no offload": v100_plain, "stage 2 + offload": v100_offload}
ax2.bar(range(2), [v / 1e9 for v in v100_bars.values()], color=["tab:red", "tab:blue"], label="performance model")
ax2.scatter(range(2), [1.4, 13], color="black", marker="D", zorder=3, label="ZeRO-Offload paper")
ax2.set_xticks(range(2), list(v100_bars))
ax2.set_ylabel("billions of parameters")
ax2.set_title("One V100-32GB, batch 1 x 1024, recompute")
ax2.legend(fontsize=8)
show(fig, "largest_model.png")

# %% [markdown]
# 性能模型给出的不卸载上限比论文的 1.4B 高：模型不计 PyTorch 的工作区、内存碎片和 CUDA 上下文，论文的 PyTorch 实测还带着它们；
# 卸载后的上限与论文的 13B 相符。比值取决于设备与主机的容量之比：这里的模拟设备只有 512 MB、主机有二十几 GB，
# 所以比值远大于 10 倍；论文那台机器的 V100 有 32 GB。

# %% [markdown]
# ## 7. `zo train`：多个节点、断点续训、丢了一个 rank
#
# `zo train` 是引擎自带的训练脚本：每个 rank 取全局批次中属于自己的那几行，定期在留出的文本上评估、存检查点，
# `--resume` 从最新的完整检查点接着训练，rank 0 写报告和图。命令行（`--out` 在多台机器上必须是共享目录）：

# %%
MN_CONFIG = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
    "zero_offload": {"overlap_offload": True},
}
run_root = OUT / "runs"
shutil.rmtree(run_root, ignore_errors=True)  # zo train refuses an --out holding an earlier run's checkpoints
run_root.mkdir(parents=True)
mn_config = run_root / "ds_config.json"
mn_config.write_text(json.dumps(MN_CONFIG, indent=2), encoding="utf-8")
print(textwrap.dedent("""\
    # one process
    zo train --config ds_config.json --model tiny --steps 200 --eval-every 50 --save-every 50 --out out/train
    zo train --config ds_config.json --model tiny --steps 300 --save-every 50 --out out/train --resume
    # one node, 2 ranks
    torchrun --nproc_per_node 2 -m zero_offload.cli train --config ds_config.json --out out/train
    # two nodes, one rank each: run on machine 0 and, with --node_rank 1, on machine 1
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr HOST0 --master_port 29500 \\
             -m zero_offload.cli train --config ds_config.json --out /shared/out/train
    # the same two "nodes" on this machine, meeting on 127.0.0.1 (make train-multinode)
    python tools/multinode.py --nodes 2 -- --model tiny --steps 60 --out out/train-multinode"""))

# %% [markdown]
# ### 7.1 断点续训（一个进程）
#
# 同一个配置训练 6 步；另一次训练 3 步、存检查点，再 `--resume` 到第 6 步。批次只取决于步数，检查点恢复其余的一切
# （权重、m、v、步数、损失缩放、学习率调度），所以两次的 loss 应当逐位相同：

# %%
def zo_train(*args: str) -> int:
    """`zo train ARGS` in this process, its progress bars and report kept out of the notebook; the exit code."""
    with contextlib.redirect_stdout(io.StringIO()) as said, contextlib.redirect_stderr(io.StringIO()):
        code = zo_cli(["train", *args])
    if code != 0:
        print(said.getvalue()[-3000:])
    for line in said.getvalue().splitlines():
        if line.startswith(("resumed from", "step ")):
            print(line.replace(str(ROOT) + "/", ""))
    return code


RESUME_MODEL = "nano"
straight_dir, split_dir = run_root / "resume-straight", run_root / "resume-split"
common = ["--config", str(mn_config), "--model", RESUME_MODEL, "--eval-every", "3", "--eval-batches", "2"]
codes = [zo_train(*common, "--steps", "6", "--out", str(straight_dir)),
         zo_train(*common, "--steps", "3", "--save-every", "3", "--out", str(split_dir)),
         zo_train(*common, "--steps", "6", "--save-every", "3", "--out", str(split_dir), "--resume")]
straight, resumed = (json.loads((d / "summary.json").read_text()) for d in (straight_dir, split_dir))
print(f"\nexit codes {codes}; resumed at step {resumed['resumed_at']}; checkpoints {resumed['checkpoints']}")
print(f"losses identical: {resumed['losses'] == straight['losses']}; eval losses identical: "
      f"{resumed['eval_losses'] == straight['eval_losses']}")

# %% [markdown]
# ### 7.2 两个"节点"
#
# `tools/multinode.py` 在这台机器上起两个 `torchrun` 代理，各带一个 rank，`--node_rank` 0 和 1，在 127.0.0.1 上会合，
# 就像两台机器各运行一遍上面那条命令。每个 rank 拿一半的全局批次，梯度归约之后与一个进程训练整个批次是同一件事
# （只差加法的顺序），所以 loss 应当与一个进程的几乎相同：

# %%
def multinode(out: Path, *train_args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "tools" / "multinode.py"), "--nodes", "2", "--grace", "20", "--",
               "--config", str(mn_config), "--model", "tiny", "--out", str(out), *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


MN_STEPS = 12
if SMOKE:
    print("smoke mode: skipped (two torchrun agents take half a minute to start)")
else:
    two_dir, one_dir = run_root / "two-nodes", run_root / "one-process"
    started = time.perf_counter()
    run = multinode(two_dir, "--steps", str(MN_STEPS), "--eval-every", "6", "--save-every", "4")
    mn_wall = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"two nodes failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    zo_train("--config", str(mn_config), "--model", "tiny", "--steps", str(MN_STEPS), "--eval-every", "6",
             "--out", str(one_dir))
    two, one = (json.loads((d / "summary.json").read_text()) for d in (two_dir, one_dir))
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"], strict=True))
    print(f"\ntwo nodes: world size {two['world_size']}, nodes {two['nodes']}, {two['steps']} steps in {mn_wall:.0f} s "
          f"wall (start-up included), {two['ms_per_step']:.0f} ms a step; one process: {one['ms_per_step']:.0f} ms a step")
    print(f"loss {two['losses'][0]:.4f} -> {two['losses'][-1]:.4f}; largest relative difference from one process: {rel:.1e}")
    print(f"eval losses, two nodes: {[round(e['loss'], 4) for e in two['eval_losses']]}; one process: "
          f"{[round(e['loss'], 4) for e in one['eval_losses']]}")
    print(f"reduce-scatter moved {two['traffic_elements'].get('reduce_scatter', 0):,} elements a rank; "
          f"PCIe (this rank): {two['pcie_bytes']}")
    for name in ("timeline.png", "loss.png"):
        target = OUT / f"two_nodes_{name}"
        shutil.copyfile(two_dir / name, target)
        display(Image(filename=str(target)))

# %% [markdown]
# 时间线上是两个 rank 各自的泳道：两边的前向、反向几乎同时开始，归约（`reduce`）把两边连在一起。
# 两个进程挤在这台 2 核机器上，每步比一个进程还慢；在真的两台机器上，每台做一半的计算。
#
# ### 7.3 杀掉一个 rank
#
# 同样的两个节点，训练很多步、每 4 步存一次检查点；第一个检查点出现后，用 `SIGKILL` 杀掉节点 1 上的那个 rank
# （不是它的 torchrun 代理），看节点 0 上的 rank 说什么，再按它说的 `--resume`：

# %%
def kill_one_rank(out: Path, log_dir: Path):
    """Start two nodes; once a checkpoint exists, SIGKILL node 1's rank; return node 0's log and how long it took."""
    with socket.socket() as sock:  # a free port for the rendezvous, on loopback only
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    args = ["--config", str(mn_config), "--model", "tiny", "--steps", "100000", "--save-every", "4",
            "--timeout", "60", "--out", str(out)]
    logs = [log_dir / f"node{node}.log" for node in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                               "-m", "zero_offload.cli", "train", *args],
                              stdout=logs[node].open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for node in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while newest_complete(out) is None:
            if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                raise RuntimeError("no checkpoint appeared:\n" + logs[0].read_text()[-3000:])
            time.sleep(0.1)
        agent = nodes[1].pid
        (rank1,) = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        os.kill(int(rank1), signal.SIGKILL)
        killed = time.monotonic()
        nodes[0].wait(timeout=120)
        stopped_after = time.monotonic() - killed
        nodes[1].wait(timeout=120)
    finally:
        for node in nodes:  # only the agents started here, each with its own session
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    return logs[0].read_text(), stopped_after, [n.returncode for n in nodes]


if SMOKE or not Path("/proc/self/task").is_dir():
    print("skipped: smoke mode, or no /proc to find the rank to kill")
else:
    killed_dir = run_root / "killed"
    log, stopped_after, codes = kill_one_rank(killed_dir, run_root)
    print(f"node exit codes {codes}; rank 0 stopped {stopped_after:.1f} s after rank 1 was killed (--timeout was 60 s)")
    print("node 0's error:")
    for line in log.splitlines():
        if line.startswith(("error:", "  cause:", "Restart")):
            print(textwrap.fill(line.replace(str(ROOT) + "/", ""), 116, subsequent_indent="    "))
    saved = int(newest_complete(killed_dir).name.removeprefix("step_"))
    run = multinode(killed_dir, "--steps", str(saved + 4), "--save-every", "4", "--resume")
    if run.returncode != 0:
        raise RuntimeError(f"resume failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    after = json.loads((killed_dir / "summary.json").read_text())
    n = min(after["steps"], MN_STEPS)
    print(f"\nresumed on two nodes at step {after['resumed_at']} and trained to step {after['steps']}: losses of steps "
          f"1..{n} identical to the uninterrupted two-node run of 7.2: {after['losses'][:n] == two['losses'][:n]}")

# %% [markdown]
# rank 1 一死，rank 0 的下一个集合通信就失败了：它几秒之内停下，而不是等到 `--timeout`（一个卡住不动的 rank 才要等满它），
# 错误里说明丢在哪一步、从哪个检查点继续。每个节点加上 `--resume` 重新启动，训练从那个检查点接着走，
# 而且在同样的 world size 下，loss 与从没中断过的那次逐位相同。存到一半就被杀掉的检查点不会被当成完整的：
# `meta.json` 最后写，没有它的目录在续训时被删掉。
#
# ## 小结
#
# - 重叠流水线（`overlap_offload`）让每个单元的下行、Adam、上行在反向期间就开始，结果与串行逐位相同；
#   它最多能省下串行时反向之后的那条尾巴（Adam + 上行）。DPU 把 Adam 整个挪到下一步的前向、反向期间。
# - 在这台 2 核机器的模拟设备上，那条尾巴只占一步的一小部分，而两段活还共用内存带宽（共核时连核也共用），
#   所以重叠省得很少，甚至不省；在真 GPU 上，PCIe 和 CPU Adam 与计算是同一个量级，重叠和 DPU 才值钱。
# - DPU 用晚一步的梯度；在这里的小模型上，它的 loss 明显落后，打开前要在你的模型上量一次。
# - NVMe 层把 12 字节/参数挪进文件，与 CPU 层逐位相同，代价是每步把状态读写一遍；磁盘满时那一步不发生，文件停在上一步。
# - 卸载让模型大小不再受设备限制，而受主机内存限制（约 18～20 字节/参数）。
# - `zo train`：多节点、评估、检查点、`--resume`；丢了一个 rank，整个作业立即停下并告诉你从哪里继续。
#
# ## 接下来：实验 5 与演示
#
# 在仓库根目录运行 `make lab5` 为实验 5 评分（`make lab5 LAB_DIR=solutions` 看参考答案）：
#
# | 任务 | 内容 | 位置 |
# |---|---|---|
# | Lab 5.1 | 双缓冲的桶调度：取槽、在拷贝流上下行、主机队列等拷贝、累加、还槽、（eager 时）Adam 与上行 | `practice/pipeline.py` `OffloadPipeline.deliver` |
# | Lab 5.2 | 一个槽只有在最后一个读它的人读完后才能再写 | `practice/pipeline.py` `SlotRing.acquire` |
# | Lab 5.3 | 延迟参数更新：先落地上一步，再对梯度快照发起这一步的 Adam | `practice/dpu.py` `DelayedUpdate.step` |
#
# `make demo` 是给课堂的端到端演示；`make train-multinode` 跑 7.2 节的两个节点。
#
# ## 练习
#
# 1. 在第 1 节把模型换成 `"10m"`、批 1 × 8。Adam 的份额变大了吗？重叠对串行的比值呢？
# 2. 在第 3 节的 fp32 情形里打开 `gradient_clipping`，看第一个单元的 Adam 离反向结束多远，解释为什么。
# 3. 把第 4 节的学习率降到 5e-4，DPU 的落后变小了吗？把 `start_step` 放到 200 呢？
# 4. 第 5 节里，子组越小，主机上的槽越小；代价是什么？把 `sub_group_size` 改成 200,000 和 4,000,000 各量一次。
# 5. 你的机器有多少主机内存？按第 6 节的每参数字节数，卸载之后最大能训练多大的模型？用 `zo estimate` 核对。
