"""Activation memory, measured: one block and the root traced on fake tensors, nothing allocated.

The trace runs the model's real forward and backward code under FakeTensorMode (shapes, dtypes and
kernel choices without data), on modules the engine itself wrapped (trainer/plan/layout.py), so
parameters are views of one flat compute-dtype tensor per unit exactly as in training, and with
activation checkpointing the block's forward is the engine's checkpointed one. A dispatch-mode
tracker counts every storage an op allocates and frees it when the storage dies, so it sees what
autograd saves for backward AND the temporaries in between (the logits' fp32 copy, the gradient of
the log-probabilities, the per-parameter gradients before they are concatenated into the flat one).

Measured once per (model, micro-batch shape, compute dtype, checkpointing), for:
  block: bytes one block leaves alive for backward, the peak of its forward, the peak of its
         backward above the level it starts from (with checkpointing: the recompute);
  root:  the embedding, final norm, output projection and loss (the embedding and head units
         and the root): forward peak, what the head leaves for backward, the peak of the head's
         backward, what is still alive when the head's backward is done (the gradient entering the
         last block; with tied embeddings also the head's share of the root's flat gradient,
         complete only after the embedding's) and the embedding backward's peak.
trainer/plan/timeline.py composes them over n blocks.

Fake tensors take their kernels from the CPU: scaled_dot_product_attention picks the CPU flash
kernel, which saves the output and the log-sum-exp (O(T)), as the CUDA flash and memory-efficient
kernels do. CUDA's own workspaces (cuBLAS, NCCL) are not seen.

Context parallelism (train.context_parallel = N, trainer/model/context.py): the trace runs the
model's own split. The block sees this rank's 2c tokens of each sequence (c = ceil(T / 2N)) and
its attention the real all-gather of K/V over the context group, played by a stand-in that
allocates the gathered [N, B, 2c, kv_heads, 2 head_dim] in forward and the rank's gradient in
backward (as the engine's reduce-scatter does), so the gathered K/V, its sequence-ordered copy,
the keys repeated over the query heads for each chunk's range and their gradients are all
measured, and under checkpointing measured again in the recompute. The trace's sequences are
plain causal (no documents): each query chunk then runs without a mask, as flash attention over
its visible prefix and its causal square merged by log-sum-exp (trainer/model/context.py; CUDA's
FlexAttention with a block mask keeps the same output and log-sum-exp). A mask built once per
forward and shared by every layer would be `ActivationProfile.shared` (none for plain causal
sequences). Rank 0 is traced: every rank's two
chunks attend to (2N + 1) c keys together, so without document masks every rank holds the same.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.config import DType, ModelConfig, ShardingConfig
from trainer.fsdp import virtual_mesh
from trainer.loss import loss_sum, resolve_chunk_tokens
from trainer.model.attention import AttentionContext
from trainer.model.context import ChunkAttention, ContextSplit, chunk_layout
from trainer.model.decoder import Transformer

from .layout import frozen_model, meta_engine, thawed_model

if TYPE_CHECKING:
    from .tower import TowerProfile


@dataclass(frozen=True)
class BlockProfile:
    retained: int
    """Bytes one block keeps alive from its forward to its backward, in a chain of blocks: what
    autograd saved (its input included if saved), not its output (the next block's input)."""
    forward_peak: int
    """Peak above the level before its forward (its input included)."""
    backward_peak: int
    """Peak of its backward above the level where it starts (own saved tensors, incoming grad)."""
    io_bytes: int
    """One [rows, seq, dim] tensor in the compute dtype (block input, output, gradient)."""


@dataclass(frozen=True)
class RootProfile:
    forward_peak: int
    """Peak of the embedding + head forward (the head's input included): logits, fp32 copy,
    log-probs."""
    retained: int
    """What the head leaves for backward (its input if saved, the fp32 log-probabilities, the
    loss)."""
    head_backward_peak: int
    """Peak of the loss + head backward."""
    after_head: int
    """Alive when the head's backward is done: the gradient entering the last block (and, with
    tied embeddings, the head's parameter gradient, held until the embedding's completes the
    root's flat gradient)."""
    embedding_backward_peak: int
    """Peak of the embedding backward: its dense gradient and the root's flat gradient; in a
    vision-language model the phases outside the decoder's blocks (the tower's forward and
    backward too: tower.py's with_tower)."""


@dataclass(frozen=True)
class ActivationProfile:
    rows: int
    seq_len: int
    block: BlockProfile
    root: RootProfile
    context: int = 1
    """train.context_parallel: the block and root were traced on this rank's 2c tokens."""
    shared: int = 0
    """Alive from the first block's forward to the last block's backward, once for all layers:
    the context split's attention masks (none for the traced plain causal sequences), a vision
    tower's kept activations (tower.py: with_tower)."""
    tower: Optional["TowerProfile"] = None
    """A vision-language model's image tower over the micro-batch's patches (tower.py), folded
    into `shared` and the root's embedding_backward_peak by with_tower; None without one."""


class AllocationTracker(TorchDispatchMode):
    """Live bytes of the storages ops allocate; a storage is freed when its last tensor dies.

    An output sharing a storage with an input (views, in-place ops) allocates nothing."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if torch.is_tensor(t)
        }
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t):
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key = storage._cdata
        if key in inputs or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += self.live[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def restart_peak(self) -> int:
        """The peak since the last restart; the next one starts from the current level."""
        peak, self.peak = self.peak, self.current
        return peak


def profile(
    model: ModelConfig,
    rows: int,
    seq_len: int,
    param_dtype: str,
    checkpointing: bool,
    loss_chunk_tokens: Optional[int] = None,
    context: int = 1,
    device: str = "cuda",
) -> ActivationProfile:
    """Measure one block and the root for micro-batches of `rows` sequences of `seq_len` tokens.
    `loss_chunk_tokens` is train.loss_chunk_tokens (None: auto for the vocabulary, as the loop
    resolves it): chunked, the root holds one chunk's logits and their gradient, not the whole
    [tokens, vocab] fp32 logits. `context`: train.context_parallel (each rank computes 2c of
    every sequence's tokens, module docstring); `device`: "cuda" or "cpu", kept apart in the
    cache (the traced plain causal sequences build no mask on either: they measure the same)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"profile: device={device!r}; valid: 'cuda' or 'cpu'")
    key = frozen_model(model)
    chunk = resolve_chunk_tokens(loss_chunk_tokens, model.vocab_size)
    dense = device == "cpu" and context > 1
    return _profile(key, rows, seq_len, param_dtype, checkpointing, chunk, context, dense)


@lru_cache(maxsize=64)
def _profile(
    model_key,
    rows: int,
    seq_len: int,
    param_dtype: str,
    checkpointing: bool,
    chunk: int = 0,
    context: int = 1,
    dense_masks: bool = False,
) -> ActivationProfile:
    model = thawed_model(model_key)
    sharding = ShardingConfig(
        strategy="NO_SHARD", param_dtype=param_dtype, activation_checkpointing=checkpointing
    )
    # NO_SHARD over the context group alone: the units as training builds them (the context
    # axis shards nothing here), the model given its split by the engine (replaced below)
    mesh = virtual_mesh(sharding, 0, context, context=context)
    fsdp = meta_engine(model, sharding, mesh)
    dtype = DType.parse(param_dtype, "sharding.param_dtype").torch
    # A mixture's sparse block holds more than a dense one (every token's k expert rows): the
    # first sparse block stands for every block when the model has any.
    blocks = [u for u in fsdp.units if u.name.startswith("layers.")]
    block_unit = next((u for u in blocks if hasattr(u.modules[0], "moe")), blocks[0])
    split = _TracedSplit(context, dense_masks) if context > 1 else None
    fsdp.module.context_split = split
    padded = chunk_layout(context, 0, seq_len)[0] if split is not None else seq_len
    with FakeTensorMode():
        _warm_rotary(block_unit.modules[0], padded, dtype)
        ctx, shared, local = None, 0, seq_len
        if split is not None:
            ctx, shared = split.context(fsdp.module, rows, seq_len, dtype)
            local = 2 * split.chunk
        block = _trace_block(block_unit, rows, local, model.dim, dtype, ctx)
    root = _root(model_key, rows, seq_len, param_dtype, chunk, context, dense_masks)
    return ActivationProfile(rows, seq_len, block, root, context, shared)


@lru_cache(maxsize=64)
def _root(
    model_key, rows: int, seq_len: int, param_dtype: str, chunk: int, context: int, dense: bool
) -> RootProfile:
    """The root's trace: the same with checkpointing on or off (the root's units are never
    checkpointed), so traced once for both (its chunked loss walks every chunk: the costlier
    trace at long sequences)."""
    model = thawed_model(model_key)
    sharding = ShardingConfig(strategy="NO_SHARD", param_dtype=param_dtype)
    fsdp = meta_engine(model, sharding, virtual_mesh(sharding, 0, context, context=context))
    dtype = DType.parse(param_dtype, "sharding.param_dtype").torch
    split = _TracedSplit(context, dense) if context > 1 else None
    fsdp.module.context_split = split
    padded = chunk_layout(context, 0, seq_len)[0] if split is not None else seq_len
    with FakeTensorMode():
        fsdp.module.rotary.tables(padded, torch.device("cpu"), dtype)  # cached, unmeasured
        if split is not None:
            split.context(fsdp.module, rows, seq_len, dtype)  # the chunks' masks, untracked
        return _trace_root(fsdp, rows, seq_len, dtype, chunk)


class _TracedSplit(ContextSplit):
    """The model's ContextSplit at context rank 0, for the trace: the K/V all-gather is a
    stand-in that allocates what the engine's does (forward: the gathered [N, ...]; backward:
    this rank's reduce-scattered gradient); the chunks' masks are made once, outside the
    tracker (`shared` counts their masks: none for plain causal sequences)."""

    def __init__(self, degree: int, dense: bool):
        super().__init__(degree, 0, lambda x: _StandInGather.apply(x, degree))
        self.dense = dense
        self.chunks: dict[int, ChunkAttention] = {}
        self.chunk = 0

    def context(self, model, rows: int, seq_len: int, dtype) -> tuple[AttentionContext, int]:
        """The AttentionContext every block sees, and the bytes of its shared masks."""
        padded, self.chunk, _ = chunk_layout(self.degree, self.rank, seq_len)
        tokens = torch.zeros(rows, seq_len, dtype=torch.long)
        self.chunks = {}
        for g in (self.rank, 2 * self.degree - 1 - self.rank):
            self.chunks[g] = super()._chunk_attention(g, self.chunk, None, rows, "cpu", False)
        _, positions, _, _, _, attn = self.shard(tokens, None, tokens, None, None)
        cos_sin = model.rotary.at(positions, tokens.device, dtype, span=padded)
        shared = sum(_nbytes(c.mask) for c in self.chunks.values() if c.mask is not None)
        return AttentionContext(cos_sin, split=attn), shared

    def shard(self, tokens, positions, targets, loss_weight, real, block=None):
        """The model's own split with the CPU's attention (what the fake tensors run)."""
        return super().shard(tokens, positions, targets, loss_weight, real, False)

    def _chunk_attention(self, g, c, doc, b, device, block) -> ChunkAttention:
        return self.chunks[g]


class _StandInGather(torch.autograd.Function):
    """trainer/fsdp/context.py's _GatherKV without a group: the same tensors, no data."""

    @staticmethod
    def forward(ctx, x, n: int):
        return x.new_empty((n * x.shape[0], *x.shape[1:])).view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(grad.shape[1:]), None


def _flat_tensors(unit, dtype: torch.dtype) -> list[torch.Tensor]:
    """One unsharded compute-dtype tensor per FlatParameter of the unit (the gathered parameters:
    the timeline counts them, so they are made outside the tracker). The flat gradient is
    dropped when complete (the engine hands it to the reduction, which the timeline counts)."""
    fulls = []
    for flat in unit.flats:
        full = torch.empty(flat.padded_numel, dtype=dtype, requires_grad=flat.requires_grad)
        if flat.requires_grad:
            full.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
        fulls.append(full)
    return fulls


def _use_views(unit, fulls: list[torch.Tensor]) -> None:
    """The unit's parameters become views of its flat tensors, as FSDPUnit.use_views does."""
    for flat, full in zip(unit.flats, fulls):
        for info, view in zip(flat.infos, flat.split_views(full)):
            setattr(unit.owners[info.module_name], info.attr, view)


def _bind_flat_views(unit, dtype: torch.dtype) -> list[torch.Tensor]:
    fulls = _flat_tensors(unit, dtype)
    _use_views(unit, fulls)
    return fulls


def _warm_rotary(block: torch.nn.Module, seq_len: int, dtype: torch.dtype) -> None:
    """The rotary tables are a small cache computed once per run; keep them out of the
    measurement."""
    block.attention.rotary.tables(seq_len, torch.device("cpu"), dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _trace_block(
    unit, rows: int, seq_len: int, dim: int, dtype: torch.dtype, ctx=None
) -> BlockProfile:
    """One block on [rows, seq_len, dim]; `ctx`: the context split's AttentionContext (None: the
    block's own causal one)."""
    fulls = _bind_flat_views(unit, dtype)
    x_leaf = torch.empty(rows, seq_len, dim, dtype=dtype, requires_grad=True)
    tracker = AllocationTracker()
    with tracker:
        x = x_leaf * 1  # a non-leaf input: it stays alive only if the block saves it
        before = tracker.current - _nbytes(x)
        tracker.restart_peak()
        args = (x,) if ctx is None else (x, ctx)
        y = unit.modules[0].forward(*args)  # the engine's forward: checkpointed when configured
        forward_peak = tracker.restart_peak() - before
        del x
        retained = tracker.current - before - _nbytes(y)
        dy = torch.empty_like(y)
        start = tracker.current
        tracker.restart_peak()
        y.backward(dy)
        backward_peak = tracker.restart_peak() - start
    del fulls
    return BlockProfile(retained, forward_peak, backward_peak, _nbytes(y))


def _trace_root(fsdp, rows: int, seq_len: int, dtype: torch.dtype, chunk: int = 0) -> RootProfile:
    """The model's own forward with no blocks: embedding -> norm -> output, then loss_sum (chunk
    0), or the chunked loss inside the model's forward, as trainer/step.py calls them. Each
    unit's flat gradient is dropped as it completes (the head's when the head's backward ends)."""
    model = fsdp.module
    model.layers = torch.nn.ModuleList()
    forward = model.forward
    if getattr(model, "visual", None) is not None:
        # A vision-language model: its tower is traced apart (tower.py); here the decoder's own
        # text path (one position per token: the multimodal positions read the tokens' values,
        # which fake tensors do not have).
        model.context = types.MethodType(Transformer.context, model)
        forward = types.MethodType(Transformer.forward, model)
    # As the engine does: a unit's parameters become views as it starts its forward, so the
    # head's flat gradient completes (and is dropped) as the head's backward ends.
    fulls = _bind_flat_views(fsdp.root, dtype)
    for u in fsdp.units:
        if not u.name.startswith("layers."):
            for m in u.modules:  # this throwaway engine's own hooks must not run in the trace
                m._forward_pre_hooks.clear()
                m._forward_hooks.clear()
            mine = _flat_tensors(u, dtype)
            fulls.extend(mine)
            u.modules[0].register_forward_pre_hook(lambda m, a, u=u, f=mine: _use_views(u, f))
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    targets = torch.zeros(rows, seq_len, dtype=torch.long)
    marks: dict[str, int] = {}
    tracker = AllocationTracker()

    def at_head_end(
        grad,
    ):  # the gradient reaching the embedding output: the head's backward is done
        marks.update(peak=tracker.restart_peak(), after=tracker.current)

    def mark_embedding_output(module, args, out) -> None:
        out.register_hook(at_head_end)

    model.tok_embeddings.register_forward_hook(mark_embedding_output)
    with tracker:
        # not model(...): that would run the engine's hooks; with targets (the chunked loss, or
        # a context split, which keeps this rank's tokens only in a forward with targets)
        if chunk or model.context_split is not None:
            s, _ = forward(tokens, targets=targets, loss_chunk_tokens=chunk)
            logits = None
        else:
            logits = forward(tokens)
            s, _ = loss_sum(logits, targets)
        loss = s / (rows * seq_len)
        del logits, s  # the training step holds only the loss from here
        forward_peak = tracker.restart_peak()
        retained = tracker.current
        loss.backward()
        embedding_peak = tracker.restart_peak()
    fulls.clear()
    return RootProfile(forward_peak, retained, marks["peak"], marks["after"], embedding_peak)
