"""Context parallelism, the model's half: each rank computes two chunks of every sequence, and
attention reads the keys and values of the whole sequence.

    model.context_split = ContextSplit(N, i, gather)  # the engine: trainer/fsdp/context.py
    loss, count = model(tokens, positions, targets=targets)  # the whole [B, T]; my chunks' loss

With N ranks on the mesh's `context` axis (train.context_parallel), a sequence of T tokens is
padded to a multiple of 2N and cut into 2N chunks of c tokens; rank i computes chunks i and
2N-1-i (causal balance: an early chunk attends to few keys, a late one to many, and each rank has
one of each, as torchtitan and Megatron split). Every rank of a context group is given the same
whole micro-batch (token ids and positions are small) and keeps its chunks here, in the model's
forward, before the embedding; so the loop, the step and the loss normaliser do not change (the
global batch's loss-token count, DESIGN.md invariant 1), and the loss this rank returns is the
sum over its own tokens (the step's all-reduce adds the chunks up).

- Positions stay global: the rotary tables are indexed by each token's position in the whole
  sequence (or in its packed document), never by its index in the chunk.
- Attention: per layer, the keys and values of this rank's chunks (after rotary, before the
  grouped-query repeat) are all-gathered over the context group (`gather`: an autograd function
  whose backward reduce-scatters their gradients, so backward is exact) and put in sequence
  order. Each local query chunk then attends to one contiguous key range: from the start of the
  earliest document its first query belongs to, up to its own end. Keys after the chunk are
  causally masked and keys before that document's start are masked by the document mask, so
  those ranges are never computed (a chunk inside one short document reads only that
  document's keys); inside the range the mask is exact (same document, key <= query).
- Padding (T not a multiple of 2N) goes at the end: its tokens are no loss tokens (weight 0) and
  come after every real query, so causality keeps every real token from seeing them.

Why an all-gather of K/V rather than ring attention: docs/engine.md, "Long sequences".
Pure torch: the collective is the `gather` the engine installs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

Gather = Callable[[torch.Tensor], torch.Tensor]
"""x [B, 2c, ...] (this rank's chunks) -> [N, B, 2c, ...] every rank's, in context-rank order;
differentiable (its backward reduce-scatters)."""


def chunk_layout(degree: int, rank: int, length: int) -> tuple[int, int, torch.Tensor]:
    """(padded length, chunk size c, the global indices of rank's 2c tokens): chunks rank and
    2*degree-1-rank of a sequence of `length` tokens padded to a multiple of 2*degree."""
    parts = 2 * degree
    padded = -(-length // parts) * parts
    c = padded // parts
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((parts - 1 - rank) * c, (parts - rank) * c)
    return padded, c, torch.cat([first, second])


def sequence_order(degree: int) -> list[int]:
    """For each global chunk g in order, its slot in the gathered [rank, 2 chunks] layout."""
    parts = 2 * degree
    return [2 * g if g < degree else 2 * (parts - 1 - g) + 1 for g in range(parts)]


@dataclass
class ChunkAttention:
    """One local query chunk's key range [lo, hi) in the whole sequence, and its mask there."""

    lo: int
    hi: int
    mask: object
    """[B, 1, c, hi - lo] bool (True = may attend: documents on the CPU), a FlexAttention
    BlockMask (CUDA), or None: plain causal, keys [lo, hi - c) all visible and the last c
    causally (`causal_chunk_attention`: no mask exists)."""


@dataclass
class SplitAttention:
    """What every layer's attention needs in one forward under context parallelism."""

    split: "ContextSplit"
    chunk: int
    padded: int
    chunks: tuple[ChunkAttention, ChunkAttention]
    order: torch.Tensor
    """sequence_order on the device, made once a forward (every layer reorders by it)."""

    def attend(self, q, k, v, repeat_kv, attend_fn) -> torch.Tensor:
        """q [B, 2c, H, hd], k/v [B, 2c, kv, hd] of this rank's chunks -> [B, 2c, H, hd].
        `repeat_kv` expands kv heads to the query heads; `attend_fn(q, k, v, mask)` on
        [B, H, T, hd] tensors (trainer/model/attention.py's attend)."""
        b, _, kv_heads, hd = k.shape
        n, c = self.split.degree, self.chunk
        gathered = self.split.gather(torch.cat([k, v], dim=-1))  # [N, B, 2c, kv, 2hd]
        slots = gathered.view(n, b, 2, c, kv_heads, 2 * hd).transpose(0, 1)
        slots = slots.reshape(b, 2 * n, c, kv_heads, 2 * hd)
        whole = slots.index_select(1, self.order).reshape(b, self.padded, kv_heads, 2 * hd)
        outs = []
        for j, part in enumerate(self.chunks):
            keys = whole[:, part.lo : part.hi]
            kj, vj = repeat_kv(keys[..., :hd]), repeat_kv(keys[..., hd:])
            qj, kj, vj = (x.transpose(1, 2) for x in (q[:, j * c : (j + 1) * c], kj, vj))
            if part.mask is None:
                out = causal_chunk_attention(qj, kj, vj)
            else:
                out = attend_fn(qj, kj, vj, part.mask)
            outs.append(out.transpose(1, 2))
        return torch.cat(outs, dim=1)


def causal_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, c, hd], the last c of k/v's keys its own positions: the keys before them all
    visible, the last c causal (query i sees key i of them and those before). No mask is built:
    on the CPU the two parts run as flash attention (a dense mask of c x keys would be copied to
    fp32 on every call, more memory than the split saves) and are merged by their log-sum-exp,
    whose backward is exact (`_CausalChunk`); elsewhere one masked call."""
    c, keys = q.shape[2], k.shape[2]
    if keys == c:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type == "cpu":
        return _CausalChunk.apply(q, k, v)
    allowed = torch.arange(keys, device=q.device)[None, :] <= (
        keys - c + torch.arange(c, device=q.device)[:, None]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _CausalChunk(torch.autograd.Function):
    """Attention of q over a visible prefix and a causal square, merged by log-sum-exp (as ring
    attention merges blocks): out = sum_p exp(lse_p - lse) out_p. Backward runs each part's flash
    backward with the merged output and log-sum-exp, which is the exact gradient of the whole
    softmax (each part's probabilities are exp(s - lse) with the whole row's lse)."""

    @staticmethod
    def forward(ctx, q, k, v):
        split = k.shape[2] - q.shape[2]
        kp, vp, kd, vd = k[:, :, :split], v[:, :, :split], k[:, :, split:], v[:, :, split:]
        out_p, lse_p = _flash(q, kp, vp, 0.0, False)
        out_d, lse_d = _flash(q, kd, vd, 0.0, True)
        lse = torch.logaddexp(lse_p, lse_d)
        out = out_p * torch.exp(lse_p - lse).unsqueeze(-1).to(out_p.dtype)
        out = out + out_d * torch.exp(lse_d - lse).unsqueeze(-1).to(out_d.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        split = k.shape[2] - q.shape[2]
        grad = grad.contiguous()
        dq_p, dk_p, dv_p = _flash_backward(
            grad, q, k[:, :, :split], v[:, :, :split], out, lse, 0.0, False
        )
        dq_d, dk_d, dv_d = _flash_backward(
            grad, q, k[:, :, split:], v[:, :, split:], out, lse, 0.0, True
        )
        return dq_p + dq_d, torch.cat([dk_p, dk_d], dim=2), torch.cat([dv_p, dv_d], dim=2)


class ContextSplit:
    """This rank's share of every sequence (the module docstring): `degree` ranks, this one at
    context coordinate `rank`, K/V exchanged by `gather`."""

    def __init__(self, degree: int, rank: int, gather: Gather):
        if not 0 <= rank < degree:
            raise ValueError(f"ContextSplit: rank {rank} outside 0..{degree - 1}")
        self.degree, self.rank, self.gather = degree, rank, gather

    def shard(self, tokens, positions, targets, loss_weight, real, block: Optional[bool] = None):
        """The whole micro-batch -> (tokens, positions, targets, loss_weight, real) of this
        rank's chunks, positions global (within each document when `positions` is given), and
        the SplitAttention of the forward. `block` forces FlexAttention block masks (default:
        on CUDA) or dense masks."""
        b, t = tokens.shape
        device = tokens.device
        padded, c, idx = chunk_layout(self.degree, self.rank, t)
        idx = idx.to(device)
        pad = padded - t
        if positions is None:
            whole_pos = torch.arange(padded, device=device).expand(b, padded)
            doc = None
        else:
            whole_pos = positions
            if pad:  # the padding continues the last document: after every real query
                tail = positions[:, -1:] + torch.arange(1, pad + 1, device=device)
                whole_pos = torch.cat([positions, tail], dim=1)
            doc = torch.cumsum((whole_pos == 0).to(torch.int32), dim=1)
        if pad:
            tokens = F.pad(tokens, (0, pad))
            if targets is not None:
                targets = F.pad(targets, (0, pad))
                if not torch.is_tensor(loss_weight):
                    w = 1.0 if loss_weight is None else float(loss_weight)
                    loss_weight = torch.full((b, t), w, device=device)
                loss_weight = F.pad(loss_weight, (0, pad))
            if real is not None:
                real = F.pad(real, (0, pad))
        local = [x if x is None else x[:, idx] for x in (tokens, targets, real)]
        if torch.is_tensor(loss_weight):
            loss_weight = loss_weight[:, idx]
        use_block = block if block is not None else device.type == "cuda"
        chunks = tuple(
            self._chunk_attention(g, c, doc, b, device, use_block)
            for g in (self.rank, 2 * self.degree - 1 - self.rank)
        )
        order = torch.tensor(sequence_order(self.degree), device=device)
        attn = SplitAttention(self, c, padded, chunks, order)
        return local[0], whole_pos[:, idx], local[1], loss_weight, local[2], attn

    def _chunk_attention(self, g, c, doc, b, device, block) -> ChunkAttention:
        q0, hi = g * c, (g + 1) * c
        if doc is None or block:  # a block mask skips the empty blocks itself, at fixed shapes
            lo = 0
        else:  # the start of the earliest document a first query of the chunk is in
            starts = (doc < doc[:, q0 : q0 + 1]).sum(dim=1)
            lo = int(starts.min())  # one host read per chunk and forward, before the layers
        qi = torch.arange(q0, hi, device=device)
        ki = torch.arange(lo, hi, device=device)
        if block:
            from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

            dq = None if doc is None else doc[:, q0:hi]
            dk = None if doc is None else doc[:, lo:hi]

            def mask_mod(batch, head, q, kv):
                causal = q + q0 >= kv + lo
                return causal if dq is None else causal & (dq[batch, q] == dk[batch, kv])

            mask = create_block_mask(
                mask_mod, None if doc is None else b, None, hi - q0, hi - lo, device=device
            )
        elif doc is None:  # plain causal: no mask at all (causal_chunk_attention)
            mask = None
        else:
            mask = (ki[None, :] <= qi[:, None])[None, None]
            mask = mask & (doc[:, q0:hi, None] == doc[:, None, lo:hi])[:, None]
        return ChunkAttention(lo, hi, mask)
