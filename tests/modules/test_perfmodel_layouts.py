"""The performance model's NUMA sockets and its rough parallel layouts (tuning/hardware.py, tuning/parallel.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zero_offload.cli import main
from zero_offload.tuning import parallel
from zero_offload.tuning.advisor import advise, plan_layouts
from zero_offload.tuning.parallel import Layout
from zero_offload.tuning.perfmodel import PRESETS, Workload, calibrate, plan, plan_all
from zero_offload.tuning.plan_report import describe, format_layouts

B = 10**9
A100 = PRESETS["a100-80g"]  # 2 sockets of 204.8 GB/s: 4.39 Gparam/s of CPU Adam each
ONE = replace(A100, gpus=1)


# -- NUMA: a rank draws on its own socket ------------------------------------------------------------------
def test_a_rank_gets_its_own_sockets_share():
    socket = A100.cpu_adam_params_per_s / 2
    assert A100.cpu_adam_rank_share() == pytest.approx(socket / 4)  # 8 ranks, 4 a socket: as host / 8
    assert ONE.cpu_adam_rank_share() == pytest.approx(socket)  # alone: one socket, not both
    assert replace(A100, gpus=3).cpu_adam_rank_share() == pytest.approx(socket / 2)  # the busier socket
    assert replace(ONE, sockets=1).cpu_adam_rank_share() == pytest.approx(A100.cpu_adam_params_per_s)
    # Spread over both sockets (interleaved memory): both, at most 4 x the link at 60% over 28 bytes.
    assert replace(ONE, numa_spread=True).cpu_adam_rank_share() == pytest.approx(2 * socket)
    narrow = replace(ONE, numa_spread=True, socket_link_gb_per_s=20)
    assert narrow.cpu_adam_rank_share() == pytest.approx(0.6 * 20e9 / 28 * 4)
    assert replace(A100, numa_spread=True).cpu_adam_rank_share() == A100.cpu_adam_rank_share()  # 8 ranks
    for preset in PRESETS.values():
        assert preset.sockets == 2 and preset.inter_node_gb_per_s and preset.socket_link_gb_per_s


def test_one_rank_on_two_sockets_takes_twice_as_long_as_spread():
    wl = Workload(13 * B, units=1)
    bound = plan(replace(ONE, cpu_adam_threads=16), wl, 2, "optimizer").time.cpu_adam
    spread = plan(replace(ONE, cpu_adam_threads=16, numa_spread=True), wl, 2, "optimizer").time.cpu_adam
    assert bound == pytest.approx(30e-6 + 13 * B / (A100.cpu_adam_params_per_s / 2))
    assert spread == pytest.approx(30e-6 + 13 * B / A100.cpu_adam_params_per_s)


def test_the_numa_advice_names_the_launcher_flag_and_the_spread_speed():
    wl = Workload(13 * B)
    advice = {a.rule: a for a in advise(ONE, wl, plan(ONE, wl, 2, "optimizer"), plan_all(ONE, wl))}
    message = advice["numa"].message
    assert "deepspeed --bind_cores_to_rank" in message and "2 sockets of 205 GB/s" in message
    assert "reaches up to 8.78" in message and "numactl --interleave=all" in message
    one_socket = replace(ONE, sockets=1)
    assert "numa" not in {a.rule for a in advise(one_socket, wl, plan(one_socket, wl, 2, "optimizer"), [])}
    assert "in 2 sockets of 205" in describe(ONE, wl) and "each rank its own socket's" in describe(ONE, wl)


def test_calibrated_figures_are_one_process_and_one_socket():
    hw = calibrate(A100, threads=1, numel=1 << 18, repeats=1)
    assert hw.sockets == 1 and hw.cpu_adam_rank_share() == pytest.approx(hw.cpu_adam_params_per_s / 8)


# -- layouts: DP x TP x PP ---------------------------------------------------------------------------------
def test_the_default_layout_is_plain_data_parallelism():
    wl = Workload(13 * B)
    for stage, offload in ((0, "none"), (2, "optimizer"), (3, "optimizer+param")):
        default, explicit = (
            plan(A100, wl, stage, offload),
            plan(A100, wl, stage, offload, layout=Layout(1, 1, 1)),
        )
        assert (default.time, default.device_bytes, default.host_bytes) == (
            explicit.time,
            explicit.device_bytes,
            explicit.host_bytes,
        )
        assert plan(A100, wl, stage, offload).time.model_parallel == 0


def test_tp_and_pp_divide_the_model_before_zero_shards_it():
    wl, tp2pp2 = Workload(8 * B), Layout(tp=2, pp=2)
    p = plan(A100, wl, 1, "optimizer", layout=tp2pp2)  # 8 GPUs: dp 2, a piece of 2B parameters
    assert tp2pp2.dp(A100) == 2 and tp2pp2.micro == 4
    assert p.states.device == 2 * 2 * B  # fp16 weights of the piece
    assert p.states.host == 16 * B  # 16 bytes a parameter of the dp shard: 1B parameters
    assert p.host_bytes == 8 * (16 * B + 4 * B)  # 8 ranks a host, 16 + 4 bytes each
    # compute: the same work per GPU as dp 8 (4 micro-batches of a quarter of the model), plus a bubble
    assert p.time.compute == pytest.approx(plan(A100, wl, 1, "optimizer").time.compute)
    assert p.time.bubble == pytest.approx(p.time.compute * (2 - 1) / 4)
    # gradients go down every micro-batch, the weights up once
    assert p.time.pcie_down == pytest.approx(4 * p.time.pcie_up)


def test_tp_comm_is_the_activation_all_reduces_over_nvlink():
    wl = Workload(13 * B, batch=2, seq_len=512)
    hidden, layers = wl.shape()
    t = plan(A100, wl, 0, layout=Layout(tp=4, micro_batches=1)).time
    activation = 2 * 512 * hidden * 2
    assert t.model_parallel == pytest.approx(layers * 4 * 2 * 3 / 4 * activation / 240e9)
    assert t.busy()["GPU"] == pytest.approx(t.compute + t.gpu_adam + t.model_parallel)


def test_dp_collectives_cross_nodes_at_the_inter_node_bandwidth():
    wl, two = Workload(13 * B), replace(A100, nodes=2)
    inside, across = plan(A100, wl, 2).time.comm, plan(two, wl, 2).time.comm
    assert inside == pytest.approx(2 * 7 / 8 * 2 * 13 * B / 240e9)
    assert across == pytest.approx(2 * 15 / 16 * 2 * 13 * B / 20e9)
    assert parallel.dp_link_gb_per_s(two, Layout(tp=8)) == 20  # dp 2 across the hosts
    assert parallel.dp_link_gb_per_s(two, Layout(tp=4, pp=2)) == 240  # tp 4 x dp 2 inside a host


def test_impossible_layouts_are_errors():
    with pytest.raises(ValueError, match="stage 0 or 1 only"):
        plan(A100, Workload(B), 2, layout=Layout(pp=2))
    with pytest.raises(ValueError, match="TP stays inside one"):
        plan(A100, Workload(B), 0, layout=Layout(tp=16))
    with pytest.raises(ValueError, match="must divide"):
        plan(A100, Workload(B), 0, layout=Layout(tp=1, pp=3))


def test_the_layouts_table_tries_one_and_two_hosts(capsys):
    rows = plan_layouts(A100, Workload(13 * B))
    assert {hw.nodes for hw, *_ in rows} == {1, 2} and len(rows) == 9 + 11  # 16 GPUs: not tp 8 x pp 4
    single = plan_layouts(ONE, Workload(13 * B))
    assert [(hw.nodes, layout.tp, layout.pp) for hw, layout, *_ in single] == [
        (1, 1, 1),
        (2, 1, 1),
        (2, 1, 2),
    ]
    assert single[0][2].offload == "optimizer"  # one GPU: only offload fits
    table = format_layouts(rows)
    assert table.startswith("Parallel layouts (rough") and "bubble s" in table
    assert main(["plan", "--params", "13B", "--gpus", "1"]) == 0
    assert "Parallel layouts (rough" in capsys.readouterr().out
