"""Where offload sits among data, tensor and pipeline parallelism: a rough layout model for perfmodel.plan.

A layout splits the job's GPUs (hw.gpus per host x hw.nodes hosts) into tp x pp x dp. Ranks are numbered tp
first, then dp, then pp (as Megatron-LM does), so a TP group sits inside one host, a DP group stays inside a
host while tp x dp <= the host's GPUs, and with several hosts the pipeline crosses between them.

  model states  tensor parallelism splits each layer's matrices tp ways, pipeline parallelism gives each stage
                layers / pp: one GPU holds P / (tp x pp) parameters, which ZeRO then shards over dp.
  batch         every layout trains the same global batch, hw.gpus x nodes micro-batches of wl.batch
                sequences a step: a pipeline (tp x pp GPUs) runs m = tp x pp of them.
  TP            per layer and micro-batch, 2 all-reduces of the activations (batch x seq x hidden, 16-bit)
                forward and 2 backward (2 more when recomputing), each 2 (tp-1)/tp of them over NVLink.
  PP            the bubble: a 1F1B pipeline idles (pp-1) / (m+pp-1) of its time, (pp-1) / m of the compute;
                and each stage sends an activation forward and a gradient backward per micro-batch, over
                NVLink within a host, over the inter-node network between hosts.
  DP            the ZeRO collectives (perfmodel.py) on P / (tp x pp) over dp ranks, at NVLink speed inside
                a host, at the inter-node bandwidth per GPU once the DP group spans hosts.
  activations   Korthikanti et al. 2022: tensor parallelism without sequence parallelism keeps
                (10 + 24 / tp) / 34 of a layer's activations; a 1F1B stage keeps min(m, pp) micro-batches
                of its layers / pp in flight.

TP and PP communication and the bubble stall the GPU (they are added to its busy time); DP collectives
overlap as in perfmodel.py. Rough on purpose: no sequence parallelism, no interleaved pipeline schedule, no
hierarchical collectives, one micro-batch size. DeepSpeed's pipeline engine takes ZeRO stage 0 or 1 only.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUT_TP = (1, 2, 4, 8)  # the tensor- and pipeline-parallel sizes the layouts table tries
LAYOUT_PP = (1, 2, 4)


@dataclass(frozen=True)
class Layout:
    """tp x pp x dp; dp is what is left of the job's GPUs. micro_batches: None for tp x pp (module docstring)."""

    tp: int = 1
    pp: int = 1
    micro_batches: int | None = None

    @property
    def micro(self) -> int:
        return self.micro_batches or self.tp * self.pp

    def dp(self, hw) -> int:
        return hw.gpus * hw.nodes // (self.tp * self.pp)

    def check(self, hw, stage: int) -> None:
        if self.tp < 1 or self.pp < 1 or self.micro < 1:
            raise ValueError("tp, pp and micro_batches must each be at least 1")
        if hw.gpus % self.tp:
            raise ValueError(f"tp {self.tp} must divide the {hw.gpus} GPUs of a host: TP stays inside one")
        if (hw.gpus * hw.nodes) % (self.tp * self.pp):
            raise ValueError(f"tp x pp = {self.tp * self.pp} must divide the job's {hw.gpus * hw.nodes} GPUs")
        if self.pp > 1 and stage >= 2:
            raise ValueError("DeepSpeed's pipeline engine takes ZeRO stage 0 or 1 only (pp > 1)")

    @property
    def label(self) -> str:
        return f"tp {self.tp}, pp {self.pp}"


def dp_link_gb_per_s(hw, layout: Layout) -> float:
    """The DP collectives' bandwidth per GPU: NVLink inside a host, the inter-node network across hosts."""
    inside = layout.tp * layout.dp(hw) <= hw.gpus
    return hw.gpu_link_gb_per_s if inside or not hw.inter_node_gb_per_s else hw.inter_node_gb_per_s


def model_parallel_seconds(hw, wl, layout: Layout, low: int) -> float:
    """TP all-reduces and PP sends of one step on one GPU, in seconds (module docstring)."""
    hidden, layers = wl.shape()
    activation = wl.batch * wl.seq_len * hidden * low  # bytes of one layer's output, one micro-batch
    seconds = 0.0
    if layout.tp > 1:
        per_layer = (6 if wl.recompute else 4) * 2 * (layout.tp - 1) / layout.tp * activation
        seconds += layout.micro * layers / layout.pp * per_layer / (hw.gpu_link_gb_per_s * 1e9)
    if layout.pp > 1:
        link = hw.inter_node_gb_per_s if hw.nodes > 1 and hw.inter_node_gb_per_s else hw.gpu_link_gb_per_s
        seconds += layout.micro * 2 * activation / (link * 1e9)
    return seconds


def bubble_share(layout: Layout) -> float:
    """The pipeline's idle time over its compute: (pp-1) / m."""
    return (layout.pp - 1) / layout.micro


def activation_factor(layout: Layout) -> float:
    return (10 + 24 / layout.tp) / 34 * min(layout.micro, layout.pp) / layout.pp


def layouts(hw) -> list[Layout]:
    """The (tp, pp) the layouts table tries on hw: TP inside a host, tp x pp dividing the job's GPUs."""
    world = hw.gpus * hw.nodes
    return [
        Layout(tp, pp) for tp in LAYOUT_TP for pp in LAYOUT_PP if hw.gpus % tp == 0 and world % (tp * pp) == 0
    ]
