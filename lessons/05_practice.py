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
import json
import os
import shutil
import statistics
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are for the terminal; child processes inherit this

import torch
from IPython.display import Image, display

from zero_offload import plots
from zero_offload.lessons import practice_dpu, practice_nvme, practice_runs, practice_steps
from zero_offload.lessons.practice_steps import offload_config, weights
from zero_offload.cli.bench.largest import host_memory_available, largest_without_offload, offloaded_run
from zero_offload.cli.train.run_dir import newest_complete
from zero_offload.cli.bench.schedules import compare_schedules, split_cores
from zero_offload.practice.timeline import plot_timeline
from zero_offload.tuning import perfmodel
from zero_offload.tuning.cpuinfo import cpu_model
from zero_offload.units import format_bytes, format_gb
from zero_offload.workloads import gpt_config, load_corpus

# %%
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


print(f"{cpu_model()}, {CORES} cores; torch {torch.__version__}; smoke mode: {SMOKE}")
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
# - `"overlap_offload": true`（`practice/pipeline.py`）：每个单元的梯度一算出来就经**下行流**下行，CPU 的**主机队列**马上累加、
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
# `cli.bench.schedules.compare_schedules` 用同一个模型、同样的数据建三个引擎（stage 2 + `offload_optimizer`、fp32、C Adam），
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
# 这几张图把一步压得太扁。下面用同样的配置再建三个引擎，轮流各跑几步，把**一步**放大，并从时间线里按阶段量出每一步各花了多少（`zero_offload/lessons/practice_steps.py` 的 `zoom`）：
# 前向、反向、CPU 上 Adam 忙了多久（所有 Adam 片段之和），以及反向结束之后设备还要等多久（"反向之后的尾巴"：
# 串行时是 Adam + 上行；重叠时是没藏住的那部分 Adam 与上行；DPU 时是等上一步的 Adam 收尾、发布权重）。
#
# 每个引擎跑完自己那几步就 `engine.synchronize()`：DPU 的最后一次更新若还在主机队列上，就会和下一个引擎的步同时跑，
# 拖慢别人、也让自己的下一步白捡一次"不用等"（`compare_schedules` 也是这样做的）。

# %%
print("the overlapped engine's configuration:", json.dumps(offload_config(overlap=True, cores=split_cores())))
ZOOM_ROUNDS, ZOOM_BLOCK = (2, 3) if SMOKE else (4, 4)  # at most 16 steps an engine: what its timeline keeps
zoom_split = practice_steps.zoom(S_MODEL, S_SEQ, CORPUS, cores="split", rounds=ZOOM_ROUNDS, block=ZOOM_BLOCK)
print(f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores; medians (ms) over "
      f"{zoom_split['serial']['steps']} steps of each schedule\n")
print(practice_steps.format_phases(zoom_split))

# %%
show(practice_steps.draw_steps(zoom_split, f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores: one step of each "
                               "schedule"), "one_step_split.png")

# %% [markdown]
# 读这张图和上面的表：
#
# - **串行**：D2H 的竖条落在反向期间，但它们是在反向自己的线程上一个接一个做的（第 3 模块：每个桶归约完，钩子里就下行、累加），
#   占的是反向的时间；Adam 和 H2D 全在反向之后，设备等着。"反向之后的尾巴"几乎就是 CPU Adam 加上上行；
# - **重叠**：下行、累加、Adam、上行都搬到了主机那个核上（下行走下行流，上行走另一条上行流：上行要等本单元的 Adam，
#   若与下行排在同一条按序执行的流里，下一个单元的下行就得跟着等），在反向还没结束时就开始，尾巴只剩几毫秒。
#   但反向比串行时长（主机上 Adam 片段的总长也与串行时不同：它一个单元一个单元地做，还顺手算了每个单元的梯度范数）：分核只把"算"分开了，
#   两个核共用同一份内存带宽和 L3 缓存，而在批 1 的小批次上，反向和 Adam 都是搬内存的活
#   （第 4 章 4.9 节：这台机器上第二个线程几乎带不来更多带宽）。藏起来的时间，有一部分又以"两边都变慢"的形式还了回来；
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
sweep = {(batch, seq_len): compare_schedules(S_MODEL, batch=batch, seq_len=seq_len, steps=2 if SMOKE else 3,
                                             rounds=2 if SMOKE else 5, cores="split")
         for batch, seq_len in TOKEN_SHAPES}
print(f"TinyGPT('{S_MODEL}'), split cores; median ms per step (interleaved rounds)\n")
print(practice_steps.format_token_sweep(sweep))
adam_ms = zoom_split["serial"]["Adam"]
print(f"\nCPU Adam over the whole partition, serial schedule, batch 1 x {S_SEQ} (section 1): {adam_ms:.1f} ms a step "
      "at every batch size")

# %%
show(practice_steps.plot_token_sweep(sweep, adam_ms, S_MODEL), "step_time_vs_tokens.png")

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
print(practice_steps.format_schedules({"split": split, "shared": shared}, "cores"))
zoom_shared = practice_steps.zoom(S_MODEL, S_SEQ, CORPUS, cores="shared", rounds=ZOOM_ROUNDS, block=ZOOM_BLOCK)
print(f"\nphases with shared cores (ms, medians over {zoom_shared['serial']['steps']} steps):")
print(practice_steps.format_phases(zoom_shared))

# %%
show(practice_steps.draw_steps(zoom_shared, f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, shared cores: one step of "
                               "each schedule"), "one_step_shared.png")

# %% [markdown]
# 共核时，串行的每一段都能用两个核；但两个线程对这种搬内存的活帮助有限（第 4 章 4.9 节），串行的一步并没有因此变快。
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
# 双缓冲（2 个槽）时，只要主机落后两个单元，反向就停下来等（`_hold_until_copied`：设备上等着下行的分片不超过槽数）。
# 主机的活是一阵一阵来的：大单元（MLP 的两个矩阵）挨着到达时它就落后。同样的设置，只把槽数从 4 改回 2：

# %%
two_slots = compare_schedules(S_MODEL, batch=1, seq_len=S_SEQ, steps=S_STEPS, rounds=S_ROUNDS, cores="split", slots=2)
print(f"TinyGPT('{S_MODEL}'), batch 1 x {S_SEQ}, split cores; median ms per step\n")
print(practice_steps.format_schedules({4: split, 2: two_slots}, "staging slots", dpu_ratio=False))

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
for label, kwargs in (("fp32, no clipping", {}), ("fp16, clipping 1.0", {"precision": "fp16", "clip": 1.0})):
    print(f"{label}: TinyGPT('{BIT_MODEL}'), {BIT_STEPS} steps")  # serial and overlapped, batch 4, same data
    print(practice_steps.bit_identity(BIT_MODEL, BIT_STEPS, CORPUS, bucket=BIT_BUCKET, **kwargs))

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
dpu_runs = practice_dpu.dpu_runs(DPU_MODEL, DPU_STEPS, DPU_BATCH, DPU_STARTS, CORPUS)  # overlapped, 1 Adam thread
print(f"TinyGPT('{DPU_MODEL}'), batch {DPU_BATCH}, AdamW lr 1e-3, overlapped, {DPU_STEPS} steps\n")
print(practice_dpu.format_dpu(dpu_runs))

# %%
show(practice_dpu.plot_dpu(dpu_runs, DPU_MODEL, window=5 if SMOKE else 10), "dpu_loss.png")

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
# 落后这么多，会不会是引擎算错了？用纯 PyTorch 写一个"晚一步"的参照（`torch.optim.AdamW`，与 `tests/modules/test_pipeline.py` 里的写法相同）：
# 每一步先把模型换成"前向该看到的"那份权重算梯度，再换回当前的权重，让 AdamW 用这个梯度更新。

# %%
ours = dpu_runs["DPU from step 10"]["losses"]
reference_losses = practice_dpu.stale_reference(DPU_MODEL, 10, DPU_STEPS, DPU_BATCH, CORPUS)
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
tiers = {"CPU tier": practice_nvme.nvme_config("cpu", nvme_root, batch=NV_BATCH, sub_group=NV_SUB_GROUP)} | {
    f"NVMe, {b} buffer(s)": practice_nvme.nvme_config("nvme", nvme_root, batch=NV_BATCH, sub_group=NV_SUB_GROUP,
                                                      buffers=b) for b in (1, 2, 4)}
print(json.dumps(tiers["NVMe, 4 buffer(s)"]["zero_optimization"]).replace(str(nvme_root), "<nvme_path>"))
nv_engines, nv_ms = practice_nvme.tier_runs(NV_MODEL, tiers, NV_STEPS, CORPUS, batch=NV_BATCH)
cpu_engine, nv4 = nv_engines["CPU tier"], nv_engines["NVMe, 4 buffer(s)"]
print(f"TinyGPT('{NV_MODEL}'): {cpu_engine.num_params:,} parameters, fp16, stage 2, sub_group_size {NV_SUB_GROUP:,}, "
      f"{NV_STEPS} steps each, interleaved\n")
print(practice_nvme.format_tiers(nv_engines, nv_ms, weights(cpu_engine)))
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
nv2 = nv_engines["NVMe, 2 buffer(s)"]  # its files.write fails with ENOSPC on the third sub-group, for one step
print(practice_nvme.disk_full_step(nv2, cpu_engine, NV_MODEL, CORPUS, batch=NV_BATCH, nvme_root=nvme_root, group=2))
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
alone = largest_without_offload(BUDGET, n_layer=LAYERS)  # bisection over widths, one training step each
alone_s = time.perf_counter() - started
offloaded = offloaded_run(OFFLOAD_MODEL, budget=BUDGET, steps=3)
print(practice_runs.format_largest(BUDGET, LAYERS, alone, alone_s, OFFLOAD_MODEL, offloaded))

# %% [markdown]
# 卸载之后，设备上的峰值与模型大小关系不大（一层的权重、梯度桶、激活值），限制模型的是主机内存。
# 笔记本只训练了一个不大的模型，免得占满这台机器的内存；`1b` 预设（10 亿参数）要多少，用估算器算：

# %%
P1B = gpt_config("1b").num_params()
total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
estimates, host_limit = practice_runs.host_estimates(P1B, alone["params"], total, host_memory_available())
print(estimates)

# %% [markdown]
# 每参数 18 字节在主机上（bf16 权重 2、fp32 梯度分区 4、主权重 4、m 4、v 4），再加引擎初始化时复制权重用的那份 bf16 模型 2 字节，
# 正好落在导言"16～20 字节/参数"的范围里。`1b` 要 20 GB 左右的主机内存：笔记本不跑它，`make demo` 和 `make bench` 会真的训练它几步。
#
# 论文的数字用第 4 课的性能模型也能对照：一张 V100-32GB（`v100-32g` 预设），批 1 × 1024、激活重计算，
# 不卸载时设备放 16 字节/参数，卸载后放 2 字节/参数的 fp16 权重加激活值和梯度桶。对参数量二分：

# %%
V100 = replace(perfmodel.PRESETS["v100-32g"], gpus=1)
v100_plain, v100_offload = (practice_runs.largest_fitting(V100, *c) for c in ((0, "none"), (2, "optimizer")))  # bisect
print(f"one V100-32GB ({format_gb(V100.gpu_memory)}), batch 1 x 1024, activation checkpointing (model):")
print(f"  without offload (stage 0):        {v100_plain / 1e9:5.1f}B parameters   (the paper measured 1.4B with PyTorch)")
print(f"  stage 2 + offload_optimizer:      {v100_offload / 1e9:5.1f}B parameters   (the paper trained 13B)")
print(f"  ratio {v100_offload / v100_plain:.1f}x; with offload the host needs "
      f"{format_gb(perfmodel.plan(V100, perfmodel.Workload(v100_offload, recompute=True), 2, 'optimizer').host_bytes)}")

# %%
bars = {"no offload\n(measured)": alone["params"], f"offload, '{OFFLOAD_MODEL}'\n(measured)": offloaded["params"],
        "offload, '1b'\n(not run here)": P1B, "host limit\n(estimate)": host_limit}
v100_bars = {"no offload": v100_plain, "stage 2 + offload": v100_offload}
show(practice_runs.plot_largest(bars, format_bytes(BUDGET), v100_bars), "largest_model.png")

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
    return practice_runs.zo_train(*args, root=ROOT)  # in this process; prints only the resume and step lines


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
MN_STEPS = 12
if SMOKE:
    print("smoke mode: skipped (two torchrun agents take half a minute to start)")
else:
    two_dir, one_dir = run_root / "two-nodes", run_root / "one-process"
    started = time.perf_counter()
    run = practice_runs.multinode(two_dir, mn_config, "--steps", str(MN_STEPS), "--eval-every", "6", "--save-every", "4",
                                  root=ROOT)
    mn_wall = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"two nodes failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    zo_train("--config", str(mn_config), "--model", "tiny", "--steps", str(MN_STEPS), "--eval-every", "6",
             "--out", str(one_dir))
    two, one = (json.loads((d / "summary.json").read_text()) for d in (two_dir, one_dir))
    print(practice_runs.format_two_nodes(two, one, mn_wall))
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
if SMOKE or not Path("/proc/self/task").is_dir():
    print("skipped: smoke mode, or no /proc to find the rank to kill")
else:
    killed_dir = run_root / "killed"
    log, stopped_after, codes = practice_runs.kill_one_rank(killed_dir, run_root, mn_config)  # SIGKILL, node 1's rank
    print(f"node exit codes {codes}; rank 0 stopped {stopped_after:.1f} s after rank 1 was killed (--timeout was 60 s)")
    print("node 0's error:")
    for line in log.splitlines():
        if line.startswith(("error:", "  cause:", "Restart")):
            print(textwrap.fill(line.replace(str(ROOT) + "/", ""), 116, subsequent_indent="    "))
    saved = int(newest_complete(killed_dir).name.removeprefix("step_"))
    run = practice_runs.multinode(killed_dir, mn_config, "--steps", str(saved + 4), "--save-every", "4", "--resume",
                                  root=ROOT)
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
# `latest` 最后写，没有它的目录在续训时被删掉。
#
# ## 小结
#
# - 重叠流水线（`overlap_offload`）让每个单元的下行、Adam、上行在反向期间就开始，结果与串行逐位相同；
#   它最多能省下串行时反向之后的那条尾巴（Adam + 上行）。DPU 把 Adam 整个挪到下一步的前向、反向期间。
# - 在这台 2 核机器的模拟设备上，分核、批 1 × 8 时（第 1 节的表），那条尾巴占串行一步的三成左右，重叠和 DPU 几乎把它全藏住，
#   一步明显变短；收益随 token 数下降（2.1 节，批 4 × 128 时只剩几个百分点），两个槽时更小（2.4 节），共核时最小（2.2 节）。
#   在真 GPU 上，PCIe 和 CPU Adam 与计算是同一个量级，重叠和 DPU 省下的是秒（2.3 节）。
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
# | Lab 5.1 | 双缓冲的桶调度：取槽、在下行流上下行、主机队列等拷贝、累加、还槽、（eager 时）Adam 与上行 | `practice/pipeline.py` `OffloadPipeline.receive` |
# | Lab 5.2 | 一个槽只有在最后一个读它的人读完后才能再写 | `practice/pipeline.py` `SlotRing.acquire` |
# | Lab 5.3 | 延迟参数更新：先落地上一步，再对梯度快照发起这一步的 Adam | `practice/dpu.py` `DelayedUpdate.step` |
#
# `make demo` 是给课堂的端到端演示；`make train-multinode` 跑 7.2 节的两个节点。
#
# ## 练习
#
# 1. 第 1 节和 2.4 节只试了 2 个和 4 个暂存槽。用 `compare_schedules(..., slots=16)` 再量一次批 1 × 8，再在批 1 × 128 上比较 2、4、16 个槽：
#    槽多到几个之后重叠对串行的比值不再变？为什么 token 多时槽数几乎无关紧要？多出的槽各占多少主机内存？
# 2. 在第 3 节的 fp32 情形里打开 `gradient_clipping`，看第一个单元的 Adam 离反向结束多远，解释为什么。
# 3. 把第 4 节的学习率降到 5e-4，DPU 的落后变小了吗？把 `start_step` 放到 200 呢？
# 4. 第 5 节里，子组越小，主机上的槽越小；代价是什么？把 `sub_group_size` 改成 200,000 和 4,000,000 各量一次。
# 5. 你的机器有多少主机内存？按第 6 节的每参数字节数，卸载之后最大能训练多大的模型？用 `zo estimate` 核对。
