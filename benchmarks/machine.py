"""This machine as the step-time model (trainer/plan/steptime.py) sees it: its compute rate, its
gloo link and the memory bandwidth of the AdamW step, measured inside a benchmark's ranks (every
rank at once, as loaded as the contestants will be), so the model can predict the benchmark's
step times beside the measured ones.

    m = measure(cfg, batch, seq, "float32")        # in every rank: collective
    step_time(job, world, m.hardware(world)).step_s

What is measured, per rank, medians of REPS after a warmup:
- compute: the plain model's forward + backward (the summed token loss) on the rank's
  batch, no engine and no collective, as model FLOP/s (trainer.model.flops_per_token): the
  device's rate the model multiplies FLOPs by (a GPU's is its peak x efficiency);
- gloo: the engine's own all-gather (point-to-point on gloo) and reduce-scatter
  (trainer/fsdp/collectives.py) of SMALL and LARGE payloads over all ranks: the latency of a
  collective from the small one, the bandwidth (bytes each rank sends) from the large one;
- AdamW: the fused CPU AdamW step over a rank's share of the parameters, as bytes read and
  written a second (trainer/plan/levers.host_step_bytes counts them).
The figures are averaged over the ranks. On CPU workers the collectives run on the cores the
compute uses, so the model adds them to compute instead of hiding them (Device.overlap=False).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config import ModelConfig
from trainer.fsdp.accounting import Accounting
from trainer.fsdp.collectives import Collectives
from trainer.model import build_model, count_params, flops_per_token
from trainer.optim import implementation
from trainer.plan.hardware import Device, Hardware, Link
from trainer.plan.levers import host_step_bytes

REPS = 5
SMALL, LARGE = 64 * 2**10, 8 * 2**20  # bytes of a collective's payload


@dataclass(frozen=True)
class Machine:
    """What was measured, averaged over the ranks."""

    tflops: float
    gloo_gbs: float
    latency_us: float
    adamw_gbs: float

    def hardware(self, world: int) -> Hardware:
        """This machine as one node of `world` CPU workers on gloo."""
        device = Device(
            "cpu (measured)", self.tflops, 1.0, self.adamw_gbs, 0.0, overlap=False, source="here"
        )
        link = Link("gloo", self.gloo_gbs, 0.0, "measured here")
        return Hardware(device, world, link, link, base_latency_us=self.latency_us)

    def describe(self) -> str:
        return (
            f"this machine, measured in the ranks: {self.tflops * 1e3:.1f} GFLOP/s a rank "
            f"(the plain model's forward + backward), gloo {self.gloo_gbs:.2f} GB/s a rank and "
            f"{self.latency_us:.0f} us a collective, AdamW {self.adamw_gbs:.1f} GB/s"
        )


def _median_s(fn, reps: int = REPS) -> float:
    fn()  # warmup
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute_tflops(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> float:
    model = build_model(cfg, device="cpu", seed=0).to(dtype)
    g = torch.Generator().manual_seed(dist.get_rank())
    toks = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = toks[:, :-1], toks[:, 1:]

    def step():  # the loss as trainer/step.py's micro_batch_loss asks the model for it
        loss, _ = model(x, targets=y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return flops_per_token(cfg, seq) * batch * seq / _median_s(step) / 1e12


def gloo_link(world: int) -> tuple[float, float]:
    """(GB/s each rank sends, seconds of latency a collective) of the engine's collectives."""
    group = dist.new_group(list(range(world)))
    comm = Collectives(Accounting(), torch.device("cpu"))

    def pair(nbytes: int) -> float:
        n = nbytes // 4 // world * world
        full, shard = torch.zeros(n), torch.ones(n // world)
        gather = lambda: comm.all_gather(full, lambda: shard, group, world, "calibration").wait()
        scatter = lambda: comm.reduce_scatter(shard, full, group, world, "calibration").wait()
        return (_median_s(gather) + _median_s(scatter)) / 2

    latency = pair(SMALL)
    sent = LARGE * (world - 1) / world
    return sent / max(pair(LARGE) - latency, 1e-9) / 1e9, latency


def adamw_gbs(cfg: ModelConfig, world: int) -> float:
    """The fused AdamW step over a rank's share of the parameters: bytes it touches a second."""
    n = count_params(cfg) // world
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = torch.optim.AdamW([p], lr=1e-3, **implementation(torch.device("cpu")))
    return host_step_bytes(n, n, n, "float32", "float32") / _median_s(opt.step) / 1e9


def measure(cfg: ModelConfig, batch: int, seq: int, param_dtype: str) -> Machine:
    """Every rank measures at once (collective); the figures averaged over the ranks."""
    world = dist.get_world_size()
    tflops = compute_tflops(cfg, batch, seq, getattr(torch, param_dtype))
    gbs, latency = gloo_link(world)
    figures = torch.tensor([tflops, gbs, latency, adamw_gbs(cfg, world)], dtype=torch.float64)
    dist.all_reduce(figures)
    tflops, gbs, latency, adam = (figures / world).tolist()
    return Machine(tflops, gbs, latency * 1e6, adam)
