"""One training step of one worker as a sequence of phases, with what is alive in each.

Per phase: activations (measured, trainer/plan/activations.py, composed over n blocks), gathered
parameters, unsharded gradients and communication buffers (from the engine's schedule, with the
exact unit sizes of trainer/plan/layout.py). The persistent state (parameter and optimizer
shards) is alive in every phase; the fp32 gradient shards are freed by zero_grad at the end of a
step and come back at each unit's first reduction. The step's peak is the largest phase.

The engine's schedule, as trainer/fsdp/engine.py runs it (steady state: both orders known). The
units in forward order are the embedding, the blocks and the head (final norm + output
projection); the root holds nothing of its own (with tied embeddings: the embedding and the
norm, gathered the whole step). k = sharding.max_gathers_in_flight.
- gathered: FULL_SHARD / HYBRID_SHARD hold the unit computing and the next k units of the
  order (forward, or backward = reversed forward), with prefetch on; the head keeps its
  parameters from its forward into the backward that starts with it. SHARD_GRAD_OP and NO_SHARD
  keep every unit gathered from its forward to the end of backward (NO_SHARD holds only the
  replicated compute copy, none at all in fp32, where the shard is the parameter). The
  all-gather input, when cast to the compute dtype, lives until the gather waits.
- unsharded gradients: when a unit's flat gradient is complete it is cast to reduce_dtype and
  handed to an asynchronous reduce-scatter (all-reduce for NO_SHARD), the head's first; the
  oldest is retired (its input freed) before the next is issued once max_reductions_in_flight
  are pending (so at a hand-off bound + 1 gradients are alive, counted here with bound + 1
  outputs: one more than the engine allocates, on the safe side).
  The reduce-scatter outputs (one shard per unit) are the communication buffers.
- micro-batches: with train.micro_batches > 1 the earlier micro-batches keep every unit's
  unsharded gradient in reduce_dtype (no_sync), so the last micro-batch runs with all of them;
  with sharding.sharded_grad_accumulation every micro-batch reduces instead, and nothing is kept.
- optimizer step: the fused AdamW the trainer runs on CUDA allocates no temporaries (the foreach
  one it runs on a CPU allocates one fp32 copy of exp_avg_sq per parameter group; not modelled:
  the planner plans GPU jobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainer.config import ShardingConfig

from .activations import ActivationProfile
from .layout import Layout
from .levers import staged_bytes_per_element


@dataclass(frozen=True)
class Phase:
    name: str
    block_activations: int = 0
    root_activations: int = 0  # embedding, logits and loss, the head's pending gradients
    gathered_params: int = 0
    unsharded_grads: int = 0
    comm_buffers: int = 0
    sharded_grads: int = 0  # fp32 gradient shards: allocated at each unit's first reduction

    @property
    def transient(self) -> int:
        return (
            self.block_activations
            + self.root_activations
            + self.gathered_params
            + self.unsharded_grads
            + self.comm_buffers
            + self.sharded_grads
        )


@dataclass(frozen=True)
class StepTimeline:
    persistent: int
    phases: tuple[Phase, ...] = field(default_factory=tuple)
    hand_off_peak: int = 0
    """Unsharded gradients alive at the worst hand-off to the reducer, the one handed off counted
    (the phases count it with the activations that produced it): what the engine's accounting
    reports as its unsharded_grads peak."""

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
    persistent = lay.sharded_params + lay.optim_state
    gathered = _Gathered(lay, sharding)
    grads = _Grads(lay, sharding, micro_batches)
    blocks = [i for i, u in enumerate(lay.units) if u.kind == "block"]  # forward positions
    n = len(blocks)
    head, embedding = lay.index("head"), lay.index("embedding")
    head_at = len(lay.units) if head is None else head  # tied: the head is the root's
    casts = gathered.cast_inputs()
    acts_at = activation_phases(acts, n)
    phases = [
        Phase(
            f"forward of block {n - 1}",
            block_activations=acts_at[0][1],
            root_activations=acts_at[0][2],
            gathered_params=gathered.forward(blocks[-1]),
            unsharded_grads=grads.before_backward(),
            comm_buffers=casts,
            sharded_grads=grads.shards_before_backward(),
        ),
        Phase(
            "loss and head backward",
            block_activations=acts_at[1][1],
            root_activations=acts_at[1][2],
            gathered_params=gathered.backward(head_at),
            unsharded_grads=grads.before_backward(),
            comm_buffers=casts,
            sharded_grads=grads.shards_before_backward(),
        ),
    ]
    for j in reversed(range(n)):
        unsharded, outputs, shards = grads.handed_off_through(blocks[j])
        _, block_bytes, root_bytes = acts_at[2 + (n - 1 - j)]
        phases.append(
            Phase(
                f"backward of block {j}",
                block_activations=block_bytes,
                root_activations=root_bytes,
                gathered_params=gathered.backward(blocks[j]),
                unsharded_grads=unsharded,
                comm_buffers=outputs + casts,
                sharded_grads=shards,
            )
        )
    unsharded, outputs, shards = grads.handed_off_through(0 if embedding is None else embedding)
    phases.append(
        Phase(
            "embedding backward",
            root_activations=acts_at[-1][2],
            gathered_params=gathered.backward(embedding)
            if embedding is not None
            else gathered.root,
            unsharded_grads=unsharded,
            comm_buffers=outputs,
            sharded_grads=shards,
        )
    )
    unsharded, outputs, shards = grads.all_handed_off()
    phases.append(
        Phase(
            "end of backward",
            gathered_params=gathered.root,
            unsharded_grads=unsharded,
            comm_buffers=outputs,
            sharded_grads=shards,
        )
    )
    phases.append(Phase("optimizer step", sharded_grads=lay.sharded_grads))
    return StepTimeline(persistent, tuple(phases), grads.hand_off_peak())


def activation_phases(acts: ActivationProfile, n: int) -> list[tuple[str, int, int]]:
    """(phase, block activations, root activations) of the phases with activations, for n
    blocks: the measured block and root composed as the step runs them. The context split's
    shared masks (acts.shared) are alive from the first block's forward to the last block's
    backward."""
    b, r, shared = acts.block, acts.root, acts.shared
    out = [
        (f"forward of block {n - 1}", (n - 1) * b.retained + b.forward_peak, shared),
        (
            "loss and head backward",
            n * b.retained,
            max(r.forward_peak, r.head_backward_peak) + shared,
        ),
    ]
    for j in reversed(range(n)):
        block = (j + 1) * b.retained + b.backward_peak
        out.append((f"backward of block {j}", block, r.after_head + shared))
    out.append(("embedding backward", 0, r.embedding_backward_peak))
    return out


def activation_peak(acts: ActivationProfile, n: int) -> int:
    """The step's peak of activation memory alone (blocks + root) for n blocks: what
    MemoryPlan.activations_with/without_checkpointing report."""
    return max(block + root for _, block, root in activation_phases(acts, n))


class _Gathered:
    """Gathered compute-dtype parameters per phase."""

    def __init__(self, lay: Layout, sharding: ShardingConfig):
        self.lay, self.cfg = lay, sharding
        self.sizes = [u.gathered_bytes for u in lay.units] + [0]  # [len]: the tied head (root)
        # Units that keep their gathered parameters from their forward to the end of backward
        # (SHARD_GRAD_OP, NO_SHARD: the mesh's strategy or their own, sharding.modules).
        self.kept = [not u.reshard_after_forward for u in lay.units] + [False]
        self.root = lay.root.gathered_bytes
        k = sharding.max_gathers_in_flight
        self.forward_k = k if sharding.forward_prefetch else 0
        self.backward_k = k if sharding.backward_prefetch else 0

    def forward(self, i: int) -> int:
        """Unit i computes its forward; the next k are prefetched; earlier units that keep
        their parameters still hold them."""
        kept = sum(size for size, keep in zip(self.sizes[:i], self.kept) if keep)
        return self.root + kept + sum(self.sizes[i : i + 1 + self.forward_k])

    def backward(self, i: int) -> int:
        """Unit i computes its backward; the next k of the backward order are prefetched; every
        unit that keeps its parameters holds them until backward ends."""
        lo = max(0, i - self.backward_k)
        window = sum(size for j, size in enumerate(self.sizes[lo : i + 1], lo) if not self.kept[j])
        return self.root + sum(size for size, keep in zip(self.sizes, self.kept) if keep) + window

    def cast_inputs(self) -> int:
        """Shards cast to the compute dtype before a gather, alive while it is in flight (none
        when the master is of the compute dtype); with offload=params every gather's master
        slice, copied in from the host, and its cast (levers.staged_bytes_per_element)."""
        master = str(self.cfg.master_dtype)
        if self.lay.offload == "params":
            size = staged_bytes_per_element(master, str(self.cfg.param_dtype))
        elif str(self.cfg.param_dtype) == master:
            return 0
        else:
            size = self.cfg.param_dtype.itemsize
        units = self.lay.all_units
        if self.lay.offload != "params":  # one rank per shard group: a local cast, no gather
            units = [u for u in units if u.shard_size > 1]
        shards = sorted((sum(u.shard) for u in units), reverse=True)
        return size * sum(shards[: 1 + max(self.forward_k, self.backward_k)])


class _Grads:
    """Unsharded reduce-dtype gradients and reduce-scatter outputs per phase.

    A unit's flat gradient is first built by autograd in the compute dtype; the activation traces
    measure that one. When reduce_dtype differs the engine casts it, and both exist at the hand-off;
    when it does not, the traced tensor IS the one handed off, so it is not counted twice.
    Units are keyed by forward position; the root (trainable only with tied embeddings) is -1,
    handed off last."""

    def __init__(self, lay: Layout, sharding: ShardingConfig, micro_batches: int):
        size = sharding.reduce_dtype.itemsize

        def grad(u):
            return size * sum(p for p, t in zip(u.padded, u.trainable) if t)

        def out(u):  # with one rank per shard group the reduction is in place
            scattered = u.shard_size > 1
            return size * sum(s for s, t in zip(u.shard, u.trainable) if t) if scattered else 0

        units = dict(enumerate(lay.units))
        units[-1] = lay.root
        self.unsharded = {i: grad(u) for i, u in units.items()}
        self.outputs = {i: out(u) for i, u in units.items()}
        # gradient shards, master dtype (none on the device when offloaded: sharded_grads is 0)
        shard = lay.sharded_grads // lay.grad_elements if lay.grad_elements else 0
        self.shards = {
            i: shard * sum(s for s, t in zip(u.shard, u.trainable) if t) for i, u in units.items()
        }
        self.total_shards = lay.sharded_grads
        # backward order of the units with a gradient: reversed forward, the root last
        self.order = [i for i in [*range(len(lay.units) - 1, -1, -1), -1] if self.unsharded[i]]
        kept = micro_batches > 1 and not sharding.sharded_grad_accumulation
        self.accumulated = sum(self.unsharded.values()) if kept else 0
        self.cast = sharding.reduce_dtype != sharding.param_dtype
        self.bound = sharding.max_reductions_in_flight
        # sharded accumulation: earlier micro-batches already reduced into every gradient shard
        self.shards_kept = micro_batches > 1 and sharding.sharded_grad_accumulation

    def before_backward(self) -> int:
        return self.accumulated

    def shards_before_backward(self) -> int:
        """zero_grad freed the gradient shards; they return at each unit's first reduction."""
        return self.total_shards if self.shards_kept else 0

    def _alive(self, handed_off: list[int], current: Optional[int]) -> tuple[int, int, int]:
        """handed_off: units handed to the reduction so far, in hand-off order; current: the unit
        finishing now. The engine retires the oldest once more than `bound` are pending, so the
        newest bound + 1 (the one being issued) are alive; the retired ones are in their fp32
        gradient shards (an fp32 reduce-scatter output becomes the shard)."""
        pending, retired = handed_off[-(self.bound + 1) :], handed_off[: -(self.bound + 1)]
        grads = sum(self.unsharded[i] for i in pending if i != current or self.cast)
        shards = self.total_shards if self.shards_kept else sum(self.shards[i] for i in retired)
        return max(self.accumulated, grads), sum(self.outputs[i] for i in pending), shards

    def handed_off_through(self, i: int) -> tuple[int, int, int]:
        """Backward of unit i (forward position): it and every unit after it handed off."""
        upto = [u for u in self.order if u >= i]
        return self._alive(upto, current=i)

    def hand_off_peak(self) -> int:
        window = self.bound + 1
        alive = [
            sum(self.unsharded[i] for i in self.order[max(0, n - window) : n])
            for n in range(1, len(self.order) + 1)
        ]
        return max([self.accumulated, *alive])

    def all_handed_off(self) -> tuple[int, int, int]:
        return self._alive(self.order, current=None)
