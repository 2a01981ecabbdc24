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
# # 第 1 课 基础篇：亲手数清楚每个参数的 16 字节
#
# 本笔记本配合 `course/01-basics.md` 使用。第 0 章用算术说明了混合精度 Adam 训练每个参数要 16 字节模型状态，
# 本课把这些结论逐一变成**可以运行、可以测量**的代码：
#
# 1. 用估算器算出 13B 模型的 16 字节/参数，找出课程导言 156 GB 漏掉的那 52 GB，并比较 ZeRO 各阶段与 CPU 卸载；
# 2. 训练一个很小的 GPT，用内存账本（ledger）实测模型状态，与估算逐字节对照；
# 3. 把朴素的 Adam 与 `torch.optim.AdamW` 放在同一串梯度上跑 100 步，比较结果；弄清 Adam 与 AdamW 的权重衰减之别；
# 4. 用一个数值小实验说明为什么必须保留 fp32 主权重；
# 5. 看 fp16 的数值范围、梯度下溢，以及动态损失缩放如何跳过溢出的步；
# 6. 在模拟设备上触发一次"显存不足"，读懂报错里的提示，并测量激活值占用。
#
# 所有图都保存在仓库根目录的 `out/lessons/01/` 下，同时显示在笔记本里。
# 设置环境变量 `ZO_SMOKE=1` 会缩短训练步数，只用于快速检查笔记本能否跑通（`python tools/run_lessons.py --smoke`）。

# %%
import math
import os
import statistics
import textwrap
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Image, display

import zero_offload as zo
from zero_offload import plots
from zero_offload.accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from zero_offload.basics import Adam, DynamicLossScaler, MemoryLedger, estimate_model_states
from zero_offload.basics import adam as adam_module
from zero_offload.config import load_config
from zero_offload.plots import plot_model_states
from zero_offload.units import format_bytes, format_gb
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

SMOKE = os.environ.get("ZO_SMOKE") == "1"
ROOT = Path.cwd().parent if Path.cwd().name == "lessons" else Path.cwd()
OUT = ROOT / "out" / "lessons" / "01"
OUT.mkdir(parents=True, exist_ok=True)


def show(fig, name: str) -> None:
    plots.show(fig, OUT / name)  # saved under out/lessons/01/ and displayed


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, smoke mode: {SMOKE}")
print(f"figures go to {OUT.relative_to(ROOT)}/")

# %% [markdown]
# ## 1. 每个参数 16 字节，而不是 12 字节
#
# 混合精度 Adam 训练中，每个参数对应五份"模型状态"：fp16 参数 2 字节、fp16 梯度 2 字节、fp32 主权重 4 字节、
# fp32 一阶矩 m 4 字节、fp32 二阶矩 v 4 字节。`estimate_model_states` 按这个规则给出每一层存储（device / host / nvme）
# 的字节数。先看最简单的情形：一张卡、不分片、不卸载。
#
# 注意单位：表格里用二进制单位 GiB（2^30 字节），汇总行用十进制 GB（10^9 字节，GPU 规格书和 ZeRO 论文的单位）。
# 193.72 GiB 和 208 GB 是同一个数。

# %%
PSI = 13_000_000_000  # parameters of the model the course introduction talks about
est = estimate_model_states(PSI, precision="fp16")
print(est.table())
print()
for state, per_tier in est.bytes.items():
    print(f"{state:<16}{per_tier['device'] / PSI:>4.0f} bytes/param")
print(f"{'total':<16}{est.total / PSI:>4.0f} bytes/param -> {format_gb(est.total)}")

# %% [markdown]
# 课程导言写的是 13 × (2 + 2 + 4 + 4) = 156 GB。把它和估算器逐项对比，就能看出差在哪里：

# %%
intro = PSI * (2 + 2 + 4 + 4)  # fp16 weight, fp16 gradient, m, v: the introduction's 12 bytes
missing = est.total - intro
print(f"estimator:    {format_gb(est.total)}")
print(f"introduction: {format_gb(intro)}")
print(f"difference:   {format_gb(missing)} = {missing / PSI:.0f} bytes/param")
print(f"fp32 master weights alone: {format_gb(est.bytes['master_weights']['device'])}")
assert missing == est.bytes["master_weights"]["device"]

# %% [markdown]
# 差额正好是 fp32 主权重：13e9 × 4 B = 52 GB。第 4 节会用一个数值实验说明，这 4 字节省不掉。
#
# 接下来比较几种配置下**每张卡**要存多少。ZeRO 论文把优化器状态的字节数记作 K（这里 K = 12：主权重、m、v），
# Ψ 为参数量，N 为卡数，各阶段每卡的设备字节数为：
#
# | 配置 | 每卡设备字节 |
# |---|---|
# | 数据并行（stage 0） | (2 + 2 + K)Ψ |
# | stage 1：切分优化器状态 | (2 + 2)Ψ + KΨ/N |
# | stage 2：再切分梯度 | 2Ψ + (2 + K)Ψ/N |
# | stage 3：再切分参数 | (2 + 2 + K)Ψ/N |
#
# 下面让估算器算出这些数，再用公式独立算一遍核对；最后一行是单卡 stage 2 加 `offload_optimizer: cpu`：
# 设备上只剩 fp16 参数，主机上存主权重、m、v 以及 fp32 梯度分片，共 16 字节/参数。

# %%
K, N = 12, 8
configs = {
    "DP, 1 GPU": (dict(stage=0), (2 + 2 + K) * PSI),
    "ZeRO-1, 8 GPUs": (dict(stage=1, world_size=N), (2 + 2) * PSI + K * PSI // N),
    "ZeRO-2, 8 GPUs": (dict(stage=2, world_size=N), 2 * PSI + (2 + K) * PSI // N),
    "ZeRO-3, 8 GPUs": (dict(stage=3, world_size=N), (2 + 2 + K) * PSI // N),
    "ZeRO-2 + offload, 1 GPU": (dict(stage=2, offload_optimizer="cpu"), 2 * PSI),
}
estimates = {}
print(f"{'configuration':<26}{'device':>12}{'formula':>12}{'host':>12}")
for name, (kwargs, formula) in configs.items():
    e = estimates[name] = estimate_model_states(PSI, precision="fp16", **kwargs)
    print(f"{name:<26}{format_gb(e.device):>12}{format_gb(formula):>12}{format_gb(e.host):>12}")
    assert e.device == formula

path = plot_model_states(estimates, OUT / "model_states_13b.png", capacity=80e9,
                         title="13B parameters, fp16 + Adam: model states on one rank")
display(Image(filename=str(path)))

# %% [markdown]
# 虚线是一张 80 GB 显卡的容量。可以看到：
#
# - 分片让每卡的负担随 N 下降，但 8 张卡加起来仍是 16Ψ，一个字节也没少；
# - 单卡 stage 2 + CPU 卸载时，设备上只剩 26 GB 的 fp16 参数；主机上是 **16Ψ = 208 GB**：
#   主权重、m、v 各 52 GB，外加 52 GB 的 fp32 梯度分片（CPU 上的 Adam 读的是 fp32 梯度）。
#   主机内存要按 16 字节/参数预留，这正是导言"16～20 字节/参数"经验值的来源。

# %% [markdown]
# ## 2. 不要只信估算：训练一个小 GPT，实测每一个字节
#
# 估算器只是算术。引擎在分配每一块缓冲时都把它登记进内存账本（`MemoryLedger`），账本按张量的**底层存储**
# 统计字节数。下面用 fp16 配置训练一个约 83 万参数的小 GPT（`TinyGPT("tiny")`），设备是模拟设备
# （`EmulatedAccelerator`：张量实际在主机内存里，但每个"上设备"的字节都记账），语料是本课程自己的 Markdown 文本。

# %%
BATCH = 8
TRAIN_STEPS = 2 if SMOKE else 20
fp16_config = {
    "train_batch_size": BATCH,
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
model = TinyGPT("tiny")
n_params = model.cfg.num_params()
engine = zo.initialize(model, fp16_config, accelerator=EmulatedAccelerator())
data = ByteBatches(load_corpus(), model.cfg.seq_len)
print(f"TinyGPT('tiny'): {n_params:,} parameters, corpus {len(data.data):,} bytes (train split)")

start = time.perf_counter()
for step in range(TRAIN_STEPS):
    x, y = data.global_batch(step, BATCH)
    loss = lm_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    if step % 5 == 0 or step == TRAIN_STEPS - 1:
        print(f"step {step:>3}  loss {loss.item():.3f}  loss scale {engine.scaler.scale:.0f}")
print(f"{TRAIN_STEPS} steps in {time.perf_counter() - start:.1f} s")

# %%
report = engine.memory_report()
print(report)
print()
print(f"{'state':<16}{'estimated':>12}{'measured':>12}{'bytes/param':>13}")
for state in report.estimated.bytes:
    want, got = report.estimated.bytes[state]["device"], report.measured.bytes[state]["device"]
    print(f"{state:<16}{want:>12,}{got:>12,}{got / n_params:>13.0f}")
print(f"{'total':<16}{report.estimated.total:>12,}{report.measured.total:>12,}{report.measured.total / n_params:>13.0f}")
assert report.measured.bytes == report.estimated.bytes
print("\nmeasured == estimated, byte for byte")

# %% [markdown]
# 账本与估算逐字节相等，每参数正好 16 字节。报告最后一行的峰值（peak）比模型状态大，
# 多出来的是前向到反向之间的激活值（Adam 步里临时的 fp32 梯度更小，而且与激活值不同时存在），第 6 节再细看。
#
# 纯 fp32 训练呢？此时参数自己就是主权重，不再另存一份，但参数和梯度各占 4 字节，合计 4 + 4 + 4 + 4 = 16 字节，
# 还是 16。`MemoryLedger.from_torch` 可以直接给普通的 PyTorch 模型和 `torch.optim.Adam` 记账：

# %%
plain = TinyGPT("tiny")  # fp32, no engine
optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
x, y = data.global_batch(0, BATCH)
lm_loss(plain(x), y).backward()
optimizer.step()  # Adam allocates exp_avg and exp_avg_sq on its first step
plain_bytes = MemoryLedger.from_torch(plain, optimizer).measure()
print(plain_bytes.table())
print(f"\n{plain_bytes.total:,} bytes for {n_params:,} parameters = {plain_bytes.total / n_params:.0f} bytes/param")
print("(here 'device' is wherever the model lives: the CPU)")

# %% [markdown]
# ## 3. 朴素的 Adam，以及 Adam 与 AdamW 之别
#
# `zero_offload.basics.adam` 把 Adam 一步拆成四小步，顺序写在模块文档里（实现就是实验 Lab 1.1 和 Lab 1.2 要你写的代码，
# 这里只看公式）：

# %%
print(adam_module.__doc__)

# %% [markdown]
# 先验证这个朴素实现与 PyTorch 一致：同一个初始权重、同一串 100 个随机梯度，分别交给
# `zero_offload.basics.Adam` 和 PyTorch 的优化器，比较最终权重。
#
# 比较时用"最大绝对误差 / 权重的最大绝对值"，而不是逐元素的相对误差：有些元素恰好经过 0 附近，
# 逐元素相对误差会被一个接近 0 的分母放大，说明不了任何问题。

# %%
ADAM_STEPS = 100
gen = torch.Generator().manual_seed(0)
p0 = torch.randn(10_000, generator=gen)
grads = [torch.randn(10_000, generator=gen) for _ in range(ADAM_STEPS)]
hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def train(make_optimizer) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    opt = make_optimizer([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


ours_w, torch_w = train(lambda ps: Adam(ps, adamw=True, **hyper)), train(lambda ps: torch.optim.AdamW(ps, **hyper))
ours_l2, torch_l2 = train(lambda ps: Adam(ps, **hyper)), train(lambda ps: torch.optim.Adam(ps, **hyper))
print(f"{ADAM_STEPS} steps, {p0.numel():,} weights, weight_decay {hyper['weight_decay']}")
print(f"Adam(adamw=True) vs torch.optim.AdamW: max|diff| / max|w| = {rel_diff(ours_w, torch_w):.1e}")
print(f"Adam(adamw=False) vs torch.optim.Adam: max|diff| / max|w| = {rel_diff(ours_l2, torch_l2):.1e}")
print(f"float32 machine epsilon:                               {torch.finfo(torch.float32).eps:.1e}")
print(f"Adam vs AdamW (different optimizers!):  max|diff| / max|w| = {rel_diff(ours_l2, ours_w):.1e}")

# %% [markdown]
# 朴素实现与 PyTorch 的差别在 float32 舍入误差的量级（机器精度 1.2e-7 附近），而同样的超参数下，
# Adam 与 AdamW 的结果相差在 1e-2 量级：两者是**不同的优化器**，区别只在权重衰减放在哪里。
#
# - **Adam（L2 正则）**：`g ← g + wd·p`，衰减项混进梯度，随后进入 m 和 v，并被 √v 归一化；
# - **AdamW（解耦衰减）**：`p ← p·(1 − lr·wd)`，直接收缩权重，m 和 v 看不到它。
#
# 归一化带来的后果很具体。下面两个权重都从 1.0 开始：第一个每步有标准差为 10 的梯度噪声（梯度大的参数），
# 第二个梯度恒为 0（比如一行从没出现过的词嵌入）。第一行不加权重衰减，作为参照。

# %%
DECAY_STEPS = 100
noise = [torch.tensor([10 * float(torch.randn((), generator=gen)), 0.0]) for _ in range(DECAY_STEPS)]
for label, adamw, wd in (("no decay", False, 0.0), ("Adam (L2)", False, 0.1), ("AdamW", True, 0.1)):
    p = torch.nn.Parameter(torch.ones(2))
    opt = Adam([p], lr=1e-2, weight_decay=wd, adamw=adamw)
    for g in noise:
        p.grad = g.clone()
        opt.step()
    print(f"{label:<10} after {DECAY_STEPS} steps: noisy weight {p[0].item():+.3f}, "
          f"zero-gradient weight {p[1].item():+.3f}")
print(f"AdamW's pure decay would leave (1 - lr*wd)^{DECAY_STEPS} = {(1 - 1e-2 * 0.1) ** DECAY_STEPS:.3f}")

# %% [markdown]
# 在 Adam（L2）下，梯度为 0 的那个权重，其"梯度"只剩 `wd·p`，除以它自己的 √v 后是一个接近 1 的数，
# 于是每步几乎走满 lr 那么远，被拉低得远比 AdamW 厉害；而有噪声的权重，衰减项 `wd·p` ≈ 0.1 与标准差为 10 的梯度
# 相比微不足道，除以 √v 后几乎不起作用，结果与不加衰减相差无几。衰减的实际强度取决于梯度大小，
# 这不是我们想要的正则化。AdamW 对两者一视同仁：每步乘以 (1 − lr·wd)，有噪声的权重也比不加衰减时小了约这个比例。
# 这就是大模型训练普遍用 AdamW 的原因。
#
# **DeepSpeed 的约定**：配置里写 `"type": "Adam"` 时，DeepSpeed 默认 `adam_w_mode = true`，实际跑的是 AdamW；
# 要真正的 L2 式 Adam，必须显式写 `"adam_w_mode": false`。本课程的配置加载器遵循同样的约定：

# %%
for opt_type, params in (
    ("Adam", {"weight_decay": 0.1}),
    ("Adam", {"weight_decay": 0.1, "adam_w_mode": False}),
    ("AdamW", {"weight_decay": 0.1}),
):
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": opt_type, "params": params}})
    print(f'"type": {opt_type!r:<8} params {params!s:<45} -> decoupled decay (adamw): {cfg.optimizer.adamw}')

# %% [markdown]
# ## 4. 为什么非要 fp32 主权重
#
# fp16 只有 10 位尾数。在 1.0 附近，相邻两个 fp16 数的间距（1 个 ulp）是 2^-10 ≈ 9.8e-4。
# 一次加法的结果要舍入到最近的可表示数，所以小于半个 ulp（≈ 4.9e-4）的增量直接被舍掉。
# 而 Adam 每步的更新幅度约等于学习率，大模型常用的学习率正是 1e-4 量级。

# %%
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    ulp = torch.finfo(dtype).eps  # spacing of representable numbers just above 1.0
    print(f"{str(dtype):<15} spacing at 1.0: {ulp:.2e}   half of it: {ulp / 2:.2e}")
one = torch.tensor(1.0, dtype=torch.float16)
for delta in (4.8e-4, 4.9e-4):
    print(f"fp16: 1.0 + {delta:.1e} = {(one + torch.tensor(delta, dtype=torch.float16)).item():.6f}")

# %% [markdown]
# 现在做 1000 次 `w ← w + 1e-4`：一份直接在 fp16 里累加；一份在 fp32 主权重里累加，每步再把主权重舍入成
# fp16 副本（这就是混合精度训练的做法：前向用 fp16 副本，更新作用在 fp32 主权重上）。

# %%
UPDATES, DELTA = 1000, 1e-4
w16 = torch.tensor(1.0, dtype=torch.float16)
master = torch.tensor(1.0, dtype=torch.float32)
traj = {"fp16 weight updated in place": [], "fp32 master weight": [], "fp16 copy of the master": []}
for _ in range(UPDATES):
    w16 = w16 + torch.tensor(DELTA, dtype=torch.float16)
    master = master + DELTA
    traj["fp16 weight updated in place"].append(w16.item())
    traj["fp32 master weight"].append(master.item())
    traj["fp16 copy of the master"].append(master.half().item())
print(f"exact after {UPDATES} updates: {1 + UPDATES * DELTA:.4f}")
for label, values in traj.items():
    print(f"{label:<30} {values[-1]:.4f}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
for ax, last in zip(axes, (UPDATES, 30), strict=True):  # right: the first updates, to see the fp16 steps
    for (label, values), style in zip(traj.items(), ("-", "--", "-"), strict=True):
        ax.plot(range(1, last + 1), values[:last], style, label=label, drawstyle="steps-post")
    ax.set_xlabel("update")
    ax.set_ylabel("weight")
    ax.grid(alpha=0.3)
axes[0].set_title(f"w <- w + {DELTA:g}, starting from 1.0")
axes[1].set_title(f"the first 30 updates (fp16 spacing at 1.0 = {torch.finfo(torch.float16).eps:.2e})")
axes[0].legend()
show(fig, "master_weights.png")

# %% [markdown]
# fp16 里原地累加的权重一动不动：每次加 1e-4 都被舍回 1.0，1000 次更新全部丢失。fp32 主权重的 ulp 在 1.0 附近是
# 1.2e-7，1e-4 的增量被完整保留；它的 fp16 副本呈阶梯状前进，每积累够半个 fp16 ulp 就跳一格，长期看跟上了真实值。
# 这就是每个参数多花 4 字节的理由。bf16 的间距更大（7.8e-3），同样需要 fp32 主权重。

# %% [markdown]
# ## 5. fp16 的范围与动态损失缩放
#
# fp16 只有 5 位指数，可表示的范围很窄；bf16 的指数位与 fp32 相同，范围一样宽，只是精度更低。

# %%
print(f"{'dtype':<16}{'max':>12}{'smallest normal':>18}{'smallest subnormal':>20}")
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    fi = torch.finfo(dtype)
    print(f"{str(dtype):<16}{fi.max:>12.3g}{fi.tiny:>18.3g}{fi.tiny * fi.eps:>20.3g}")

# %% [markdown]
# 小于约 3e-8（最小次正规数 2^-24 的一半）的值在 fp16 里直接变成 0。反向传播产生的梯度里常有这么小的数。
# 把损失乘以 S，链式法则让每个梯度也乘以 S，把它们抬进 fp16 的范围；优化器在 fp32 里再除以 S。
# 代价是：本来就大的梯度乘以 S 后可能超过 65504，变成 inf。

# %%
true_grads = torch.tensor([1.0, 1e-3, 1e-6, 1e-8, 1e-9])
S = 2.0**16
stored = true_grads.half()
scaled = (true_grads * S).half()
print("true gradient        ", [f"{v:.1e}" for v in true_grads.tolist()])
print("stored in fp16       ", [f"{v:.1e}" for v in stored.float().tolist()])
print("scaled by 2^16, fp16  ", [f"{v:.1e}" for v in scaled.float().tolist()])
print("unscaled in fp32     ", [f"{v:.1e}" for v in (scaled.float() / S).tolist()])

# %% [markdown]
# 1e-8 和 1e-9 不缩放就丢了，缩放后都活了下来；但 1.0 × 2^16 = 65536 超过了 fp16 的最大值 65504，成了 inf。
# 所以缩放因子不能固定，要**动态**调整：出现 inf/nan 就跳过这一步、调小 S；连续一段时间没有溢出就调大 S。
#
# 下面故意把初始缩放设得极大（`"initial_scale_power": 32`，即 S = 2^32），看引擎怎样一步步退下来。
# 对每一个被跳过的步，我们都检查 fp32 主权重和 Adam 的 m、v 是否逐位不变。

# %%
SCALE_STEPS = 6 if SMOKE else 40
scale_config = {
    "train_batch_size": BATCH,
    "fp16": {"enabled": True, "initial_scale_power": 32},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
engine = zo.initialize(TinyGPT("tiny"), scale_config, accelerator=EmulatedAccelerator())
losses, untouched = [], []
for step in range(SCALE_STEPS):
    x, y = data.global_batch(step, BATCH)
    states = engine.states
    before = [t.clone() for t in (states.master, states.exp_avg, states.exp_avg_sq)]
    loss = lm_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    if engine.history[-1]["overflow"]:
        after = (states.master, states.exp_avg, states.exp_avg_sq)
        untouched.append(all(torch.equal(b, a) for b, a in zip(before, after, strict=True)))

for record in engine.history[:20]:
    mark = "overflow -> skipped" if record["overflow"] else f"grad norm {record['grad_norm']:.2f}"
    print(f"step {record['step']:>3}  scale 2^{math.log2(record['loss_scale']):<4.0f} {mark}")
print(f"skipped steps: {engine.skipped_steps} of {engine.global_steps}; final scale {engine.scaler.scale:.0f}")
print(f"skipped steps that left master weights, m and v bit-identical: {sum(untouched)} of {len(untouched)}")
assert all(untouched) and len(untouched) == engine.skipped_steps

# %%
steps = [r["step"] for r in engine.history]
scales = [r["loss_scale"] for r in engine.history]
over = [r["step"] for r in engine.history if r["overflow"]]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
ax1.step(steps, scales, where="post", label="loss scale used")
ax1.scatter(over, [r["loss_scale"] for r in engine.history if r["overflow"]], color="tab:red", zorder=3,
            label="overflow: step skipped")
ax1.set_yscale("log", base=2)
ax1.set_ylabel("loss scale")
ax1.set_title('fp16, "initial_scale_power": 32, hysteresis 2')
ax1.legend()
ax1.grid(alpha=0.3)
ax2.plot(steps, losses, marker=".")
ax2.set_xlabel("step")
ax2.set_ylabel("loss (nats/byte)")
ax2.grid(alpha=0.3)
show(fig, "loss_scale.png")

# %% [markdown]
# 第 0 步溢出后缩放因子并没有马上减半：DeepSpeed 的 `hysteresis`（默认 2）允许容忍一次溢出，耐心用完后每次溢出都减半。
# 溢出期间 loss 停在初始值附近（权重没被更新），缩放因子降到不再溢出后，loss 才开始下降。
#
# 耐心（hysteresis）什么时候恢复？直接驱动 `DynamicLossScaler` 看得最清楚。下面用同一串事件（`o` 表示溢出，
# `.` 表示正常步）喂给三种设置，`scale_window = 4` 表示连续 4 个正常步后缩放因子翻倍：

# %%
events = "o.o......oo"
print(f"{'step':<38}" + " ".join(f"{i:>5}" for i in range(len(events))))
print(f"{'event':<38}" + " ".join(f"{e:>5}" for e in events))
for hysteresis, consecutive in ((1, False), (2, False), (2, True)):
    scaler = DynamicLossScaler(2.0**10, hysteresis=hysteresis, consecutive_hysteresis=consecutive, scale_window=4)
    trace = []
    for event in events:
        scaler.update(event == "o")
        trace.append(int(scaler.scale))
    label = f"hysteresis={hysteresis}, consecutive={consecutive}"
    print(f"{label:<38}" + " ".join(f"{s:>5}" for s in trace))

# %% [markdown]
# - `hysteresis=1`：每次溢出都立刻减半；
# - `hysteresis=2`：第 0 步的溢出只消耗耐心，第 2 步再溢出才减半；耐心只在缩放因子增长时恢复，
#   所以第 9、10 步连续溢出时，第一次被容忍、第二次减半；
# - `consecutive_hysteresis=true`：每个正常步都恢复耐心，于是被正常步隔开的零星溢出永远不会让缩放因子下降。

# %% [markdown]
# ## 6. 模拟设备与"显存不足"
#
# 模拟设备有一个字节预算。引擎按 GPU 的填充顺序分配：参数、梯度、主权重、优化器状态；超出预算时抛出
# `DeviceOutOfMemoryError`（它是 `torch.OutOfMemoryError` 的子类），报错写明在为哪类状态分配、已经占用了什么，
# 并给出能缓解的配置项。`TinyGPT("small")` 约 480 万参数，模型状态约 74 MiB，放进 32 MiB 的预算：

# %%
small = TinyGPT("small")
n_small = small.cfg.num_params()
budget = 32 * 2**20
print(f"TinyGPT('small'): {n_small:,} parameters, model states {format_bytes(16 * n_small)}, "
      f"budget {format_bytes(budget)}\n")
try:
    zo.initialize(small, fp16_config, accelerator=EmulatedAccelerator(budget))
except DeviceOutOfMemoryError as err:
    print(textwrap.fill(str(err), 100))

# %% [markdown]
# fp16 参数和梯度（各约 9 MiB）放下了，fp32 主权重放不下。提示指向 `stage 2` + `offload_optimizer: cpu`：
# 它把主权重、m、v（以及 fp32 梯度分片）移到主机，正是第 3 模块要实现的功能。
#
# 激活值另算。模拟设备在前向期间用 PyTorch 的 saved-tensor hook 记录 autograd 为反向保存的每个张量，
# 按**存储精度**计费（fp16 运行时每个元素 2 字节），反向用完后自动退还。在我们的 Transformer 块里，
# 每层保存的张量加起来约是 16 个 b·s·h 大小的张量（b 批大小、s 序列长度、h 隐藏维度；推导见 `course/01-basics.md` 1.1.5 节），
# 最后的 LayerNorm 再加 2 个。下面把实测值与这个估计比较：

# %%
def activation_bytes(batch: int) -> int:
    """Device bytes charged for activations after the forward pass; checks that backward gives them back."""
    accel = EmulatedAccelerator()
    eng = zo.initialize(TinyGPT("tiny"), fp16_config, accelerator=accel)
    x, y = data.global_batch(0, batch)
    logits = eng(x)
    charged = accel.memory_stats().by_category["activations"]
    eng.backward(lm_loss(logits, y))  # backward frees what autograd saved
    assert accel.memory_stats().by_category["activations"] == 0
    return charged


cfg = TinyGPT("tiny").cfg
print(f"{'batch':>5}{'measured':>14}{'2*(16L+2)*b*s*h':>18}{'ratio':>8}")
for batch in (4,) if SMOKE else (4, 8, 16, 32):
    measured = activation_bytes(batch)
    rough = 2 * (16 * cfg.n_layer + 2) * batch * cfg.seq_len * cfg.d_model
    print(f"{batch:>5}{format_bytes(measured):>14}{format_bytes(rough):>18}{measured / rough:>8.3f}")

# %% [markdown]
# 激活值与批大小成正比；余下不到 1% 的差额是 LayerNorm 的均值、方差和注意力的 logsumexp 这类小张量。
# 激活值超出预算时，报错给出的是另一条提示：减小微批大小，或打开激活重计算（第 2 模块）：

# %%
accel = EmulatedAccelerator(96 * 2**20)  # room for the 74 MiB of states, not for a large batch's activations
eng = zo.initialize(TinyGPT("small"), fp16_config, accelerator=accel)
x, _ = data.global_batch(0, 16)
print(f"input batch {tuple(x.shape)}, budget {format_bytes(accel.capacity)}\n")
try:
    eng(x)
except DeviceOutOfMemoryError as err:
    print(textwrap.fill(str(err), 100))

# %% [markdown]
# 最后一点：模拟设备按 fp16 **存储**，却按 fp32 **计算**（每层在用到时临时把权重上转为 fp32，这些临时副本不记账）。
# 原因是没有 AVX-512 的 CPU 做低精度矩阵乘非常慢。在你的机器上测一下（与模型里 `nn.Linear` 走同一个 `F.linear`）：

# %%
print(f"emulated device computes fp16 layers in: {EmulatedAccelerator().compute_dtype(torch.float16)}")
SIZE, REPEATS = (512, 3) if SMOKE else (1024, 5)
x, w = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    xd, wd = x.to(dtype), w.to(dtype)
    F.linear(xd, wd)  # warm-up
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        F.linear(xd, wd)
        times.append(time.perf_counter() - t0)
    gflops = 2 * SIZE**3 / statistics.median(times) / 1e9
    print(f"{str(dtype):<15} {gflops:7.1f} GFLOP/s  ({SIZE}x{SIZE} @ {SIZE}x{SIZE}, median of {REPEATS})")

# %% [markdown]
# ## 小结
#
# - 混合精度 Adam 每参数 16 字节：fp16 参数 2 + fp16 梯度 2 + fp32 主权重 4 + m 4 + v 4。13B 模型是 208 GB，
#   导言的 156 GB 漏掉了 52 GB 的主权重。纯 fp32 训练同样是 16 字节。
# - 估算器与账本逐字节一致；ZeRO 分片把每卡字节数按公式降下来，CPU 卸载把 16Ψ 整体挪到主机。
# - 朴素 Adam 与 PyTorch 在 float32 舍入误差内一致；AdamW 的解耦衰减与 Adam 的 L2 是两种优化器，
#   DeepSpeed 的 `"type": "Adam"` 默认就是 AdamW。
# - fp32 主权重让小于半个 fp16 ulp 的更新不被舍掉；损失缩放让小梯度不下溢，溢出的步整步跳过，权重与 m、v 不变。
# - 模拟设备按 GPU 的方式记账（包括激活值），超预算时的报错指向能缓解的配置项。
#
# ## 接下来：实验 1
#
# 在仓库根目录运行 `make lab1` 为实验 1 评分（`make lab1 LAB_DIR=solutions` 看参考答案的满分表）。四个任务：
#
# | 任务 | 内容 | 文件 |
# |---|---|---|
# | Lab 1.1 | Adam 的一阶、二阶矩更新 | `labs/lab1/basics/adam.py` |
# | Lab 1.2 | 偏差校正与参数更新，Adam 与 AdamW | `labs/lab1/basics/adam.py` |
# | Lab 1.3 | 各层存储的模型状态字节数 | `labs/lab1/basics/memory.py` |
# | Lab 1.4 | 损失缩放的溢出处理 | `labs/lab1/basics/precision.py` |
#
# 卡住时运行 `grep -rn "Lab 1.3"`，就能同时找到实验桩、第 1 章里讲解它的段落和评分测试。
# 原理的完整推导见 `course/01-basics.md`。
