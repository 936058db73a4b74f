"""What a person watching a run sees: one line per logged step on rank 0, and its metrics.

    report = StepReport(cfg, world, device, logger, global_tokens, flops_per_token)
    report.start(step)                                  # the clock of the first logged step
    report.log(step, loss, norm, seconds, extra, eval_loss)

`step 120/2000 | loss | lr | gnorm | tok/s | ms | TFLOPs (MFU) | memory | elapsed, ETA | world`.
Step N is N optimizer steps done, as in MLflow, the checkpoint directory names and Ray's reports.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from trainer.config import TrainerConfig
from trainer.metrics import MetricsLogger, print0, step_metrics
from trainer.optim import lr_at

GLANCE = "At a glance/"
"""The headline section of a run's page in the MLflow UI: the UI groups charts by the prefix before
the last '/', sorts the sections first by code point, then (whenever a new key appears, e.g. the
summary's loss image at the end) case-blind; "At a glance" comes before every other section in
both orders (comm, data, ..., Summary, train, ...), so a run's page opens on its loss and its
speed, during training and after."""
GLANCE_KEYS = {"train/loss": "loss", "eval/loss": "loss_eval", "perf/tokens_per_s": "tokens_per_s"}


def at_a_glance(m: dict) -> dict:
    """The headline copies of this step's loss, eval loss and tokens/s (those it has)."""
    return {GLANCE + short: m[key] for key, short in GLANCE_KEYS.items() if key in m}


class StepReport:
    """The step line and the step's metrics (to MLflow through `logger`, rank 0's)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        world: int,
        device: torch.device,
        logger: MetricsLogger,
        global_tokens: int,
        flops_per_token: float,
    ):
        self.cfg, self.world, self.device, self.logger = cfg, world, device, logger
        self.global_tokens, self.flops_per_token = global_tokens, flops_per_token
        self.start(0)

    def start(self, step: int) -> None:
        """Training (re)starts at `step`: the elapsed clock and the rate start here."""
        self._since = (time.perf_counter(), step)  # (time, step) of the last logged step
        self._started = self._since[0]

    def due(self, step: int, eval_due: bool) -> bool:
        """After `step` steps done: every train.log_every, the last step and every evaluation."""
        return (
            (step - 1) % self.cfg.train.log_every == 0 or step == self.cfg.train.steps or eval_due
        )

    def seconds_per_step(self, step: int) -> float:
        """Since the last logged step. Call it after the losses were read back (the host then
        waited for the device: every step up to this one has finished, so the wall time is right
        on a GPU too); checkpoint snapshots taken meanwhile are part of it, evaluations not."""
        return (time.perf_counter() - self._since[0]) / max(1, step - self._since[1])

    def log(
        self,
        step: int,
        loss: float,
        norm: float,
        seconds: float,
        metrics: dict,
        eval_loss: Optional[float],
        after_step=None,
    ) -> None:
        """The line and the metrics of `step` steps done; `metrics` (the engine's, the
        checkpointer's, bad steps) are merged in; `after_step(step index, metrics)` may add more
        (the cluster layer's elastic/*). The clock of the next logged step starts when done."""
        m = step_metrics(
            loss=loss,
            lr=lr_at(self.cfg.optim, self.cfg.train.steps, step - 1),
            grad_norm=norm,
            seconds=seconds,
            tokens=self.global_tokens,
            flops_per_token=self.flops_per_token,
            world_size=self.world,
            device=self.device,
            param_dtype=self.cfg.sharding.param_dtype,
        )
        m.update(metrics)
        evaluated = ""
        if eval_loss is not None:
            m["eval/loss"], m["eval/perplexity"] = eval_loss, math.exp(min(eval_loss, 80.0))
            evaluated = f" | eval {eval_loss:.4f}"
        if after_step is not None:
            m.update(after_step(step - 1, m) or {})
        m.update(memory_metrics(self.device))
        m.update(at_a_glance(m))
        print0(self.line(step, loss, norm, m, evaluated))
        self.logger.log_metrics(m, step=step)  # "step N": N optimizer steps done, everywhere
        self._since = (time.perf_counter(), step)

    def line(self, step: int, loss: float, norm: float, m: dict, evaluated: str) -> str:
        total = self.cfg.train.steps
        elapsed = time.perf_counter() - self._started
        eta = m["perf/step_ms"] / 1000 * (total - step)  # at the latest rate
        mfu = f" MFU {m['perf/mfu']:.1%}" if "perf/mfu" in m else ""
        return (
            f"step {step:{len(str(total))}d}/{total} | loss {loss:.4f}{evaluated} | "
            f"lr {m['train/lr']:.2e} | "
            f"gnorm {norm:.3f} | {m['perf/tokens_per_s']:,.0f} tok/s | "
            f"{m['perf/step_ms']:.1f} ms | {m['perf/tflops_per_worker']:.3g} TFLOPs/worker{mfu} | "
            f"mem {memory_text(m)} | {_clock(elapsed)} elapsed, ETA "
            f"{_clock(eta)} | world {self.world}"
        )


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The measured peak of this worker: the device's max_memory_allocated (and its size) on
    CUDA; on a CPU, the process's resident-set high-water mark (everything the process holds:
    Python, torch, the data loader), not only tensors."""
    if device.type == "cuda":
        return {
            "mem/device_max_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
            "mem/device_total_bytes": float(torch.cuda.get_device_properties(device).total_memory),
        }
    import resource  # noqa: PLC0415 -- POSIX only; a CPU worker

    return {"mem/rss_peak_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def memory_text(m: dict) -> str:
    if "mem/device_max_allocated_bytes" in m:
        used, total = m["mem/device_max_allocated_bytes"], m["mem/device_total_bytes"]
        return f"{used / 2**30:.2f} GiB ({used / total:.0%} of {total / 2**30:.0f})"
    return f"{m['mem/rss_peak_bytes'] / 2**30:.2f} GiB RSS peak"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def moe_metrics(model, aux, load) -> dict[str, float]:
    """A mixture's last step: train/aux_loss (unweighted; train/loss holds coef x it) and the
    load of its experts: the busiest expert's tokens over the mean's, the worst layer and each."""
    if aux is None:
        return {}
    loads = [float(x) for x in load]
    out = {"train/aux_loss": float(aux), "train/moe_load_max": max(loads)}
    out.update({f"moe_load/layer_{i}": x for i, x in zip(model.sparse_layers, loads)})
    return out
