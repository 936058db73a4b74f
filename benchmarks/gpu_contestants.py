"""The contestants of the GPU check (benchmarks/gpu_check.py, and its leak stage in
benchmarks/gpu_stages.py): ours as trainer/build.py builds it for the loop, and torch FSDP2
(benchmarks/peers.py) on the same model, weights, batch and optimizer settings, each with
`step(x, y, tokens)` -> the mean token loss. Their own module, so the runner and the check both
import them and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.peers import adamw, fsdp2
from trainer.build import build
from trainer.build import checkpoint_blocks as apply_activation_checkpointing
from trainer.config import ModelConfig, OptimConfig, ShardingConfig, TrainConfig, TrainerConfig
from trainer.fsdp import build_mesh
from trainer.model import build_model
from trainer.speed import apply_speed_levers
from trainer.step import TorchPeer, train_step

SEED = 0


@dataclass(frozen=True)
class Setup:
    """One model's runs: the batch every contestant trains on, and how many steps each."""

    model: str
    batch: int
    """Sequences per step (the whole global batch: world size 1)."""
    seq_len: int
    warmup: int
    steps: int


class Ours:
    """Our engine, built (trainer/build.py) and stepped (trainer/step.py) as trainer/loop.py
    does."""

    name = "ours"

    def __init__(
        self,
        mcfg: ModelConfig,
        sharding: ShardingConfig,
        optim: OptimConfig,
        device,
        init,
        train: TrainConfig = TrainConfig(),
        backend: str = "inductor",
    ):
        job = TrainerConfig(model=mcfg, sharding=sharding, optim=optim, train=train)
        built = build(
            job, build_mesh(sharding, 0, 1), device, copy_init(init), compile_backend=backend
        )
        self.model, self.optimizer = built.model, built.optimizer
        self.clip = optim.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor, tokens: int) -> torch.Tensor:
        """trainer/step.py's step, as the loop runs it; the mean token loss (a device scalar)."""
        return train_step(
            self.model, self.optimizer, [(x, y, 1.0)], global_tokens=tokens, grad_clip=self.clip
        ).loss

    def exposed_ms(self) -> Optional[float]:
        """This step's exposed communication (reading it waits for the step's last collective)."""
        return self.model.metrics()["comm/exposed_ms"]


class FSDP2:
    """torch FSDP2 (benchmarks/peers.py: torchtitan's units) on the same model, weights, levers
    and optimizer settings as Ours."""

    name = "fsdp2"

    def __init__(
        self,
        mcfg: ModelConfig,
        sharding: ShardingConfig,
        optim: OptimConfig,
        device,
        init,
        train: TrainConfig = TrainConfig(),
        backend: str = "inductor",
    ):
        model = build_model(mcfg, device="meta")
        # The same levers in the same order as ours (trainer/build.py): Float8, checkpoint, compile.
        checkpoint = apply_activation_checkpointing if sharding.activation_checkpointing else None
        apply_speed_levers(model, train, device, backend, checkpoint)
        model.to_empty(device=device)
        model.load_state_dict(init)
        offloaded = str(sharding.offload) == "params"
        fsdp2(
            model,
            param_dtype=sharding.param_dtype.torch,
            reduce_dtype=sharding.reduce_dtype.torch,
            mesh=init_device_mesh(torch.device(device).type, (1,)),
            offload_params=offloaded,
        )
        self.model = model
        self.optimizer = adamw(
            model,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            device="cpu" if offloaded else device,  # offloaded: its shards live on the host
        )
        self.clip = optim.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor, tokens: int) -> torch.Tensor:
        """The same recipe (FSDP2 averages over ranks: at world size 1 the same gradient)."""
        peer = TorchPeer(self.model, self.optimizer)
        return train_step(
            peer, self.optimizer, [(x, y, 1.0)], global_tokens=tokens, grad_clip=self.clip
        ).loss

    def exposed_ms(self) -> Optional[float]:
        return None


def initial_state(mcfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter as trainer.model.initializer(SEED) fills it, on the host. Drawn once per
    model: the 1b draws 1.5B numbers on one CPU core (seconds each time); every run copies."""
    model = build_model(mcfg, device="cpu", seed=SEED)
    return {k: p.detach() for k, p in model.named_parameters()}


def copy_init(state: dict[str, torch.Tensor]) -> Callable[[torch.nn.Module, str], None]:
    """init_fn for the build: the values initializer(SEED) would draw, copied from `state`."""

    def init(module: torch.nn.Module, prefix: str) -> None:
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                p.copy_(state[prefix + name])

    return init


CONTESTANTS = {"ours": Ours, "fsdp2": FSDP2}
