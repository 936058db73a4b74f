"""The mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router and E stacked SwiGLU
experts, dropless, each token sent to its top-k experts.

    moe = MoE(cfg)                      # layers.<i>.moe of a sparse block
    y = moe(x, ctx)                     # x [B, T, D]; ctx.real: the tokens that are not padding

In transformers' order (modeling_qwen3_moe / modeling_mixtral, transformers 5): router logits in
the compute dtype; softmax in fp32; top-k; renormalised over the k when the family says
(Qwen3-MoE `norm_topk_prob`, Mixtral always); the routing weights cast back to the compute dtype
(Qwen3-MoE) or kept in fp32 (Mixtral). Then the k copies of every token are sorted by expert
(a stable argsort: the same routing gives the same order, so an activation-checkpointed
recomputation matches), each projection of all experts is ONE grouped matmul over the sorted
rows (`grouped_mm`: torch._grouped_mm where it runs, checked once per device and dtype, else a
loop over the experts' contiguous slices; never a loop over tokens), the outputs are weighted,
put back in token order and the k copies summed. No capacity factor: no token is dropped.

Where the sorted rows are computed is the `dispatcher`'s business: `LocalDispatch` (every
expert here) or the engine's all-to-all over the expert axis (trainer/fsdp/experts.py), which
sends the rows to the ranks holding their experts and brings the outputs back in order. The
layer knows only that its `experts` hold rows [first, first + E_local) of the E.

The load-balancing loss (LoadBalance below): each forward records the layer's routing
statistics over the real tokens, counts C_l [E] (top-k assignments) and probability sums S_l
[E]; the training step combines them over layers, micro-batches and ranks into transformers'
    aux = E * sum_e C_e S_e / N^2,   C = sum_l C_l, S = sum_l S_l, N = L_sparse x real tokens
and its gradient, coef * E / N^2 * C_e per unit of S_l,e (C is piecewise constant), enters at
each layer's output through `_AuxGrad`, inside the layer's own backward (so under FULL_SHARD the
router's weights are gathered when it runs).
"""

from __future__ import annotations

import functools
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from .config import ModelConfig
from .initialization import linear, residual_std

# ----------------------------------------------------------------------------- grouped matmul


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of `a` [S, K] grouped by expert (group g is rows [ends[g-1], ends[g])) times each
    group's `w[g]` [N, K] (nn.Linear's out x in): [S, N]. One kernel where torch._grouped_mm
    runs for this device and dtype, else one matmul per non-empty group."""
    if _planning(a):  # the planner's fake tensors: the same shapes (and saved tensors), no data
        return a @ w[0].T
    if grouped_mm_ok(a.device.type, a.dtype, a.shape[1], w.shape[1]):
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=ends.to(torch.int32))
        if out.requires_grad:  # its backward refuses a broadcast (zero-stride) gradient
            out.register_hook(lambda g: g.contiguous())
        return out
    return grouped_mm_loop(a, w, ends)


def _planning(t: torch.Tensor) -> bool:
    """A fake or meta tensor (the planner traces the layer's memory): no data to look at."""
    return t.is_meta or isinstance(t, FakeTensor)


def bincount(values: torch.Tensor, bins: int) -> torch.Tensor:
    """Counts of 0 .. bins - 1 in `values` (int64 [bins]): a scatter-add, whose shape does not
    depend on the data (torch.bincount's does: the planner's fake tensors cannot run it)."""
    out = torch.zeros(bins, dtype=torch.int64, device=values.device)
    return out.scatter_add_(0, values.reshape(-1), torch.ones_like(values.reshape(-1)))


def grouped_mm_loop(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """grouped_mm as a loop over the groups (one host read of `ends`)."""
    bounds = [0, *ends.tolist()]
    pieces = [a[s:e] @ w[g].T for g, (s, e) in enumerate(zip(bounds, bounds[1:])) if e > s]
    if not pieces:  # no row at all: an empty result that still depends on w (a zero gradient)
        return a[:0] @ w[0].T
    return torch.cat(pieces)


@functools.lru_cache(maxsize=None)
def grouped_mm_ok(device: str, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether torch._grouped_mm runs here: the op exists, the rows' strides are multiples of 16
    bytes, CUDA is sm_80 or newer, and a small forward and backward on this device equals the
    loop (checked once per device, dtype and shape class)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = torch.empty(0, dtype=dtype).element_size()
    if (k * size) % 16 or (n * size) % 16:
        return False
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        return False
    try:
        return _probe(device, dtype)
    except (RuntimeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def _probe(device: str, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(24, 16, generator=g).to(device, dtype).requires_grad_()
    w = torch.randn(3, 8, 16, generator=g).to(device, dtype).requires_grad_()
    ends = torch.tensor([5, 5, 24], device=device)
    out = torch._grouped_mm(a, w.transpose(-2, -1), offs=ends.to(torch.int32))
    ga, gw = torch.autograd.grad(out.float().square().sum(), (a, w))
    ref = grouped_mm_loop(a.detach().float(), w.detach().float(), ends)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(out.float(), ref, rtol=tol, atol=tol)) and bool(
        torch.isfinite(ga).all() and torch.isfinite(gw).all()
    )


# ----------------------------------------------------------------------------- the experts


class Experts(nn.Module):
    """Stacked SwiGLU experts: w1, w3 [E_local, F, D] and w2 [E_local, D, F], each expert's rows
    laid out as its nn.Linear (out x in) in a published checkpoint. They are rows
    [first, first + E_local) of the model's `total` (the engine keeps only its own and places
    them apart: `stacked_experts`, trainer/fsdp/wrap.py); every expert is drawn at init from
    (seed, name, its global index), so any cut of the experts starts from the same values."""

    stacked_experts = True

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, std: float, out_std: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.init_stds = {"w1": std, "w3": std, "w2": out_std}  # initialization.py reads them
        self.first, self.total = 0, n_experts  # the global index of row 0; all experts

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [S, D] sorted by local expert, `counts` [E_local] rows each -> [S, D]."""
        ends = torch.cumsum(counts, 0)
        h = F.silu(grouped_mm(xs, self.w1, ends)) * grouped_mm(xs, self.w3, ends)
        return grouped_mm(h, self.w2, ends)

    def localize(self, first: int, count: int) -> None:
        """Keep experts [first, first + count) only (on the meta device: nothing is copied)."""
        for name in ("w1", "w3", "w2"):
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(p.detach()[first : first + count].clone()))
        self.first = first


class Dispatch(Protocol):
    """Where the sorted rows go: rows of `xs` sorted by global expert, `counts` [E] per expert
    -> the experts' outputs for those rows, in the same order."""

    def __call__(
        self, xs: torch.Tensor, counts: torch.Tensor, experts: Experts
    ) -> torch.Tensor: ...


def local_dispatch(xs: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here."""
    return experts(xs, counts)


# ----------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    """A sparse block's feed-forward: `router` [E, D] and the `experts`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.norm_topk, self.weights_fp32 = cfg.moe_norm_topk, cfg.moe_weights_fp32
        self.router = linear(cfg.dim, cfg.moe_experts, cfg.init_std)
        self.experts = Experts(
            cfg.moe_experts, cfg.dim, cfg.moe_ffn_dim, cfg.init_std, residual_std(cfg)
        )
        self.dispatch: Dispatch = local_dispatch
        self.balance: Optional[LoadBalance] = None  # the model's, set by the Transformer
        self.stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor, real: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, D]; `real` [B, T] bool (None: every token), what the statistics count."""
        shape, d = x.shape, x.shape[-1]
        x = x.reshape(-1, d)
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:  # Qwen3-MoE combines in the compute dtype, Mixtral in fp32
            weights = weights.to(logits.dtype)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = bincount(flat, self.n_experts)
        ys = self.dispatch(x[order // self.top_k], counts, self.experts)
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.empty_like(ys)
        out[order] = ys
        y = out.view(-1, self.top_k, d).sum(dim=1).to(x.dtype).view(shape)
        return self._record(y, probs, chosen, real)

    def _record(self, y, probs, chosen, real) -> torch.Tensor:
        """Keep this forward's statistics (assigned, not added: a recomputation in backward
        rewrites the same values) and hook the aux loss's gradient onto the output."""
        if real is not None:
            keep = real.reshape(-1, 1).to(probs.dtype)
            probs = probs * keep
            chosen = torch.where(keep.bool(), chosen, self.n_experts)  # padding: a bin of its own
        counts = bincount(chosen, self.n_experts + 1)[: self.n_experts]
        sums = probs.sum(dim=0)
        self.stats = (counts, sums.detach())
        if self.balance is not None and torch.is_grad_enabled() and sums.requires_grad:
            y = _AuxGrad.apply(y, sums, self.balance)
        return y


class _AuxGrad(torch.autograd.Function):
    """Identity on the layer's output; in backward, the aux loss's gradient for the layer's
    probability sums (LoadBalance.coeff, set by the step before backward; none: no gradient)."""

    @staticmethod
    def forward(ctx, y, sums, balance):
        ctx.balance = balance
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        coeff = ctx.balance.coeff
        return grad, (None if coeff is None else coeff.to(grad.device)), None


class LoadBalance:
    """The model's sparse layers' load-balancing loss, over the global batch (the training step
    drives it: trainer/step.py):

        balance.begin()                    # a step starts: the statistics are zeroed
        ... forward of a micro-batch ...   # each layer records C_l, S_l
        balance.collect()                  # add them to the step's
        balance.set_gradient(C, n, scale)  # global counts and real tokens -> the gradient
        ... backward ...
        aux = balance.aux(C, S, n)         # transformers' aux loss, from global statistics
    """

    def __init__(self, layers: list[MoE], coef: float):
        self.layers, self.coef = layers, coef
        self.n_experts = layers[0].n_experts if layers else 0
        self.coeff: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None  # [L, E] int64, this rank's, this step
        self.sums: Optional[torch.Tensor] = None  # [L, E] fp32

    def begin(self) -> None:
        self.counts = self.sums = self.coeff = None

    def collect(self) -> None:
        """Add each layer's statistics of the forward that just ran to the step's."""
        counts = torch.stack([m.stats[0] for m in self.layers])
        sums = torch.stack([m.stats[1] for m in self.layers]).float()
        if self.counts is None:
            self.counts, self.sums = counts, sums
        else:
            self.counts, self.sums = self.counts + counts, self.sums + sums

    def set_gradient(self, counts: torch.Tensor, real_tokens, scale: float = 1.0) -> None:
        """The gradient of coef x aux per unit of any layer's probability sums, from the global
        counts [L, E] and real tokens of the step; `scale` the loss scale the step uses (fp16)."""
        if not self.coef:
            self.coeff = None
            return
        n = len(self.layers) * real_tokens
        total = counts.sum(dim=0).to(torch.float32)
        self.coeff = total * (self.coef * self.n_experts * scale / (n * n))

    def aux(self, counts: torch.Tensor, sums: torch.Tensor, real_tokens) -> torch.Tensor:
        """transformers' load_balancing_loss_func, from global statistics [L, E]."""
        n = len(self.layers) * real_tokens
        c = counts.sum(dim=0).to(torch.float64)
        s = sums.sum(dim=0).to(torch.float64)
        return (self.n_experts * (c * s).sum() / (n * n)).to(torch.float32)

    @staticmethod
    def load(counts: torch.Tensor) -> torch.Tensor:
        """Per layer, the busiest expert's tokens over the mean's: 1.0 is perfectly balanced."""
        c = counts.to(torch.float32)
        return c.max(dim=1).values / c.mean(dim=1).clamp_min(1e-9)
