"""One training step, the one recipe every caller runs: the loop, the benchmarks and the tests.

    out = train_step(model, optimizer, micro_batches, global_tokens=B * T, grad_clip=1.0,
                     scaler=scaler, world=world_size, device=device, lr=lr_at(cfg, steps, s))
    out.loss, out.norm, out.bad        # device scalars: nothing here waits for the device

For each micro-batch (inputs, targets, weight[, positions]) of this rank: forward, the token-loss
SUM divided by the GLOBAL loss-token count of the step (so the gradient does not depend on how
many ranks or micro-batches computed it, nor on how documents fell on ranks: DESIGN.md
invariant 1), backward (all but the last under no_sync). Then the fp16 scaler's unscale and
overflow check, the global-norm clip, the loss summed over ranks, and the optimizer step unless
the loss or the norm is not finite (the divergence guard: the update is not applied, `bad` says
so) or fp16 overflowed on any rank (the scaler's business: skipped, the scale drops). zero_grad
ends the step.

`model` is our FSDPModel, or anything with its step interface (`__call__`, `no_sync()`,
`grad_shards()`, `clip_grad_norm_(max)`, `zero_grad()`): benchmarks wrap torch's FSDP2 and DDP in
TorchPeer to step them by the same recipe. Ray-free and torch only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.loss import loss_sum
from trainer.optim import guarded_step, set_lr

MicroBatch = tuple
"""(inputs, targets, weight[, positions[, real]]). weight: a number (0 for a placeholder
micro-batch of a rank with fewer rows than micro-batches: it runs, so collectives pair up, and
counts nothing) or per-token loss weights shaped like targets (fine-tuning's loss mask).
positions: None, or each token's position in its packed document (the model keeps attention
inside documents). real: None (every token), or [B, T] bool, the tokens that are not padding
(what a mixture of experts' load-balancing statistics count)."""

NO_SCALER = ShardedGradScaler(enabled=False)


@dataclass
class StepOutput:
    loss: torch.Tensor
    """Mean token loss of the global batch (summed over ranks), a device scalar."""
    norm: torch.Tensor
    """Global gradient norm before clipping."""
    bad: torch.Tensor
    """True (a device bool) when the loss or the norm was not finite: the update was not applied."""
    overflow: bool
    """fp16 overflow on some rank: every rank skipped the step and the loss scale dropped."""
    aux: Optional[torch.Tensor] = None
    """A mixture of experts' load-balancing loss of the global batch (unweighted; `loss` holds
    router_aux_loss_coef times it); None for a dense model."""
    load: Optional[torch.Tensor] = None
    """[sparse layers]: the busiest expert's tokens over the mean's, per layer (1.0: balanced)."""


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


def train_step(
    model,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[MicroBatch],
    *,
    global_tokens: int,
    grad_clip: float,
    scaler: ShardedGradScaler = NO_SCALER,
    world: int = 1,
    device: Optional[torch.device] = None,
    lr: Optional[float] = None,
    grad_scale: float = 1.0,
    phase: Callable[[str], ContextManager] = _no_phase,
    on_gradients: Optional[Callable[[], None]] = None,
    loss_chunk_tokens: int = 0,
) -> StepOutput:
    """One optimizer step over this rank's micro-batches (see the module docstring).

    `lr`: set on every parameter group first (the loop's schedule); None keeps it. `grad_scale`
    multiplies the loss before backward (a peer that averages gradients over ranks takes world
    here; a test blows one rank's loss up to force an fp16 overflow). `phase(name)` wraps
    "forward", "backward" and "optimizer" (the benchmarks time and label them);
    `on_gradients()` runs once the gradients are complete and unscaled, before the clip.
    `loss_chunk_tokens`: > 0 computes the head and the loss that many tokens at a time inside the
    model's forward (trainer/loss.py; resolve train.loss_chunk_tokens with
    trainer.loss.resolve_chunk_tokens), 0 from the whole logits."""
    if lr is not None:
        set_lr(optimizer, lr)
    balance = load_balance(model)
    routing = None
    if balance is not None:  # global routing statistics before the first backward
        micro_batches = list(micro_batches)
        scale = (scaler.scale if scaler.enabled else 1.0) * grad_scale
        routing = Routing(balance, world, scale)
        if len(micro_batches) > 1:  # a prepass: every micro-batch's routing, no gradient
            with phase("forward"), torch.no_grad():
                for mb in micro_batches:
                    micro_batch_loss(model, *mb[:4], chunk=loss_chunk_tokens, real=_real(mb),
                                     images=_images(mb))  # fmt: skip
                    routing.add(mb)
            routing.agree()
    loss_total = None
    for mb, last in _with_last(micro_batches):
        inputs, targets, weight, *positions = mb[:4]
        with contextlib.nullcontext() if last else model.no_sync():
            with phase("forward"):
                s, _ = micro_batch_loss(model, inputs, targets, weight, *positions,
                                        chunk=loss_chunk_tokens, real=_real(mb),
                                        images=_images(mb))  # fmt: skip
                if routing is not None and not routing.agreed:  # one micro-batch: now
                    routing.add(mb)
                    routing.agree()
            with phase("backward"):
                scaler.scale_loss(s * grad_scale / global_tokens).backward()
        loss_total = s.detach().float() if loss_total is None else loss_total + s.detach()
    with phase("optimizer"):
        overflow = scaler.unscale_and_check(model.grad_shards(), world, device)
        if on_gradients is not None:
            on_gradients()
        norm = model.clip_grad_norm_(grad_clip)
        aux = load = None
        if routing is not None:  # the probability sums ride on the loss's all-reduce
            loss_total, aux, load = routing.finish(loss_total, global_tokens)
        elif world > 1:
            dist.all_reduce(loss_total)
        bad = ~(torch.isfinite(loss_total) & torch.isfinite(norm))
        if overflow:  # fp16 overflow on any rank: every rank skips this step, the scale drops
            bad = torch.zeros_like(bad)  # the scaler's business, not a divergence
        else:
            guarded_step(optimizer, bad)
        scaler.update(overflow)
        model.zero_grad()
    return StepOutput(loss_total / global_tokens, norm, bad, overflow, aux, load)


def load_balance(model):
    """The model's LoadBalance (trainer/model/moe.py) when it has sparse layers, else None; the
    model behind the engine or a peer's wrapper."""
    return getattr(getattr(model, "module", model), "balance", None)


def _real(mb: MicroBatch) -> Optional[torch.Tensor]:
    """The micro-batch's non-padding tokens for the routing statistics: none of a weight-0
    placeholder (it runs so collectives pair up, and counts nothing)."""
    real = mb[4] if len(mb) > 4 else None
    weight = mb[2]
    if not torch.is_tensor(weight) and weight == 0:
        return torch.zeros(mb[0].shape, dtype=torch.bool, device=mb[0].device)
    return real


def _images(mb) -> Optional[dict]:
    """The micro-batch's image keywords for a vision-language model (trainer/inputs.py), or
    None."""
    return mb[5] if len(mb) > 5 else None


class Routing:
    """One step's routing statistics of a mixture of experts over the global batch: each
    micro-batch's (after its forward) added up, the counts and the real tokens summed over ranks
    before any backward (`agree`: the aux loss's gradient needs them), the probability sums at
    the end with the loss (`finish`: only the value needs them)."""

    def __init__(self, balance, world: int, scale: float):
        self.balance, self.world, self.scale = balance, world, scale
        self.real = None  # this rank's real tokens, a device scalar
        self.counts: Optional[torch.Tensor] = None  # global, once agreed
        self.tokens = None
        self.agreed = False
        balance.begin()

    def add(self, mb: MicroBatch) -> None:
        self.balance.collect()
        real = _real(mb)
        n = torch.tensor(mb[0].numel(), device=mb[0].device) if real is None else real.sum()
        self.real = n if self.real is None else self.real + n

    def agree(self) -> None:
        counts = self.balance.counts
        both = torch.cat([counts.flatten(), self.real.view(1).to(counts.dtype)])
        if self.world > 1:
            dist.all_reduce(both)
        self.counts = both[:-1].view_as(counts)
        self.tokens = both[-1].clamp_min(1).to(torch.float64)
        self.balance.set_gradient(self.counts, self.tokens, self.scale)
        self.agreed = True

    def finish(self, loss_total: torch.Tensor, global_tokens: int):
        """(loss sum + coef x aux x global tokens, aux, per-layer load): one all-reduce of the
        loss and the probability sums."""
        sums = self.balance.sums
        both = torch.cat([loss_total.view(1), sums.flatten()])
        if self.world > 1:
            dist.all_reduce(both)
        aux = self.balance.aux(self.counts, both[1:].view_as(sums), self.tokens)
        loss = both[0] + self.balance.coef * aux * global_tokens
        return loss, aux, self.balance.load(self.counts)


def forward(model, inputs: torch.Tensor, positions: Optional[torch.Tensor] = None, **kwargs):
    """The model's forward (the logits without kwargs); positions are passed only when there are
    some (a peer's model may not take them)."""
    return model(inputs, **kwargs) if positions is None else model(inputs, positions, **kwargs)


def micro_batch_loss(
    model,
    inputs,
    targets,
    weight,
    positions: Optional[torch.Tensor] = None,
    chunk: int = 0,
    real: Optional[torch.Tensor] = None,
    images: Optional[dict] = None,
):
    """(token-loss sum, tokens counted) of one micro-batch: chunk 0 from the logits the model
    returns (loss_sum); chunk > 0 by the model itself, its head and the loss `chunk` tokens at a
    time (trainer.model.Transformer's targets=), so the whole logits never exist; under context
    parallelism the model always takes the targets (its chunks' tokens are its own). Inside the
    model's forward, the engine's units (and FSDP2's) have the head's weight gathered. `real`:
    the non-padding tokens, for a mixture of experts' routing statistics (given only then).
    `images`: a vision-language model's image keywords (pixels, image_grid), passed as given."""
    extra = {} if real is None else {"real": real}
    extra.update(images or {})
    if not chunk and not splits_sequences(model):
        return loss_sum(forward(model, inputs, positions, **extra), targets, weight)
    return forward(
        model,
        inputs,
        positions,
        targets=targets,
        loss_weight=weight,
        loss_chunk_tokens=chunk,
        **extra,
    )


def splits_sequences(model) -> bool:
    """Whether the model (or the one the engine wraps) computes its context chunks only."""
    inner = getattr(model, "module", model)
    return getattr(inner, "context_split", None) is not None


def _with_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, is it the last) for each item, looking one ahead."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        raise ValueError("train_step: no micro-batch") from None
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class TorchPeer:
    """torch's FSDP2 or DDP behind the step interface, for the benchmarks and parity tests: the
    same recipe steps them (torch's global-norm clip; DDP's gradients are views of its buckets,
    so they are zeroed, not freed)."""

    def __init__(self, module: torch.nn.Module, optimizer, set_to_none: bool = True):
        self.module, self.optimizer, self.set_to_none = module, optimizer, set_to_none

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return (
            self.module.no_sync() if hasattr(self.module, "no_sync") else contextlib.nullcontext()
        )

    def grad_shards(self) -> list[torch.Tensor]:
        return [_local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = list(self.module.parameters())
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=self.set_to_none)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
