"""The speed levers of train.compile and train.float8, applied to a plain model before the engine
wraps it (torchtitan's order: quantise, checkpoint, compile, then shard; trainer/build.py is the
one build that applies them, and says why that order).

    check_float8(cfg.train, device)                    # before workers start (device=None: torchao)
    info = apply_speed_levers(model, cfg.train, device, checkpoint=...)  # model on the meta device
    fsdp = parallelize(model, cfg.sharding, mesh, device, init_fn=...)
    ...first step...
    print0(info.describe())                             # "compile: 2 blocks, 1 graph, 17.3 s ..."

- train.float8: torchao's Float8Linear replaces every nn.Linear inside the transformer blocks
  (model.layers) whose two dimensions divide by 16 (what the fp8 matrix product needs); the
  embedding and the output head stay in the compute dtype, and so does the engine's all-gather
  (the layer casts the gathered weight to fp8 itself). CUDA needs sm_89 or newer; on the CPU
  torchao's emulation runs (fp8 numerics, fp32 products: for tests and trial runs, no speed-up).
- train.compile: each block's `forward` is replaced in place by torch.compile(forward,
  fullgraph=True, dynamic=False), torchtitan's per-block recipe. In place, not
  `block.compile()` (which would compile `_call_impl`, hooks included): the engine's hooks on the
  block module issue the all-gathers and reduce-scatters, and they stay in eager code around the
  compiled region, so the next unit's all-gather still overlaps the compiled block. Activation
  checkpointing (the `checkpoint` argument, applied before compiling) is inside the compiled
  forward: the compiler sees it as one region and recomputes in the compiled backward. The
  blocks share one compiled graph (dynamo inlines the module
  and takes its parameters as inputs), so compile time does not grow with the depth.
  Shapes are static: each distinct (grad mode, micro-batch rows, document mask or not) compiles
  once when first met, all of training's in the first step (a rank's micro-batch rows are fixed
  by the global batch, the world size and train.micro_batches), evaluation's at the first
  evaluation; nothing compiles after that (tests/trainer/test_compile.py). Generation with a KV
  cache (a new length every token) runs the block eagerly.

The planner needs no change for compile: it counts parameters, gradients, optimizer state and
activations by shape, and the compiled block holds the same tensors (inductor may fuse some of
the activations away, so the planner's figure stays an upper bound). Float8 adds the fp8 copies
of one block's weights and inputs while it computes (1 byte a parameter of the block, well
inside the bf16 gathered copy the planner already counts).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters, cumulative_time_spent_ns

from trainer.config import TrainConfig
from trainer.fsdp.config import fail

TORCHAO = "torchao==0.18.0"
"""The version the `float8` extra pins (pyproject.toml): it loads with torch 2.11 (CUDA, its
extensions built for it) and with 2.13 (its float8 training is Python over torch._scaled_mm)."""
FLOAT8_EXTRA = f"pip install 'elastic-fsdp[float8]' (or pip install {TORCHAO})"
FP8_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell: torch._scaled_mm in fp8
FP8_MULTIPLE = 16  # both dimensions of an fp8 matrix product divide by 16


@dataclass
class SpeedInfo:
    """What apply_speed_levers did, and the start-up line that says so."""

    compiled_blocks: int = 0
    float8_linears: list[str] = field(default_factory=list)
    float8_skipped: list[str] = field(default_factory=list)
    """Linears in the blocks left in the compute dtype: a dimension that does not divide by 16."""
    float8_recipe: Optional[str] = None
    float8_emulated: bool = False

    def describe(self) -> str:
        """One line for the log: what is compiled and quantised, and what compiling cost so far
        (read it after the first step: compiling happens in the first forward and backward)."""
        parts = []
        if self.compiled_blocks:
            s = compile_stats()
            parts.append(
                f"compile: {self.compiled_blocks} blocks, {s['graphs']} graph(s), "
                f"{s['seconds']:.1f} s, {s['graph_breaks']} graph breaks"
            )
        if self.float8_recipe:
            how = (
                ", emulated on the CPU (fp8 numerics, no speed-up)" if self.float8_emulated else ""
            )
            skipped = f", {len(self.float8_skipped)} left out" if self.float8_skipped else ""
            parts.append(
                f"float8 {self.float8_recipe}: {len(self.float8_linears)} linears{skipped}{how}"
            )
        return "; ".join(parts) or "speed levers: none"


def compile_stats() -> dict:
    """This process's torch.compile figures so far: graphs compiled (each distinct shape or grad
    mode is one), graph breaks, and seconds spent compiling (dynamo + inductor, forward and the
    backward compiled at the first backward)."""
    ns = cumulative_time_spent_ns
    return dict(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        seconds=(ns.get("entire_frame_compile", 0) + ns.get("entire_backward_compile", 0)) / 1e9,
    )


def apply_speed_levers(
    model: torch.nn.Module,
    train: TrainConfig,
    device: Optional[torch.device | str],
    backend: str = "inductor",
    checkpoint: Optional[Callable[[torch.nn.Module], None]] = None,
) -> SpeedInfo:
    """train.float8, then `checkpoint(model)` (activation checkpointing, when the build asks for
    it), then train.compile, on `model` (a trainer.model.Transformer, on any device, meta
    included), in place and before parallelize. Raises a ConfigError for Float8 where it cannot
    run (check_float8; device None checks torchao only). `backend`: torch.compile's (see
    compile_blocks)."""
    info = SpeedInfo()
    if train.float8:
        config, info.float8_emulated = check_float8(train, device)
        info.float8_recipe = train.float8_recipe
        info.float8_linears, info.float8_skipped = convert_float8(model, config)
    if checkpoint is not None:
        checkpoint(model)
    if train.compile:
        info.compiled_blocks = compile_blocks(model, backend)
    return info


# ----------------------------------------------------------------------------- compile


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each transformer block's forward in place (see the module docstring); the number
    of blocks. `backend`: torch.compile's (tests use aot_eager: the same capture and autograd,
    without inductor's code generation)."""
    for block in model.layers:
        compile_forward(block, backend)
    return len(model.layers)


def compile_forward(block: torch.nn.Module, backend: str = "inductor") -> None:
    eager = block.forward
    compiled = torch.compile(eager, backend=backend, fullgraph=True, dynamic=False)

    def forward(x, ctx=None):
        if ctx is not None and ctx.cache is not None:  # generation: a new length every token
            return eager(x, ctx)
        return compiled(x, ctx)

    block.forward = forward


# ----------------------------------------------------------------------------- float8


def check_float8(train: TrainConfig, device: Optional[torch.device | str] = None):
    """(torchao's Float8LinearConfig for train.float8_recipe, emulated) where Float8 can run, or a
    ConfigError naming the key: torchao missing (the `float8` extra), a GPU below sm_89.
    device=None (the driver, before workers start) checks torchao and the recipe only; a CPU
    device runs torchao's emulation."""
    if importlib.util.find_spec("torchao") is None:
        fail("train.float8", train.float8, f"false, or install torchao: {FLOAT8_EXTRA}")
    from torchao.float8 import Float8LinearConfig  # noqa: PLC0415 -- an optional dependency

    config = Float8LinearConfig.from_recipe_name(train.float8_recipe)
    if device is None:
        return config, False
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            fail(
                "train.float8",
                train.float8,
                f"false on this GPU ({name}, sm_{cap[0]}{cap[1]}): Float8 needs sm_89 or newer "
                "(L4/L40/RTX 4090, H100/H200, B200)",
            )
        return config, False
    if device.type != "cpu":
        fail("train.float8", train.float8, f"false on {device.type} (Float8: CUDA or the CPU)")
    return dataclasses.replace(config, emulate=True), True


def convert_float8(model: torch.nn.Module, config) -> tuple[list[str], list[str]]:
    """Swap the blocks' nn.Linear layers for torchao's Float8Linear (same parameters, same names,
    the init std they carry); (converted names, names left out)."""
    from torchao.float8 import convert_to_float8_training  # noqa: PLC0415 -- optional

    done, skipped, stds = [], [], {}

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        ok = module.in_features % FP8_MULTIPLE == 0 and module.out_features % FP8_MULTIPLE == 0
        (done if ok else skipped).append(fqn)
        stds[fqn] = getattr(module, "init_std", None)
        return ok

    convert_to_float8_training(model.layers, module_filter_fn=wanted, config=config)
    for fqn in done:  # trainer.model.init_parameters reads the std the Linear carried
        if stds[fqn] is not None:
            model.layers.get_submodule(fqn).init_std = stds[fqn]
    return [f"layers.{n}" for n in done], [f"layers.{n}" for n in skipped]
