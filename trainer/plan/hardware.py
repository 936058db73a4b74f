"""What a step runs on: GPU kinds (peak, the efficiency a training step reaches, memory
bandwidth) and the links a collective crosses (inside a node, between nodes), each figure with
its source. The step-time model (steptime.py) prices FLOPs and bytes with them.

    from trainer.plan.hardware import hardware
    hw = hardware("h100")                      # 8 x H100 SXM a node, NVLink 4, 400 Gb/s IB a GPU
    hw = hardware("a100", inter="efa-400-node", gpus_per_node=8, compute_tflops=170)
    hw.flops                                   # achieved FLOP/s a GPU: peak x efficiency

    python -m cluster.plan model=70b gpu=h100 network=roce-400 ...   # the planner's keys

Link bandwidths are what a collective reaches per GPU in one direction (NCCL's "bus
bandwidth"), not the line rate: a fraction of it (LINK_EFFICIENCY). Latencies are NCCL's own
tuning model (NVIDIA/nccl src/graph/tuning.cc, commit 01afd20, Simple protocol): a base of
8.4 us per collective, 3.4 us per ring step over NVLink, 5.7 over PCIe, 9.6 over the network,
50 us per level of the tree across nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from trainer.fsdp.config import fail

from .levers import HOST_BANDWIDTH_GBS, PCIE_GBS

BASE_LATENCY_US = 8.4
"""NCCL's base latency of a ring collective, Simple protocol (tuning.cc baseLat)."""
TREE_NET_LATENCY_US = 50.0
"""NCCL's latency of one tree level across the network, Simple protocol (tuning.cc hwLat)."""
LINK_EFFICIENCY = {"nvlink": 0.8, "pcie": 0.7, "network": 0.9}
"""The fraction of a link's line rate a large collective reaches: NCCL's in-node bus bandwidth on
8 x H100 (~360 of NVLink 4's 450 GB/s a direction) and on A100 (its model caps it at 235 of 300:
tuning.cc), ~0.9 of an RDMA NIC's rate, less over PCIe and sockets."""


@dataclass(frozen=True)
class Device:
    """One accelerator kind."""

    name: str
    peak_tflops: float
    """Dense bf16 tensor-core TFLOP/s (the vendor's datasheet, no sparsity)."""
    efficiency: float
    """The fraction of the peak a training step's kernels reach in eager PyTorch FSDP (model
    FLOPs and recomputation over time spent computing): one figure per kind, from published
    utilisations (DEVICES says which)."""
    memory_gbs: float
    """Device memory bandwidth a memory-bound kernel (the fused AdamW step) reaches, GB/s."""
    memory_gib: float
    overlap: bool = True
    """Collectives run beside compute (a GPU: copy engines, NIC and a few SMs). False for CPU
    workers on gloo, whose collectives run on the cores the compute uses."""
    source: str = ""


@dataclass(frozen=True)
class Link:
    """One kind of link, per GPU and direction."""

    name: str
    gbs: float
    """GB/s (10^9) a large collective reaches over it per GPU: line rate x LINK_EFFICIENCY."""
    step_latency_us: float
    """Latency of one ring step over it (NCCL's tuning model)."""
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    """A cluster's GPUs and links, as the step-time model reads them."""

    device: Device
    gpus_per_node: int
    intra: Link
    """Between the GPUs of a node."""
    inter: Link
    """Between nodes, per GPU (rail-optimised: each GPU its own NIC)."""
    achieved_tflops: Optional[float] = None
    """The achieved rate (compute_tflops), overriding peak x efficiency."""
    pcie_gbs: float = PCIE_GBS
    host_bandwidth_gbs: float = HOST_BANDWIDTH_GBS
    base_latency_us: float = BASE_LATENCY_US

    @property
    def flops(self) -> float:
        """FLOP/s one GPU computes at in a training step."""
        tflops = self.achieved_tflops or self.device.peak_tflops * self.device.efficiency
        return tflops * 1e12

    def describe(self) -> str:
        """One line: what the step time assumes."""
        d, rate = self.device, self.flops / 1e12
        how = (
            f"{d.peak_tflops:g} peak x {d.efficiency:.0%}"
            if self.achieved_tflops is None
            else "compute_tflops"
        )
        return (
            f"{self.gpus_per_node} x {d.name} a node at {rate:.0f} TFLOP/s ({how}); "
            f"{self.intra.name} {self.intra.gbs:g} GB/s inside a node, {self.inter.name} "
            f"{self.inter.gbs:g} GB/s a GPU between nodes"
        )


def _link(name: str, line_gbs: float, kind: str, latency_us: float, source: str) -> Link:
    return Link(name, round(line_gbs * LINK_EFFICIENCY[kind], 1), latency_us, source)


LINKS = {
    link.name: link
    for link in (
        _link("nvlink-4", 450, "nvlink", 3.4, "H100/H200 SXM: 18 NVLink 4 links, 450 GB/s a way"),
        _link("nvlink-3", 300, "nvlink", 3.4, "A100 SXM: 12 NVLink 3 links, 300 GB/s a way"),
        _link("pcie-4", 32, "pcie", 5.7, "PCIe Gen4 x16, 32 GB/s a way (no NVLink)"),
        _link("pcie-5", 64, "pcie", 5.7, "PCIe Gen5 x16, 64 GB/s a way (no NVLink)"),
        _link("ib-ndr-400", 50, "network", 9.6, "InfiniBand NDR, 400 Gb/s a GPU"),
        _link("ib-hdr-200", 25, "network", 9.6, "InfiniBand HDR, 200 Gb/s a GPU"),
        _link("roce-400", 50, "network", 9.6, "RoCE, 400 Gb/s a GPU (torchtitan's H100 hosts)"),
        _link("roce-200", 25, "network", 9.6, "RoCE, 200 Gb/s a GPU"),
        _link("efa-400-node", 50 / 8, "network", 9.6, "AWS p4d EFA: 400 Gb/s a node of 8"),
        _link("eth-400-node", 50 / 8, "network", 9.6, "400 Gb/s a node of 8 GPUs"),
        _link("eth-800-node", 100 / 8, "network", 9.6, "800 Gb/s a node of 8 GPUs"),
        _link("eth-100", 12.5, "pcie", 25.0, "100 Gb/s Ethernet a GPU, TCP sockets"),
    )
}
"""The links, by name (the planner's `intra=` and `network=` keys)."""

DEVICES = {
    d.name: d
    for d in (
        Device(
            "h100",
            989,
            0.40,
            2700,
            80,
            source="H100 SXM datasheet: 989 dense bf16, 3.35 TB/s HBM3 (~80% reached). Eager "
            "FSDP reaches 33-39% MFU on Llama 3.1 8B (torchtitan, 8 and 128 H100) and 37-45% "
            "HFU on Llama 2 7B-70B (fms-fsdp, 96 H100): 40%",
        ),
        Device(
            "h200",
            989,
            0.42,
            3900,
            141,
            source="H200 SXM: H100's tensor cores, 4.8 TB/s HBM3e; a few points over H100 for "
            "its bandwidth (not checked against a published eager run)",
        ),
        Device(
            "a100",
            312,
            0.60,
            1600,
            80,
            source="A100 SXM 80GB: 312 dense bf16, 2.0 TB/s HBM2e. Eager FSDP reaches 57-58% "
            "MFU on Llama 3 8B (torchtitan, 64 A100), 57-67% HFU on Llama 2 (fms-fsdp, 128 "
            "A100), ~55-60% on GPT-175B (the FSDP paper): 60%",
        ),
        Device(
            "a100-40",
            312,
            0.60,
            1250,
            40,
            source="A100 SXM 40GB: as the 80GB one, 1.55 TB/s HBM2",
        ),
        Device(
            "l40s",
            362,
            0.35,
            690,
            48,
            source="L40S: 362 dense bf16 (fp32 accumulate), 864 GB/s GDDR6; efficiency a guess "
            "(no published eager FSDP run checked)",
        ),
        Device(
            "rtx4090",
            165,
            0.35,
            800,
            24,
            source="RTX 4090: 165 dense bf16 with fp32 accumulate, 1.0 TB/s GDDR6X; efficiency "
            "a guess (no published eager FSDP run checked)",
        ),
    )
}
"""The GPU kinds, by name (the planner's `gpu=` key)."""

LINKS_OF = {
    "h100": ("nvlink-4", "ib-ndr-400"),
    "h200": ("nvlink-4", "ib-ndr-400"),
    "a100": ("nvlink-3", "ib-hdr-200"),
    "a100-40": ("nvlink-3", "efa-400-node"),
    "l40s": ("pcie-4", "roce-200"),
    "rtx4090": ("pcie-4", "eth-100"),
}
"""Each kind's usual node: (inside, between)."""


def hardware(
    gpu: str = "h100",
    gpus_per_node: int = 8,
    *,
    intra: Optional[str] = None,
    inter: Optional[str] = None,
    compute_tflops: Optional[float] = None,
    intra_gbs: Optional[float] = None,
    network_gbs: Optional[float] = None,
    pcie_gbs: float = PCIE_GBS,
    host_bandwidth_gbs: float = HOST_BANDWIDTH_GBS,
) -> Hardware:
    """A cluster of `gpu` nodes of `gpus_per_node`, its links by name (None: the kind's usual
    ones, LINKS_OF) or by rate (intra_gbs, network_gbs: GB/s a GPU)."""
    if gpu not in DEVICES:
        fail("gpu", gpu, ", ".join(DEVICES))
    usual_intra, usual_inter = LINKS_OF[gpu]
    links = {}
    for key, name in (("intra", intra or usual_intra), ("network", inter or usual_inter)):
        if name not in LINKS:
            fail(key, name, ", ".join(LINKS))
        links[key] = LINKS[name]
    if intra_gbs:
        links["intra"] = dataclasses.replace(links["intra"], gbs=intra_gbs)
    if network_gbs:
        links["network"] = dataclasses.replace(links["network"], gbs=network_gbs)
    return Hardware(
        DEVICES[gpu],
        gpus_per_node,
        links["intra"],
        links["network"],
        achieved_tflops=compute_tflops,
        pcie_gbs=pcie_gbs,
        host_bandwidth_gbs=host_bandwidth_gbs,
    )
