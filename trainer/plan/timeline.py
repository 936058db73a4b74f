"""One training step of one worker as a sequence of phases, with what is alive in each.

Per phase: activations (measured, trainer/plan/activations.py, composed over n blocks), gathered
parameters, unsharded gradients and communication buffers (from the engine's schedule, with the
exact unit sizes of trainer/plan/layout.py). The persistent state (parameter, gradient and
optimizer shards) is alive in every phase. The step's peak is the largest phase.

The engine's schedule, as trainer/fsdp/engine.py runs it (steady state: the execution order known):
- gathered: FULL_SHARD / HYBRID_SHARD keep the root from its forward to the end of backward and
  one block computing, plus the next block's gather when prefetch is on and
  max_gathers_in_flight >= 2 (the root counts against the bound, so at most one block ahead).
  SHARD_GRAD_OP and NO_SHARD keep every unit gathered from its forward to the end of backward
  (NO_SHARD holds only the replicated compute copy, none at all in fp32, where the shard is the
  parameter). The all-gather input, when cast to the compute dtype, lives until the gather waits.
- unsharded gradients: when a unit's flat gradient is complete it is cast to reduce_dtype and
  handed to an asynchronous reduce-scatter (all-reduce for NO_SHARD); the engine waits for every
  reduction only when backward ends, and the handle keeps its input alive until then, so the
  reduce-dtype gradients of all finished units coexist until the end of backward. The
  reduce-scatter outputs (one shard per unit) are the communication buffers.
- micro-batches: with train.micro_batches > 1 the earlier micro-batches keep every unit's
  unsharded gradient in reduce_dtype (no_sync), so the last micro-batch runs with all of them.
- optimizer step (AdamW, foreach=False): two temporaries of the largest optimizer view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import ShardingConfig, ShardingStrategy

from .activations import ActivationProfile
from .layout import Layout


@dataclass(frozen=True)
class Phase:
    name: str
    block_activations: int = 0
    root_activations: int = 0  # embedding, logits and loss, the head's pending gradients
    gathered_params: int = 0
    unsharded_grads: int = 0
    comm_buffers: int = 0
    optimizer_temps: int = 0

    @property
    def transient(self) -> int:
        return (
            self.block_activations
            + self.root_activations
            + self.gathered_params
            + self.unsharded_grads
            + self.comm_buffers
            + self.optimizer_temps
        )


@dataclass(frozen=True)
class StepTimeline:
    persistent: int
    phases: tuple[Phase, ...] = field(default_factory=tuple)

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.transient)

    @property
    def peak(self) -> int:
        return self.persistent + self.peak_phase.transient

    def max_of(self, attr: str) -> int:
        return max(getattr(p, attr) for p in self.phases)


def step_timeline(
    lay: Layout, sharding: ShardingConfig, acts: ActivationProfile, micro_batches: int
) -> StepTimeline:
    persistent = lay.sharded_params + lay.sharded_grads + lay.optim_state
    gathered = _Gathered(lay, sharding)
    grads = _Grads(lay, sharding, micro_batches)
    n, b, r = len(lay.blocks), acts.block, acts.root
    casts = gathered.cast_inputs()
    phases = [
        Phase(
            f"forward of block {n - 1}",
            block_activations=(n - 1) * b.retained + b.forward_peak,
            gathered_params=gathered.forward(),
            unsharded_grads=grads.before_backward(),
            comm_buffers=casts,
        ),
        Phase(
            "loss and head backward",
            block_activations=n * b.retained,
            root_activations=max(r.forward_peak, r.head_backward_peak),
            gathered_params=gathered.head(),
            unsharded_grads=grads.before_backward(),
            comm_buffers=casts,
        ),
    ]
    for j in reversed(range(n)):
        unsharded, outputs = grads.during_block(j)
        phases.append(
            Phase(
                f"backward of block {j}",
                block_activations=(j + 1) * b.retained + b.backward_peak,
                root_activations=r.after_head,
                gathered_params=gathered.backward(),
                unsharded_grads=unsharded,
                comm_buffers=outputs + casts,
            )
        )
    unsharded, outputs = grads.embedding_backward()
    phases.append(
        Phase(
            "embedding backward",
            root_activations=r.embedding_backward_peak,
            gathered_params=gathered.root_only(),
            unsharded_grads=unsharded,
            comm_buffers=outputs,
        )
    )
    unsharded, outputs = grads.all_handed_off()
    phases.append(
        Phase(
            "end of backward",
            gathered_params=gathered.root_only(),
            unsharded_grads=unsharded,
            comm_buffers=outputs,
        )
    )
    phases.append(Phase("optimizer step", optimizer_temps=_optimizer_temps(lay)))
    return StepTimeline(persistent, tuple(phases))


class _Gathered:
    """Gathered compute-dtype parameters per phase."""

    def __init__(self, lay: Layout, sharding: ShardingConfig):
        self.lay, self.cfg = lay, sharding
        self.keep_all = lay.strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
        self.blocks = sorted((u.gathered_bytes for u in lay.blocks), reverse=True)
        self.everything = lay.root.gathered_bytes + sum(self.blocks)
        ahead = sharding.max_gathers_in_flight >= 2
        self.forward_blocks = 1 + int(sharding.forward_prefetch and ahead)
        self.backward_blocks = 1 + int(sharding.backward_prefetch and ahead)

    def _root_plus(self, k: int) -> int:
        return (
            self.everything
            if self.keep_all
            else self.lay.root.gathered_bytes + sum(self.blocks[:k])
        )

    def forward(self) -> int:
        return self._root_plus(self.forward_blocks)

    def head(self) -> int:  # the last block's gather is issued as the loss gradient arrives
        return self._root_plus(int(self.cfg.backward_prefetch))

    def backward(self) -> int:
        return self._root_plus(self.backward_blocks)

    def root_only(self) -> int:
        return self._root_plus(0)

    def cast_inputs(self) -> int:
        """fp32 shards cast to the compute dtype before a gather, alive while it is in flight."""
        if self.cfg.param_dtype == "float32" or self.lay.shard_size == 1:
            return 0
        size = self.cfg.param_dtype.itemsize
        shards = sorted((sum(u.shard) for u in self.lay.units), reverse=True)
        return size * sum(shards[: max(self.forward_blocks, self.backward_blocks)])


class _Grads:
    """Unsharded reduce-dtype gradients and reduce-scatter outputs per phase.

    A unit's flat gradient is first built by autograd in the compute dtype; the activation traces
    measure that one. When reduce_dtype differs the engine casts it, and both exist at the hand-off;
    when it does not, the traced tensor IS the one handed off, so it is not counted twice."""

    def __init__(self, lay: Layout, sharding: ShardingConfig, micro_batches: int):
        size = sharding.reduce_dtype.itemsize
        self.unsharded = [
            size * sum(p for p, t in zip(u.padded, u.trainable) if t) for u in lay.units
        ]
        scattered = lay.shard_size > 1  # with one rank per shard group the reduction is in place
        self.outputs = [
            size * sum(s for s, t in zip(u.shard, u.trainable) if t) if scattered else 0
            for u in lay.units
        ]
        self.accumulated = sum(self.unsharded) if micro_batches > 1 else 0
        self.cast = sharding.reduce_dtype != sharding.param_dtype
        self.bound = sharding.max_reductions_in_flight

    def before_backward(self) -> int:
        return self.accumulated

    def _alive(self, handed_off: list[int], current: int) -> tuple[int, int]:
        """handed_off: unit indices handed to the reduction so far, in hand-off order; current: the
        unit finishing now. The engine folds in the oldest once more than `bound` are pending, so
        the newest bound + 1 (the one being issued) are alive."""
        handed_off = handed_off[-(self.bound + 1) :]
        grads = sum(self.unsharded[i] for i in handed_off if i != current or self.cast)
        return max(self.accumulated, grads), sum(self.outputs[i] for i in handed_off)

    def during_block(self, j: int) -> tuple[int, int]:
        """Backward of block j: blocks j..n-1 handed off (block j is unit j + 1; the root is
        unit 0)."""
        return self._alive(list(range(len(self.unsharded) - 1, j, -1)), current=j + 1)

    def embedding_backward(self) -> tuple[int, int]:
        return self._alive(list(range(len(self.unsharded) - 1, -1, -1)), current=0)

    def all_handed_off(self) -> tuple[int, int]:
        return self._alive(list(range(len(self.unsharded) - 1, -1, -1)), current=-1)


def _optimizer_temps(lay: Layout) -> int:
    """AdamW (single-tensor) builds denom = exp_avg_sq.sqrt() / c: two fp32 temporaries of a
    view."""
    return 2 * 4 * max(u.largest_opt_view for u in lay.units)
