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
# # 第 3 课 实现篇：GPU 算、CPU 存、PCIe 传，一个字节一个字节地看
#
# 本笔记本配合 `course/03-implementation.md` 使用。前两课数清了 16 字节、把它们切到了多个进程上；
# 本课把 fp32 的那一半搬到主机（host），用模拟设备把 ZeRO-Offload 的一步训练从头到尾走一遍：
#
# 1. 卸载之后每个字节在哪一层：估算表，以及课程导言那份配置为什么被拒绝；
# 2. 跟着**一个梯度**走完一步：桶、reduce-scatter、fp16 分片、经 PCIe 下行、在主机上去缩放成 fp32、
#    裁剪、CPU 上的 Adam、在主机上舍入成 fp16、经 PCIe 上行，每一站都打印真实的数值；
# 3. 数一数 PCIe 上每步走了多少字节，与论文的"每参数 2 + 2 字节"对照，再看梯度累积和 stage 3 `offload_param`；
# 4. 每一层存储的字节：stage 0、stage 2、stage 2 + 卸载、stage 3 + `offload_param`，估算与实测；
# 5. 设一个显存预算：不卸载时显存不足，卸载后能训练，而且 loss 曲线与不卸载时一样；顺便看 CPU 上 Adam 每步的耗时；
# 6. 锁页内存拿不到时会发生什么；
# 7. 溢出时所有 rank 一起跳过，学习率调度也不前进；DeepSpeed 的三种调度。
#
# 所有图都保存在仓库根目录的 `out/lessons/03/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会缩小模型、减少步数，只用于快速检查笔记本能否跑通（`python tools/run_lessons.py --smoke 03`）。

# %%
import os
import statistics
import textwrap
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import zero_offload as zo
from zero_offload import plots
from zero_offload.accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from zero_offload.basics import estimate_model_states
from zero_offload.config import ConfigError, load_config
from zero_offload.cli.demo.run import INTRODUCTION_CONFIG as INTRO_CONFIG
from zero_offload.implementation import lr_at
from zero_offload.implementation.transfers import host_buffer
from zero_offload.units import format_bytes
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

SMOKE = os.environ.get("ZO_SMOKE") == "1"
# One thread: on a 2-core machine that is running anything else, every parallel region of a 2-thread torch waits
# for a thread that is not scheduled, and a 1 ms Adam step can take hundreds of milliseconds.
torch.set_num_threads(1)
ROOT = Path.cwd().parent if Path.cwd().name == "lessons" else Path.cwd()
OUT = ROOT / "out" / "lessons" / "03"
OUT.mkdir(parents=True, exist_ok=True)
CORPUS = load_corpus()


def show(fig, name: str) -> None:
    plots.show(fig, OUT / name)  # saved under out/lessons/03/ and displayed


def config(zero: dict, *, batch: int = 4, accumulation: int = 1, **extra) -> dict:
    """The fp16 AdamW config every experiment below starts from; `zero` is its zero_optimization section."""
    return {
        "train_batch_size": batch,
        "gradient_accumulation_steps": accumulation,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        # 本课看的是模块 3 的 Python 流水线（Lab 3.2 的 adam_step）；不写这一行，卸载时默认用模块 4 的 C 版 Adam。
        "zero_offload": {"cpu_adam": {"impl": "torch"}},
        **extra,
    }


def train(engine, steps: int, *, start: int = 0) -> list[float]:
    """`steps` optimizer steps on the course corpus, micro-batch by micro-batch; the loss of each global batch."""
    cfg, accumulation = engine.config, engine.gradient_accumulation_steps
    micro = cfg.train_micro_batch_size_per_gpu
    data = ByteBatches(CORPUS, engine.model.cfg.seq_len)
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for k in range(accumulation):
            x, y = data.micro_batch(step, micro, micro_step=k, accumulation=accumulation)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()  # does nothing until the last micro-batch of the step
            total += loss.item() / accumulation
        losses.append(total)
    return losses


STAGE0 = {"stage": 0}
STAGE2 = {"stage": 2}
OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
OFFLOAD_PARAM = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}

print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, smoke mode: {SMOKE}")
print(f"figures go to {OUT.relative_to(ROOT)}/")

# %% [markdown]
# ## 1. 卸载之后，每个字节在哪一层
#
# `"offload_optimizer": {"device": "cpu"}` 把模型状态里 fp32 的那一半搬到主机：fp32 主权重、Adam 的 m 和 v，
# 再加一块 **fp32 梯度分片**（CPU 上的 Adam 要用 fp32 梯度，梯度在主机上去缩放时顺便升精度）。设备上只剩前向和反向
# 要读的 fp16 参数，以及反向进行时短暂存在的梯度桶。估算器按状态、按层给出每个参数的字节数（这里 Ψ = 13B、一个 rank）：

# %%
PSI = 13_000_000_000
SETUPS = {
    "stage 0": dict(stage=0),
    "stage 2": dict(stage=2),
    "stage 2 + offload_optimizer": dict(stage=2, offload_optimizer="cpu"),
    "stage 3 + offload_param": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
}
STATES = ("parameters", "gradients", "master_weights", "exp_avg", "exp_avg_sq")
for name, kwargs in SETUPS.items():
    est = estimate_model_states(PSI, world_size=1, precision="fp16", **kwargs)
    cells = "  ".join(
        f"{s} {est.bytes[s]['device'] // PSI}/{est.bytes[s]['host'] // PSI}" for s in STATES
    )
    print(f"{name:<29} device {est.device / PSI:>4.0f} B/param, host {est.host / PSI:>4.0f} B/param   "
          f"(device/host: {cells})")
fp32 = estimate_model_states(PSI, stage=2, offload_optimizer="cpu", precision="fp32")
print(f"\nfp32 training, stage 2 + offload_optimizer: device {fp32.device / PSI:.0f} B/param, "
      f"host {fp32.host / PSI:.0f} B/param (the host keeps its own fp32 master)")

# %% [markdown]
# - stage 2 + `offload_optimizer`：设备 2 字节/参数，主机 4 + 4 + 4 + 4 = 16 字节/参数（梯度分片、主权重、m、v）。
#   13B 模型的设备部分从 208 GB 降到 26 GB。一个 rank 时 stage 2 本身什么也不省：分片就是全部。
# - fp32 训练不需要单独的主权重，但卸载之后设备上的 fp32 参数是前向要读的那一份，主机上的 Adam 需要自己的 fp32 副本，
#   所以主机上仍是 16 字节，设备上是 4 字节。
# - stage 3 + `offload_param`：fp16 参数分片也搬到主机，设备上平时一个字节的模型状态都没有，主机上是 2 + 16 = 18 字节。
#
# 课程导言给出的配置把 `offload_param` 和 stage 2 放在一起。把它原样交给配置加载器：

# %%
# INTRO_CONFIG is the introduction's example as the demo keeps it (zero_offload.cli.demo.run.INTRODUCTION_CONFIG).
try:
    load_config(INTRO_CONFIG)
except ConfigError as err:
    print(f"ConfigError at {err.path}:\n")
    print(textwrap.fill(str(err), 100))

# %% [markdown]
# stage 1、2 不切分参数，每张卡随时都要用完整的 fp16 参数，没有可以卸载的参数分片。两种改法：
# 去掉 `offload_param`（stage 2 + `offload_optimizer`，本课的主角），或者改成 stage 3（第 4 节量它的代价）。

# %% [markdown]
# ## 2. 跟着一个梯度走完一步
#
# 用 ZeRO-2 + CPU 卸载训练 `TinyGPT("tiny")`，先走两步让损失缩放和 Adam 的 m、v 都有了内容，然后在第 3 步里盯住
# 一个元素：`blocks.1.fc.weight[100, 17]`。为了看清每一站，我们包装引擎里三处（不改变它们做的事）：
#
# - `buckets.flush`：一个桶凑够 `reduce_bucket_size` 个元素时被调用，记下桶里有哪些单元、我们这个元素在桶里的值；
# - `buckets.deliver`：reduce-scatter 完成后把分片交出去，记下 fp16 分片的值，以及它过了 PCIe 之后在主机上的样子；
# - `engine.step()` 前后：记下主机上的 fp32 主权重、m、v，主机上的 fp16 暂存和设备上的参数。
#
# `reduce_bucket_size` 设为 200,000 个元素，这个 83 万参数的模型在一次反向里会分成几个桶。
# 另外准备一个参照：把引擎当前的 fp16 权重拷进一个普通的 fp32 模型，用 autograd 在同一批数据上求这个元素的梯度。

# %%
TRACE_CONFIG = config({**OFFLOAD, "reduce_bucket_size": 200_000})
PARAM_NAME, ELEMENT = "blocks.1.fc.weight", (100, 17)
TRACE_MODEL = "nano" if SMOKE else "tiny"

model = TinyGPT(TRACE_MODEL)
accel = EmulatedAccelerator()
engine = zo.initialize(model, TRACE_CONFIG, accelerator=accel)
train(engine, 2)
states, buckets = engine.states, engine.states.buckets
param = dict(model.named_parameters())[PARAM_NAME]
index, unit = next((i, u) for i, u in enumerate(states.units) if any(p is param for p in u.params))
offset = unit.offsets[next(i for i, p in enumerate(unit.params) if p is param)]
pos = offset + ELEMENT[0] * param.shape[1] + ELEMENT[1]  # one rank: the shard is the whole unit
print(f"{PARAM_NAME}{list(ELEMENT)} is element {pos:,} of unit {index} ('{unit.name}', "
      f"{unit.padded_numel:,} elements); {len(states.units)} units in all")

trace, bucket_log = {}, []
flush, deliver = buckets.flush, buckets.deliver


def traced_flush():
    members = list(buckets._bucket)  # the units about to be reduce-scattered together
    bucket_log.append([(states.units[j].name, states.units[j].padded_numel) for j in members])
    if index in members:
        trace["bucket"] = len(bucket_log)
        trace["in_bucket"] = float(buckets._staging[index][pos])
    flush()


def traced_deliver(j, shard):
    if j == index:
        trace["shard"], trace["shard_dtype"] = float(shard[pos]), shard.dtype
        d2h_before = states.transfers.bytes["d2h"]
    deliver(j, shard)
    if j == index:
        trace["staging"] = float(states.buffers.grad_staging[index][pos])
        trace["host_fp32"] = float(states.grad_shards[index][pos])
        trace["unit_d2h"] = states.transfers.bytes["d2h"] - d2h_before


buckets.flush, buckets.deliver = traced_flush, traced_deliver

# The reference: the same fp16 weights in a plain fp32 model, the same batch, plain autograd.
reference = TinyGPT(TRACE_MODEL)
reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
x, y = ByteBatches(CORPUS, model.cfg.seq_len).global_batch(2, 4)
lm_loss(reference(x), y).backward()
true_grad = float(dict(reference.named_parameters())[PARAM_NAME].grad[ELEMENT])

scale = engine.scaler.scale
states.transfers.reset()
loss = lm_loss(engine(x), y)
engine.backward(loss)
d2h_step = states.transfers.bytes["d2h"]

group = engine.optimizer.param_groups[0]
master = states.master_params[index]
adam_state = engine.optimizer.state[master]


def adam_values() -> dict:
    """This element's fp32 master weight and Adam moments, on the host."""
    return {"w": float(master[pos]), "m": float(adam_state["exp_avg"][pos]),
            "v": float(adam_state["exp_avg_sq"][pos])}


before = adam_values()
engine.step()
record = engine.history[-1]
after = adam_values()
host_fp16 = states.param_staging[index][pos]
device_fp16 = states.param_shards[index][pos]
buckets.flush, buckets.deliver = flush, deliver  # back to the engine's own

print("\nbuckets of this backward (units in the order backward finished them):")
for number, members in enumerate(bucket_log, 1):
    names = ", ".join(name for name, _ in members)
    print(f"  bucket {number}: {sum(n for _, n in members):>7,} elements  [{names}]")

# %%
clip_factor = 1.0 if record["grad_norm"] <= 1.0 else 1.0 / (record["grad_norm"] + 1e-6)
lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
t = int(adam_state["step"])
g = trace["host_fp32"] * clip_factor
m_new = beta1 * before["m"] + (1 - beta1) * g
v_new = beta2 * before["v"] + (1 - beta2) * g * g
w_new = before["w"] * (1 - lr * wd) - lr * (m_new / (1 - beta1**t)) / ((v_new / (1 - beta2**t)) ** 0.5 + eps)

def row(number, where: str, value: str, note: str = "") -> None:
    print(f"{number:>2}  {where:<36}{value:>14}   {note}")


print(f"one gradient, step {record['step']}, loss scale S = {scale:.0f}\n")
row(1, f"backward -> bucket {trace['bucket']} (fp16, x S)", f"{trace['in_bucket']:+.6f}",
    f"fp32 reference g x S = {true_grad * scale:+.6f}")
row(2, f"reduce-scatter -> shard ({str(trace['shard_dtype']).split('.')[-1]})", f"{trace['shard']:+.6f}",
    "one rank: the average of one")
row(3, "D2H into host staging (fp16)", f"{trace['staging']:+.6f}",
    f"{trace['unit_d2h']:,} bytes for this unit = 2 x {unit.shard_numel:,}")
row(4, "host fp32 partition, x 1/S", f"{trace['host_fp32']:+.9f}",
    f"fp32 autograd reference {true_grad:+.9f}, rel. error {abs(trace['host_fp32'] / true_grad - 1):.1e}")
row(5, "overflow on any rank?", str(record["overflow"]))
row(6, f"clip: global norm {record['grad_norm']:.4f} > 1.0", f"{g:+.9f}", f"clip factor {clip_factor:.6f}")
row(7, f"CPU AdamW, t = {t}: m", f"{after['m']:+.6e}", f"was {before['m']:+.6e}")
row("", "v", f"{after['v']:.6e}", f"was {before['v']:.6e}")
row("", "fp32 master", f"{after['w']:+.9f}",
    f"was {before['w']:+.9f}; by hand {w_new:+.9f}; update {after['w'] - before['w']:+.2e}")
row(8, "cast to fp16 on the host", f"{float(host_fp16):+.9f}", "the fp16 nearest to the master")
row(9, "H2D into the device shard", f"{float(device_fp16):+.9f}",
    f"{device_fp16.dtype}; {states.transfers.bytes['h2d']:,} bytes up this step")
row(10, "what the next forward reads", f"{float(param.detach()[ELEMENT]):+.9f}", f"{PARAM_NAME}{list(ELEMENT)}")
print(f"\nPCIe this step: {d2h_step:,} bytes down, {states.transfers.bytes['h2d']:,} up; "
      f"{engine.num_params:,} parameters -> {d2h_step / engine.num_params:.3f} + "
      f"{states.transfers.bytes['h2d'] / engine.num_params:.3f} bytes/param")
assert trace["in_bucket"] == trace["shard"] == trace["staging"]
assert abs(after["w"] - w_new) < 1e-7 and float(host_fp16) == float(device_fp16) == float(param.detach()[ELEMENT])
assert float(host_fp16) == float(torch.tensor(after["w"]).half())

# %% [markdown]
# 逐站看：
#
# - **1–3**：反向里这个元素的梯度一算完，引擎的 post-accumulate-grad 钩子就把它加进所在单元的暂存缓冲（桶），
#   `param.grad` 随即置空。它是乘过损失缩放 S 的 fp16 数。一个 rank 时 reduce-scatter 只是除以 1，分片就是整个单元；
#   N 个 rank 时 rank r 得到第 r 段的平均值。分片以 fp16 过 PCIe：2 字节/参数，`Transfers` 逐字节计数。
# - **4**：在主机上乘以 1/S 加进 fp32 梯度分片（Lab 3.1）。与 fp32 autograd 的参照只差 fp16 舍入（相对误差不超过 2⁻¹¹）。
# - **5–6**：检查溢出（Lab 3.4），算全局范数，超过 `gradient_clipping` 就按比例缩小（Lab 3.2 里乘上裁剪系数）。
# - **7**：CPU 上的 AdamW 更新 fp32 主权重和 m、v（Lab 3.2）。手算的结果与引擎一致。
# - **8–10**：主权重在主机上舍入成 fp16，再把 fp16 拷上设备（Lab 3.3）；单进程时 all-gather 什么也不用做，
#   模型的参数本来就是设备上那块缓冲的视图，下一步的前向直接读到新值。
#
# 整步下来，PCIe 上下行各 2 字节/参数，多出的一点点是分片补齐到 8 的倍数的填充。

# %% [markdown]
# ## 3. PCIe 上每步走多少字节
#
# ZeRO-Offload 论文的核心论点之一：在不给 GPU 增加计算的前提下，每个参数每步只需经 PCIe 搬 4 字节，
# fp16 梯度下行 2 字节、fp16 参数上行 2 字节。`engine.states.transfers.bytes` 记录每个方向实际拷贝的字节数。
# 在几个大小不同的模型上，分别用三种配置各训练几步：
#
# - stage 2 + `offload_optimizer`；
# - 同上，加梯度累积（`gradient_accumulation_steps` = 4）：每个微批次的梯度分片都要下行一次；
# - stage 3 + `offload_param`：参数分片也在主机上，每次聚合（前向一次、反向一次）都要先上行。

# %%
SIZES = ("nano",) if SMOKE else ("nano", "tiny", "small")
PCIE_STEPS = 1 if SMOKE else 2
PCIE_SETUPS = {
    "stage 2 + offload": (OFFLOAD, 1),
    "stage 2 + offload, 4 micro-batches": (OFFLOAD, 4),
    "stage 3 + offload_param": (OFFLOAD_PARAM, 1),
}
pcie = {}  # (setup, size) -> (parameters, d2h bytes per step, h2d bytes per step)
for size in SIZES:
    for name, (zero, accumulation) in PCIE_SETUPS.items():
        eng = zo.initialize(TinyGPT(size), config(zero, accumulation=accumulation),
                            accelerator=EmulatedAccelerator())
        train(eng, PCIE_STEPS)
        moved = eng.states.transfers.bytes
        pcie[name, size] = (eng.num_params, moved["d2h"] / PCIE_STEPS, moved["h2d"] / PCIE_STEPS)

print(f"{'setup':<36}{'model':>7}{'params':>12}{'D2H/step':>13}{'H2D/step':>13}{'D2H/param':>11}{'H2D/param':>11}")
for (name, size), (n, d2h, h2d) in pcie.items():
    print(f"{name:<36}{size:>7}{n:>12,}{format_bytes(d2h):>13}{format_bytes(h2d):>13}"
          f"{d2h / n:>11.3f}{h2d / n:>11.3f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
colors = {"stage 2 + offload": "tab:blue", "stage 2 + offload, 4 micro-batches": "tab:orange",
          "stage 3 + offload_param": "tab:green"}
ns = np.array(sorted({n for n, _, _ in pcie.values()}), dtype=float)
for per_param, style, label in ((2, "--", "2 bytes/param: the paper, each way"), (4, ":", "4 bytes/param"),
                                (8, "-.", "8 bytes/param")):
    ax1.plot(ns, per_param * ns, color="black" if per_param == 2 else "gray", linestyle=style, linewidth=1,
             label=label)
for name, color in colors.items():
    points = sorted(v for (setup, _), v in pcie.items() if setup == name)
    n = [p[0] for p in points]
    # Hollow large markers for D2H, small filled ones for H2D, so that points on top of each other stay visible.
    ax1.scatter(n, [p[1] for p in points], s=110, facecolors="none", edgecolors=color, linewidths=1.5,
                label=f"{name}: D2H")
    ax1.scatter(n, [p[2] for p in points], s=25, color=color, marker="^", label=f"{name}: H2D")
ax1.set_xscale("log")
ax1.set_yscale("log")
ax1.set_xlabel("parameters")
ax1.set_ylabel("bytes per optimizer step")
ax1.set_title("PCIe traffic per step grows with the model")
ax1.legend(fontsize=7)
ax1.grid(alpha=0.3, which="both")
largest = SIZES[-1]
names = list(PCIE_SETUPS)
pos_x = np.arange(len(names))
for offset, (column, label, hatch) in zip((-0.2, 0.2), ((1, "D2H (gradients)", ""), (2, "H2D (weights)", "//")),
                                          strict=True):
    values = [pcie[name, largest][column] / pcie[name, largest][0] for name in names]
    ax2.bar(pos_x + offset, values, 0.4, label=label, hatch=hatch, color="tab:gray", edgecolor="white")
    for p, v in zip(pos_x + offset, values, strict=True):
        ax2.text(p, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
ax2.axhline(2, color="black", linestyle="--", linewidth=1, label="paper: 2 + 2")
ax2.set_xticks(pos_x, ["stage 2\n+ offload", "stage 2 + offload\n4 micro-batches", "stage 3\n+ offload_param"],
               fontsize=8)
ax2.set_ylabel("bytes per parameter per step")
ax2.set_title(f"Per parameter, TinyGPT('{largest}')")
ax2.legend(fontsize=8)
show(fig, "pcie_bytes_per_step.png")

# %% [markdown]
# - stage 2 + 卸载：下行、上行都是 2 字节/参数，正是论文的 2 + 2。字节数与模型大小成正比，左图是一条斜率为 1 的直线。
# - 梯度累积 k 个微批次：每个微批次的反向都会把它的梯度分片送下去（在主机上累加进 fp32 分片），所以下行是 2k 字节/参数；
#   上行仍是每步一次，2 字节。论文的 4 字节/参数指的是每个**优化器步**只有一个微批次的情形。
# - stage 3 + `offload_param`：下行不变；参数每被聚合一次就要上行一次，前向一次、反向一次，约 4 字节/参数，
#   再加共享词嵌入多聚合的那一次（这个模型里占几个百分点）。更新后不再上传：新的 fp16 参数就留在主机上，等下次聚合。

# %% [markdown]
# ## 4. 每一层存储的字节：估算与实测
#
# `engine.memory_report()` 同时给出估算器的数字和账本（ledger）按真实张量存储量出的数字。
# 对同一个模型比较四种配置；`host_staging_bytes()` 是模型状态之外、主机上的 fp16 中转缓冲（梯度下行、参数上行都经过它），
# `peak` 是训练一步期间设备上的峰值（含激活值和梯度桶）。

# %%
MEM_MODEL = "nano" if SMOKE else "small"
MEM_SETUPS = {"stage 0": STAGE0, "stage 2": STAGE2, "stage 2 + offload": OFFLOAD,
              "stage 3 + offload_param": OFFLOAD_PARAM}
memory = {}
for name, zero in MEM_SETUPS.items():
    acc = EmulatedAccelerator()
    eng = zo.initialize(TinyGPT(MEM_MODEL), config(zero), accelerator=acc)
    train(eng, 2)  # the second step is the steady one: stage 3 prefetches only once it has seen the order
    report = eng.memory_report()
    staging = eng.states.host_staging_bytes()
    memory[name] = (report, staging, acc.memory_stats().peak)
n_mem = memory["stage 0"][0].num_params
print(f"TinyGPT('{MEM_MODEL}'): {n_mem:,} parameters, one rank, fp16, batch 4\n")
print(f"{'setup':<25}{'device est':>12}{'device meas':>13}{'host est':>11}{'host meas':>11}"
      f"{'staging':>11}{'device peak':>13}")
for name, (report, staging, peak) in memory.items():
    e, m = report.estimated, report.measured
    print(f"{name:<25}{format_bytes(e.device):>12}{format_bytes(m.device):>13}{format_bytes(e.host):>11}"
          f"{format_bytes(m.host):>11}{format_bytes(staging):>11}{format_bytes(peak):>13}")
print(f"\n{'setup':<25}{'device B/param':>15}{'host B/param':>14}")
for name, (report, _, _) in memory.items():
    print(f"{name:<25}{report.measured.device / n_mem:>15.2f}{report.measured.host / n_mem:>14.2f}")

# %%
fig, ax = plt.subplots(figsize=(9, 4.2))
names = list(memory)
pos_x = np.arange(len(names))
bars = (("device", "estimated", -0.3, "tab:red", "//"), ("device", "measured", -0.1, "tab:red", ""),
        ("host", "estimated", 0.1, "tab:blue", "//"), ("host", "measured", 0.3, "tab:blue", ""))
for tier, kind, offset, color, hatch in bars:
    values = [getattr(getattr(memory[n][0], kind), tier) / 2**20 for n in names]
    ax.bar(pos_x + offset, values, 0.2, color=color, hatch=hatch, edgecolor="white", label=f"{tier}, {kind}")
    for p, v in zip(pos_x + offset, values, strict=True):
        ax.text(p, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
ax.set_xticks(pos_x, names)
ax.set_ylabel("model states (MiB)")
ax.set_title(f"Model states per tier, TinyGPT('{MEM_MODEL}'), one rank, fp16")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, axis="y")
show(fig, "memory_per_tier.png")

# %% [markdown]
# 估算与实测逐字节相同（一个 rank 时分片只比参数多几个对齐用的填充元素）。
#
# - stage 0 和 stage 2 在一个 rank 上一样：16 字节/参数全在设备上。
# - stage 2 + 卸载：设备只剩 fp16 参数（2 字节/参数），主机 16 字节/参数；另有主机上的 fp16 中转缓冲（梯度一块、参数一块，各 2 字节/参数），
#   这就是导言"按 16～20 字节/参数估算 CPU 内存"里超出 16 的那一部分。
# - stage 3 + `offload_param`：设备上的模型状态是 0，主机 18 字节/参数。但设备**峰值**并不是 0：前向、反向时聚合出来的完整参数、
#   上传用的缓冲都在设备上，默认的预取（`stage3_prefetch_bucket_size`，DeepSpeed 的默认值 5000 万元素）对小模型等于把全部参数一次取齐。

# %% [markdown]
# ## 5. 显存预算：不卸载放不下，卸载能训练，结果一样
#
# 给模拟设备一个比模型状态小的预算。不卸载时，引擎在分配 fp32 状态时就会显存不足；报错写明在为什么分配、
# 已经占了什么，以及哪个配置能缓解。

# %%
BUDGET_MODEL = "nano" if SMOKE else "small"
BUDGET = (1 if SMOKE else 48) * 2**20
BUDGET_STEPS = 3 if SMOKE else 30
n_budget = TinyGPT(BUDGET_MODEL).cfg.num_params()
print(f"TinyGPT('{BUDGET_MODEL}'): {n_budget:,} parameters, model states {format_bytes(16 * n_budget)}, "
      f"device budget {format_bytes(BUDGET)}\n")
for name, zero in (("stage 0", STAGE0), ("stage 2", STAGE2)):
    try:
        zo.initialize(TinyGPT(BUDGET_MODEL), config(zero), accelerator=EmulatedAccelerator(BUDGET))
    except DeviceOutOfMemoryError as err:
        print(f"{name}: DeviceOutOfMemoryError\n{textwrap.fill(str(err), 100)}\n")

# %% [markdown]
# 按提示打开 `offload_optimizer`，在同一个预算下训练；再在不设预算的设备上用 stage 0 训练同一个模型、同样的数据作参照。
# 顺便记录每一步的时间，以及 `engine.history` 里 CPU 上 Adam 的耗时（`adam_seconds`）。

# %%
def timed_run(zero: dict, capacity):
    acc = EmulatedAccelerator(capacity)
    eng = zo.initialize(TinyGPT(BUDGET_MODEL), config(zero), accelerator=acc)
    started = time.perf_counter()
    losses = train(eng, BUDGET_STEPS)
    seconds = (time.perf_counter() - started) / BUDGET_STEPS
    return eng, acc, losses, seconds


offloaded, acc_off, loss_off, s_off = timed_run(OFFLOAD, BUDGET)
on_device, acc_dev, loss_dev, s_dev = timed_run(STAGE0, None)
print(f"{'run':<34}{'device peak':>12}{'budget':>10}{'ms/step':>9}{'Adam ms (median)':>18}{'skipped':>9}")
for name, eng, acc, s in (("stage 2 + offload, budgeted", offloaded, acc_off, s_off),
                          ("stage 0, unlimited device", on_device, acc_dev, s_dev)):
    stats = acc.memory_stats()
    adam = statistics.median(h["adam_seconds"] for h in eng.history if not h["overflow"]) * 1e3
    budget = "none" if stats.capacity is None else format_bytes(stats.capacity)
    print(f"{name:<34}{format_bytes(stats.peak):>12}{budget:>10}{s * 1e3:>9.0f}{adam:>18.1f}"
          f"{eng.skipped_steps:>9}")
diff = max(abs(a - b) for a, b in zip(loss_off, loss_dev, strict=True))
weights_off = dict(offloaded.model.named_parameters())
weights_dev = dict(on_device.model.named_parameters())
wdiff = max(float((weights_off[k].detach().float() - weights_dev[k].detach().float()).abs().max())
            for k in weights_off)
print(f"\nloss {loss_off[0]:.4f} -> {loss_off[-1]:.4f} over {BUDGET_STEPS} steps; "
      f"max |loss difference| = {diff:.1e}, max |weight difference| = {wdiff:.1e}")
adam_s = statistics.median(h["adam_seconds"] for h in offloaded.history if not h["overflow"])
print(f"CPU Adam: {adam_s * 1e3:.1f} ms for {offloaded.num_params:,} parameters = "
      f"{adam_s / offloaded.num_params * 1e9:.1f} ns/param; at 28 bytes/param that is "
      f"{28 * offloaded.num_params / adam_s / 1e9:.1f} GB/s of host memory traffic")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4))
steps = np.arange(BUDGET_STEPS)
ax.plot(steps, loss_dev, color="tab:gray", linewidth=4, alpha=0.5, label="stage 0, no offload, unlimited device")
ax.plot(steps, loss_off, color="tab:blue", linestyle="--", marker=".",
        label=f"stage 2 + CPU offload, {format_bytes(BUDGET)} budget")
ax.set_xlabel("optimizer step")
ax.set_ylabel("training loss")
ax.set_title(f"TinyGPT('{BUDGET_MODEL}'): offloading changes where, not what (max diff {diff:.0e})")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
show(fig, "loss_offload_vs_device.png")

# %% [markdown]
# 两条曲线重合：卸载只改变状态**放在哪里**、在哪里做 Adam，不改变数学。这里不只是"在误差范围内"：
# 两边的 fp16 梯度相同，去缩放都是 fp32 里乘以 1/S，Adam 是同一个实现，所以 loss 和权重逐位相同。
# （全局梯度范数的求和顺序不同，会在第 13 位有效数字上不同；它只影响裁剪系数的最后一位，这里没有改变任何权重。）
#
# 时间：在模拟设备上"设备"和"主机"是同一颗 CPU，两次运行每步的耗时差别说明不了 GPU 上的快慢。
# `adam_seconds` 则是真实的 CPU Adam 时间。这台 2 核机器上别的程序也在跑时，它会成倍抖动，所以取中位数；
# 按 28 字节/参数折算的内存带宽可以和第 0 章的带宽下限对照。第 4 模块用 C 和 SIMD 把它做快，第 5 模块把它藏到 GPU 计算后面。

# %% [markdown]
# ## 6. 锁页内存
#
# GPU 的拷贝引擎（DMA）只能直接读写**锁页**（pinned，page-locked）的主机内存：操作系统保证这些页不会被换出、物理地址不变。
# 从普通的可分页内存拷贝时，驱动先把数据拷进它自己的一块锁页中转区，再 DMA，多一次 CPU 拷贝，而且不能与计算异步重叠。
# 所以 `"pin_memory": true` 让引擎用锁页内存分配主机上的 fp16 中转缓冲和 fp32 状态。
#
# 锁页内存是有限的资源（`ulimit -l`、容器的限制），而且没有 GPU 驱动时根本分配不出来。这时引擎不会失败，而是退回到可分页内存并给出警告。
# 在这台没有 CUDA 的机器上，向 PyTorch 要锁页内存正好会失败，可以亲眼看到这条警告：

# %%
class PinningHost(EmulatedAccelerator):
    """Asks torch for page-locked host memory, as the CUDA accelerator does."""

    def host_empty(self, shape, dtype, *, pin=False):
        return torch.empty(shape, dtype=dtype, pin_memory=pin)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    buffer = host_buffer(PinningHost(), 1_000_000, torch.float16, pin=True)
print(f"got {buffer.numel():,} x {buffer.dtype}, pinned: {buffer.is_pinned()}")
for warning in caught:
    print(f"{warning.category.__name__}: {textwrap.fill(str(warning.message), 100)}")
print(f"\nthe emulated device itself: offloaded master pinned? {offloaded.states.master.is_pinned()}"
      " (host memory is host memory here; `make gpu-check` measures pinned vs pageable on a GPU)")

# %% [markdown]
# ## 7. 溢出：所有 rank 一起跳过；学习率调度不前进
#
# fp16 的梯度溢出时（出现 inf 或 nan），这一步整步跳过：主权重、m、v、fp16 参数都不动，损失缩放减半。
# 卸载后溢出检查在主机上对 fp32 梯度分片做，每个 rank 只看得见自己的分片，所以本地的判断要经一次 MAX all-reduce
# 变成所有 rank 的共同判断（Lab 3.4；两个进程的版本在 `tests/course/labs/test_lab3.py` 里）。
#
# 学习率调度也只在真正更新了的步之后前进。下面配一个线性预热 5 步的 `WarmupLR`，在第 2 步把 loss 乘以无穷大。
# `hysteresis` 设为 1，让第一次溢出就把缩放因子减半（DeepSpeed 默认是 2，第一次溢出只消耗"耐心"，见第 1 课第 5 节）：

# %%
sched_config = config(OFFLOAD, scheduler={"type": "WarmupLR", "params": {
    "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5, "warmup_type": "linear"}})
sched_config["fp16"]["hysteresis"] = 1  # halve at the first overflow (DeepSpeed's default 2 tolerates one)
eng = zo.initialize(TinyGPT("nano"), sched_config, accelerator=EmulatedAccelerator())
data = ByteBatches(CORPUS, eng.model.cfg.seq_len)
for step in range(6):
    x, y = data.global_batch(step, 4)
    loss = lm_loss(eng(x), y)
    if step == 2:
        loss = loss * float("inf")
        kept = [t.clone() for t in (eng.states.master, eng.states.exp_avg, eng.states.exp_avg_sq,
                                    eng.states.flat_param)]
    eng.backward(loss)
    eng.step()
    if step == 2:
        now = (eng.states.master, eng.states.exp_avg, eng.states.exp_avg_sq, eng.states.flat_param)
        unchanged = all(torch.equal(a, b) for a, b in zip(kept, now, strict=True))
print(f"{'step':>4}{'overflow':>10}{'loss scale':>12}{'lr used':>11}{'grad norm':>11}")
for h in eng.history:
    norm = "-" if h["grad_norm"] is None else f"{h['grad_norm']:.3f}"
    print(f"{h['step']:>4}{h['overflow']!s:>10}{h['loss_scale']:>12.0f}{h['lr']:>11.1e}{norm:>11}")
print(f"\nstep 2 skipped: master, m, v and fp16 weights bit-identical afterwards: {unchanged}; "
      f"skipped steps {eng.skipped_steps}, scheduler at {eng.lr_scheduler.steps_applied} applied steps")

# %% [markdown]
# 第 2 步溢出：这一步的记录里没有梯度范数（没有更新，也就不算），状态逐位不变，下一步的缩放因子从 4096 减半到 2048；
# 学习率在第 2、3 步是同一个值，因为调度只数真正执行了的步。前两步的学习率都是 0，这是 DeepSpeed 的预热公式：
# 第 0 步用 `warmup_min_lr`，第 1 步的预热进度是 0/5。
#
# DeepSpeed 的配置里有三种调度（`"scheduler": {"type": ..., "params": ...}`），本引擎逐值复现：
#
# - `WarmupLR`：从 `warmup_min_lr` 升到 `warmup_max_lr`（log 或 linear），之后保持；
# - `WarmupDecayLR`：同样预热，之后线性降回 `warmup_min_lr`，在 `total_num_steps` 到达；
# - `WarmupCosineLR`：以优化器自己的 lr 为单位，从 `warmup_min_ratio` 预热到 1，再按半个余弦降到 `cos_min_ratio`。

# %%
PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20, "total_num_steps": 100},
    "WarmupCosineLR": {"warmup_num_steps": 20, "total_num_steps": 100, "warmup_min_ratio": 0.0,
                       "cos_min_ratio": 0.1},
}
fig, ax = plt.subplots(figsize=(7.5, 3.8))
xs = np.arange(120)
for (kind, params), color in zip(PARAMS.items(), ("tab:blue", "tab:orange", "tab:green"), strict=True):
    for warmup, style in (("log", "-"), ("linear", ":")):
        lrs = [lr_at(kind, {**params, "warmup_type": warmup}, int(s), 1e-3) for s in xs]
        ax.plot(xs, lrs, color=color, linestyle=style, label=f"{kind} ({warmup} warmup)")
ax.axvline(100, color="gray", linewidth=1, linestyle="--")
ax.text(101, 9e-4, "total_num_steps", fontsize=8, color="gray")
ax.set_xlabel("applied optimizer step")
ax.set_ylabel("learning rate")
ax.set_title("DeepSpeed's three schedules (optimizer lr 1e-3)")
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
show(fig, "lr_schedules.png")

# %% [markdown]
# 余弦调度过了 `total_num_steps` 又会回升：DeepSpeed 不截断余弦的角度，本引擎照样保留，训练步数要与 `total_num_steps` 一致。
#
# ## 小结
#
# - stage 2 + `offload_optimizer`：设备 2 字节/参数（fp16 参数），主机 16 字节/参数（fp32 梯度分片、主权重、m、v），外加 fp16 中转缓冲；
#   stage 3 + `offload_param`：设备上的模型状态为 0，主机 18 字节/参数。`offload_param` 只能配 stage 3，导言的配置会被拒绝。
# - 一个梯度的旅程：钩子 → 桶 → reduce-scatter → fp16 分片 → 下行 2 字节 → 主机上乘以 1/S 进 fp32 → 跨 rank 检查溢出 → 裁剪 →
#   CPU Adam → 主机上舍入成 fp16 → 上行 2 字节 → all-gather。
# - PCIe：每步下行、上行各 2 字节/参数；梯度累积 k 个微批次时下行是 2k；stage 3 + `offload_param` 上行约 4（每次聚合一次）。
# - 同样的数据、同样的初值，卸载与不卸载的 loss 和权重逐位相同；显存预算放不下 16 字节/参数时，卸载让训练跑起来。
# - 溢出时所有 rank 一起跳过，状态不变，损失缩放减半，学习率调度不前进。
#
# ## 接下来：实验 3
#
# 在仓库根目录运行 `make lab3` 为实验 3 评分（`make lab3 LAB_DIR=solutions` 看参考答案的满分表）。四个任务都在
# `labs/lab3/implementation/offload.py` 里：
#
# | 任务 | 内容 | 函数 |
# |---|---|---|
# | Lab 3.1 | fp16 梯度分片经 `Transfers` 下行，乘以 1/S 加进 fp32 梯度分片 | `gradients_to_host` |
# | Lab 3.2 | 乘裁剪系数，交给主权重，CPU 上跑 Adam，再把梯度摘下 | `adam_step` |
# | Lab 3.3 | 主权重在主机上舍入成 fp16，再上行到设备分片 | `upload_weights` |
# | Lab 3.4 | 本地分片里有 inf 或 nan，所有 rank 达成一致 | `overflow_on_any_rank` |
#
# 卡住时运行 `grep -rn "Lab 3.2"`，就能同时找到实验桩、第 3 章里讲解它的段落和评分测试。

# %% [markdown]
# ## 附：在 CPU 上对照真的 DeepSpeed（装了 `deepspeed` 才运行）
#
# 第 3 章（续）[读 DeepSpeed 的源码](../course/03a-reading-deepspeed.md) 从 DeepSpeed 的代码里读出：ZeRO-2 + CPU 卸载时，
# 梯度在设备上先升成 fp32 再下行，**4 字节/参数**，权重上行 **2 字节/参数**；stage 2 的配置里写了 `offload_param`，
# DeepSpeed 不报错，只是不用它。下面这一格把这两件事量出来，放在第 3 节本引擎的 2 + 2 旁边。
#
# `deepspeed` 不是本项目的依赖，默认没有安装；没有它，这一格只打印安装方法。要运行它，在项目的虚拟环境里：
#
# ```bash
# DS_BUILD_OPS=0 .venv/bin/pip install deepspeed    # 不预编译任何算子
# DS_ACCELERATOR=cpu                                # 这一格自己会设：DeepSpeed 在 CPU 上跑，不需要 GPU
# ```
#
# 在 CPU 上没有"设备"和"主机"之分，所以这里不看张量在哪，而是数**那两行拷贝**搬了多少字节：
# 下行数 `async_inplace_copy_grad_to_fp32_buffer_from_gpu` 里的拷贝，上行数 `step()` 里写进本 rank 16 位分片的拷贝。
# 用 bf16：DeepSpeed 的 CPU 加速器只在这颗 CPU 的 oneDNN 支持 fp16 时才接受 fp16，bf16 则处处可用，而且与 fp16 一样每个数 2 字节；
# 优化器用 `torch_adam`，免得编译 CPU Adam。
# 第一次运行时 DeepSpeed 会用 g++ 编译它的共享内存通信算子，要一两分钟。

# %%
import importlib.util  # noqa: E402

if importlib.util.find_spec("deepspeed") is None:
    print("deepspeed is not installed (it is not a dependency of this project): skipped.")
    print("To run this cell, install it into the project's virtual environment:")
    print("    DS_BUILD_OPS=0 .venv/bin/pip install deepspeed")
    print("It then runs on the CPU: the cell sets DS_ACCELERATOR=cpu before importing it.")
else:
    import socket

    os.environ["DS_ACCELERATOR"] = "cpu"  # before the import: DeepSpeed picks its accelerator once
    with socket.socket() as probe:  # a process group of one rank, without a launcher
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port)}.items():
        os.environ.setdefault(key, value)
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    ds_config = {
        "train_batch_size": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        # offload_param at stage 2, as in the course introduction's config: DeepSpeed accepts it.
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "cpu"}},
    }
    torch.manual_seed(0)
    ds_model = TinyGPT("nano")
    ds_engine, *_ = deepspeed.initialize(model=ds_model, model_parameters=ds_model.parameters(), config=ds_config)
    ds_opt = ds_engine.optimizer
    print(f"deepspeed {deepspeed.__version__}: the optimizer is {type(ds_opt).__name__}; the config's "
          f"offload_param.device is {ds_engine.zero_offload_param().device!r}, and the optimizer has "
          f"{'an' if hasattr(ds_opt, 'offload_param') else 'no'} offload_param setting: it was dropped")

    # Count the bytes of the two copies 3a reads: the gradient's (D2H) and the new weights' (H2D).
    ds_moved = {"D2H": 0, "H2D": 0}
    inside_down = [False]
    shard_ptrs = {t.data_ptr() for group in ds_opt.parallel_partitioned_bit16_groups for t in group}
    plain_copy = torch.Tensor.copy_
    plain_down = DeepSpeedZeroOptimizer.async_inplace_copy_grad_to_fp32_buffer_from_gpu

    def counting_copy(dst, src, *args, **kwargs):
        if inside_down[0]:
            ds_moved["D2H"] += src.numel() * src.element_size()
        elif dst.data_ptr() in shard_ptrs:
            ds_moved["H2D"] += src.numel() * src.element_size()
        return plain_copy(dst, src, *args, **kwargs)

    def counting_down(self, param):
        inside_down[0] = True
        try:
            return plain_down(self, param)
        finally:
            inside_down[0] = False

    torch.Tensor.copy_ = counting_copy
    DeepSpeedZeroOptimizer.async_inplace_copy_grad_to_fp32_buffer_from_gpu = counting_down
    try:
        tokens = torch.randint(0, 256, (4, 32))
        ds_engine.backward(lm_loss(ds_engine(tokens), tokens))
        ds_engine.step()
    finally:
        torch.Tensor.copy_ = plain_copy
        DeepSpeedZeroOptimizer.async_inplace_copy_grad_to_fp32_buffer_from_gpu = plain_down
    n_ds = sum(p.numel() for p in ds_model.parameters())
    n_ours, d2h_ours, h2d_ours = pcie["stage 2 + offload", "nano"]  # section 3's measurement, same model
    print(f"{'bytes a parameter, one step':<40}{'D2H':>8}{'H2D':>8}")
    print(f"{'DeepSpeed, stage 2 + offload_optimizer':<40}{ds_moved['D2H'] / n_ds:>8.3f}{ds_moved['H2D'] / n_ds:>8.3f}")
    print(f"{'zero_offload, stage 2 + offload':<40}{d2h_ours / n_ours:>8.3f}{h2d_ours / n_ours:>8.3f}")

# %% [markdown]
# 装了 DeepSpeed 时应当看到：DeepSpeed 下行 4、上行 2，本引擎 2 和 2；`offload_param` 的设置在 stage 2 的优化器里不存在。
# 为什么是 4、哪一行做的，见第 3 章（续）的 3A.1 节和 3A.4 节；stage 3 打开 `offload_param` 后两边各搬多少，见 3A.6 节和 3A.7 节。
