"""The engine: wrap any nn.Module tree into FSDP units and schedule their communication.

    model = build_model(cfg, device="meta")
    fsdp = FSDPModel(model, sharding_cfg, mesh, device, units=block_policy(model),
                     init_fn=lambda m, prefix: init_parameters(m, seed, prefix))
    opt = torch.optim.AdamW(fsdp.param_groups(weight_decay=0.1), lr=...)
    loss = loss_fn(fsdp(tokens)); loss.backward(); fsdp.clip_grad_norm_(1.0); opt.step(); fsdp.zero_grad()

Schedule (one step, FULL_SHARD):
  forward:  root gathers (kept until backward ends); unit i waits for its gather, issues unit i+1's
            gather (forward prefetch), computes, reshards.
  backward: the hook on unit i's output gathers unit i (already prefetched), issues unit i-1's gather
            (backward prefetch); when unit i's flat gradient is complete its reduce-scatter is issued
            at once and the unit reshards; a callback at the end of backward waits for every
            reduction and writes the fp32 gradient shards.
The number of units holding unsharded parameters, other than the one computing, never exceeds
`max_gathers_in_flight` (the root counts: it stays gathered through forward and backward).
"""
from __future__ import annotations

import collections
import contextlib
import math
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from trainer.config import ShardingConfig, ShardingStrategy

from .accounting import Accounting
from .collectives import Collectives, Handle, _all_gather
from .flat_param import FlatParameter, ParamInfo
from .mesh import ShardMesh
from .unit import FSDPUnit, TrainingState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROOT = "root"


def block_policy(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Default wrap policy: one unit per transformer block (children of a ModuleList `layers`)."""
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class FSDPModel(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, cfg: ShardingConfig, mesh: ShardMesh, device: torch.device,
                 units: Optional[list[torch.nn.Module]] = None,
                 init_fn: Optional[Callable[[torch.nn.Module, str], None]] = None):
        super().__init__()
        self.module = model
        self.cfg, self.mesh, self.device = cfg, mesh, torch.device(device)
        self.strategy = ShardingStrategy.parse(cfg.strategy)
        self.param_dtype, self.reduce_dtype = DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype]
        self.acct = Accounting(trace_enabled=cfg.trace)
        self.comm = Collectives(self.acct, self.device)
        unit_modules = block_policy(model) if units is None else units
        names = {id(m): n for n, m in model.named_modules()}
        self.units: list[FSDPUnit] = [self._make_unit(names[id(m)], m, names, init_fn) for m in unit_modules]
        self.root = self._make_unit(ROOT, model, names, init_fn, exclude=unit_modules)
        self._order: list[FSDPUnit] = []  # forward execution order of the non-root units
        self._order_known = False
        # Reductions issued and not yet folded into the gradient shards, oldest first.
        self._pending: collections.deque = collections.deque()
        self._in_backward = False
        self._install_hooks()
        if cfg.activation_checkpointing:
            for u in self.units:
                u.module.forward = _checkpointed(u.module.forward)
        self.acct.set("sharded_params", sum(f.shard_numel * 4 for f in self.flats()))

    # ---- construction -------------------------------------------------------------------
    def _make_unit(self, name, module, names, init_fn, exclude=()) -> FSDPUnit:
        excluded = {id(p) for m in exclude for p in m.parameters()}
        owners, trainable, frozen, seen = {}, [], [], set()
        for mod_name, mod in module.named_modules():
            for attr, p in list(mod.named_parameters(recurse=False)):
                if id(p) in excluded or id(p) in seen:
                    continue
                seen.add(id(p))
                fqn_mod = names[id(mod)]
                owners[fqn_mod] = mod
                entry = (fqn_mod, attr, p)
                (trainable if p.requires_grad else frozen).append(entry)
        flats = [self._flatten(entries, owners, init_fn, rg)
                 for entries, rg in ((trainable, True), (frozen, False)) if entries]
        unit = FSDPUnit(name, module, flats, owners, self.mesh, self.comm, self.acct, self.param_dtype,
                        self.reduce_dtype, reshard_after_forward=self._reshard_after_forward(name))
        unit.on_grad_ready = self._on_grad_ready
        return unit

    def _reshard_after_forward(self, name: str) -> bool:
        if name == ROOT:
            return False  # the root's parameters are needed first in backward: keep them
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    def _flatten(self, entries, owners, init_fn, requires_grad: bool) -> FlatParameter:
        # Matrices (weight decay) first, then the rest: two contiguous regions (see flat_param.py).
        entries = sorted(entries, key=lambda e: e[2].ndim < 2)
        infos, offset = [], 0
        for mod_name, attr, p in entries:
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            infos.append(ParamInfo(fqn, mod_name, attr, p.shape, offset, p.ndim >= 2))
            offset += p.numel()
        flat = FlatParameter(infos, self.mesh.shard_size, self.mesh.shard_rank, requires_grad, self.device)
        # One parameter at a time: materialise it, copy the slice this rank owns, drop it. Peak
        # memory is the shard plus the largest single parameter, never the unit or the model.
        for (mod_name, attr, p), info in zip(entries, infos):
            value = self._materialize(owners[mod_name], mod_name, attr, p, init_fn)
            a, b = max(info.offset, flat.lo), min(info.offset + info.numel, flat.hi)
            if a < b:
                flat.shard[a - flat.lo:b - flat.lo].copy_(value.reshape(-1)[a - info.offset:b - info.offset])
            del value
            delattr(owners[mod_name], attr)  # the attribute becomes a plain tensor view at unshard
        return flat

    def _materialize(self, owner, mod_name, attr, p, init_fn) -> torch.Tensor:
        """The initial value of one original parameter, built on this rank only for its unit.

        Meta parameters are materialised one owner module at a time and initialised by `init_fn`,
        which is keyed by parameter name, so every rank computes the same values and a model that
        does not fit on one rank is never whole anywhere."""
        if not p.is_meta:
            return p.detach()
        if init_fn is None:
            raise ValueError(f"parameter {mod_name}.{attr} is on the meta device; pass init_fn to initialise it")
        if getattr(owner, "_fsdp_materialized", False) is False:
            owner.to_empty(device=self.device, recurse=False)
            init_fn(owner, f"{mod_name}." if mod_name else "")
            owner._fsdp_materialized = True
        return getattr(owner, attr).detach()

    def flats(self) -> Iterator[FlatParameter]:
        for u in self.all_units():
            yield from u.flats

    def all_units(self) -> list[FSDPUnit]:
        return [self.root, *self.units]

    # ---- optimizer interface --------------------------------------------------------------
    def param_groups(self, weight_decay: float) -> list[dict]:
        decay, no_decay = [], []
        for flat in self.flats():
            for p, d, _ in flat.opt_params:
                (decay if d else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def zero_grad(self) -> None:
        """Zero the fp32 gradient shards (kept allocated: they are persistent state, 4 B/param/N)."""
        for flat in self.flats():
            if flat.grad is not None:
                flat.grad.zero_()
            flat.grad_is_zero = True

    # ---- hooks --------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self.module.register_forward_pre_hook(self._root_pre_forward)
        self.module.register_forward_hook(self._root_post_forward)
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module, args):
        if self._in_backward:
            raise RuntimeError("forward called before the previous backward finished")
        if self._order and not self._order_known:
            self._order_known = True
        elif not self._order_known:
            self._order = []
        for u in self.all_units():
            u.reset_iteration()
            u.state = TrainingState.FORWARD
        self.acct.event("compute_start", "forward", ROOT)
        self.root.issue_gather()
        if self._order_known and self.cfg.forward_prefetch and self._order:
            self._prefetch(self._order[0], current=None)  # overlaps the root's gather if the bound allows two
        self.root.wait_gather()
        self.root.use_views()

    def _root_post_forward(self, module, args, output):
        self.acct.event("compute_end", "forward", ROOT)
        if torch.is_grad_enabled():
            _register_output_hooks(output, self._root_pre_backward)
        else:  # inference: nothing will come back for these parameters
            for u in self.all_units():
                u.reshard()
                u.state = TrainingState.IDLE
        return output

    def _pre_forward(self, u: FSDPUnit):
        if not self._order_known:
            self._order.append(u)
        u.state = TrainingState.FORWARD
        u.wait_gather()
        u.use_views()
        if self._order_known and self.cfg.forward_prefetch:
            nxt = self._next(u, +1)
            if nxt is not None:
                self._prefetch(nxt, current=u)
        self.acct.event("compute_start", "forward", u.name)

    def _post_forward(self, u: FSDPUnit, output):
        self.acct.event("compute_end", "forward", u.name)
        if u.reshard_after_forward:
            u.reshard()
        if torch.is_grad_enabled():
            _register_output_hooks(output, lambda g, u=u: self._pre_backward(u))
        return output

    def _root_pre_backward(self, grad):
        if self._in_backward:
            return grad
        self._in_backward = True
        self.root.state = TrainingState.BACKWARD_PRE
        self.root.wait_gather()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self.cfg.backward_prefetch and self._order:
            self._prefetch(self._order[-1], current=self.root)
        return grad

    def _pre_backward(self, u: FSDPUnit):
        if u.pre_backward_done:
            return
        u.pre_backward_done = True
        u.state = TrainingState.BACKWARD_PRE
        u.wait_gather()
        if self.cfg.backward_prefetch:
            prev = self._next(u, -1)
            if prev is not None:
                self._prefetch(prev, current=u)
        self.acct.event("compute_start", "backward", u.name)

    def _next(self, u: FSDPUnit, step: int) -> Optional[FSDPUnit]:
        if u not in self._order:
            return None
        i = self._order.index(u) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _prefetch(self, target: FSDPUnit, current: Optional[FSDPUnit]) -> None:
        """Issue target's gather if the bound on resident units (other than `current`) allows."""
        if target.is_resident():
            return
        # Units that keep their parameters until backward ends (SHARD_GRAD_OP) are not prefetch
        # memory: only gathers still in flight count for them.
        reshards = self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        resident = sum(1 for x in self.all_units()
                       if x is not current and (x.gather_in_flight() or (reshards and x.is_resident())))
        if resident < self.cfg.max_gathers_in_flight:
            target.issue_gather()

    # ---- gradient reduction ---------------------------------------------------------------
    def _on_grad_ready(self, u: FSDPUnit, i: int, g: torch.Tensor) -> None:
        """Launch the reduction of flat i of unit u; fold in the oldest pending one past the bound.

        Invariant: at most max_reductions_in_flight unsharded gradients are alive after this call
        (one more while the newest is issued), whatever the depth of the model."""
        g = g if g.dtype == self.reduce_dtype else g.to(self.reduce_dtype)
        self.acct.alloc("unsharded_grads", g.numel() * g.element_size())
        flat, m = u.flats[i], self.mesh
        if m.shard_size > 1:
            out = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=g.device)
            h = self.comm.reduce_scatter(out, g, m.shard_group, m.shard_size, u.name)
        else:
            out = g
            h = self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name) if m.replicate_size > 1 else None
        self._pending.append((u, i, out, h, g.numel() * g.element_size()))
        while len(self._pending) > self.cfg.max_reductions_in_flight:
            self._complete(*self._pending.popleft())

    def _complete(self, u: FSDPUnit, i: int, out: torch.Tensor, h: Optional[Handle], gbytes: int,
                  hybrid_done: bool = False) -> None:
        """Wait for one reduction (and, for HYBRID, its all-reduce across replicas); fold it in."""
        if h is not None:
            h.wait()
        m = self.mesh
        if m.shard_size > 1 and m.replicate_size > 1 and not hybrid_done:
            self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name).wait()
        self._accumulate_grad(u.flats[i], out)
        self.acct.free("unsharded_grads", gbytes)

    def _finish_backward(self) -> None:
        """End of backward: wait for every reduction, write fp32 gradient shards, reshard."""
        m = self.mesh
        pending, self._pending = list(self._pending), collections.deque()
        hybrid = []
        if m.shard_size > 1 and m.replicate_size > 1:
            # HYBRID: all shards' reduce-scatters first, then their all-reduces across replicas, overlapped
            for u, i, out, h, gbytes in pending:
                if h is not None:
                    h.wait()
                hybrid.append(self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name))
            for hy in hybrid:
                hy.wait()
        for u, i, out, h, gbytes in pending:
            self._complete(u, i, out, h, gbytes, hybrid_done=bool(hybrid))
        for u in self.all_units():
            u.reshard()
            u.state = TrainingState.IDLE
        self._in_backward = False

    def _accumulate_grad(self, flat: FlatParameter, out: torch.Tensor) -> None:
        if flat.grad is None:
            flat.grad = torch.zeros(flat.shard_numel, dtype=torch.float32, device=out.device)
            self.acct.alloc("sharded_grads", flat.shard_numel * 4)
            flat.attach_grad_views()
        if flat.grad_is_zero:
            flat.grad.copy_(out)
        else:
            flat.grad.add_(out)
        flat.grad_is_zero = False

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate unsharded gradients locally; the next backward outside reduces."""
        for u in self.all_units():
            u.no_sync = True
        try:
            yield
        finally:
            for u in self.all_units():
                u.no_sync = False

    def grad_shards(self) -> list[torch.Tensor]:
        return [f.grad for f in self.flats() if f.grad is not None]

    # ---- clipping -------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient across shards (padding excluded, replicas counted once);
        scales the gradients by min(1, max_norm / (norm + 1e-6)) when max_norm > 0. Returns the norm."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for flat in self.flats():
            if flat.grad is not None and flat.valid_numel:
                sq += flat.grad[:flat.valid_numel].pow(2).sum()
        if self.mesh.shard_size > 1:
            dist.all_reduce(sq, group=self.mesh.shard_group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for flat in self.flats():
                if flat.grad is not None:
                    flat.grad.mul_(coef)
        return norm

    # ---- state for checkpoints -------------------------------------------------------------
    def param_pieces(self):
        """(fqn, full shape, start element, shard tensor slice) for every piece this rank holds."""
        for flat in self.flats():
            for info, start, count, off in flat.local_pieces():
                yield info.fqn, tuple(info.shape), start, flat.shard[off:off + count]

    def optim_pieces(self, optimizer: torch.optim.Optimizer):
        """(fqn, state name, full shape, start, tensor slice) for every optimizer state piece."""
        for flat in self.flats():
            if not flat.requires_grad:
                continue
            for info, start, count, off in flat.local_pieces():
                p, base = _view_at(flat, off)
                for name, value in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.numel() == p.numel() and value.dim() > 0:
                        yield info.fqn, name, tuple(info.shape), start, value[off - base:off - base + count]

    def load_pieces(self, read: Callable[[str, int, int], torch.Tensor],
                    optimizer: Optional[torch.optim.Optimizer] = None, optim_step: float = 0.0,
                    optim_state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> None:
        """Fill this rank's shards from any checkpoint layout: read(key, start, numel) returns elements
        [start, start+numel) of the full tensor `key` ("model/<fqn>" or "optim/<fqn>/<state>")."""
        with torch.no_grad():
            for flat in self.flats():
                for info, start, count, off in flat.local_pieces():
                    flat.shard[off:off + count].copy_(read(f"model/{info.fqn}", start, count))
            if optimizer is None:
                return
            for flat in (f for f in self.flats() if f.requires_grad):
                for p, _, _ in flat.opt_params:
                    st = optimizer.state[p]
                    st["step"] = torch.tensor(float(optim_step), dtype=torch.float32)
                    for name in optim_state_names:
                        st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for info, start, count, off in flat.local_pieces():
                    p, base = _view_at(flat, off)
                    for name in optim_state_names:
                        optimizer.state[p][name][off - base:off - base + count].copy_(
                            read(f"optim/{info.fqn}/{name}", start, count))

    def update_optim_accounting(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer state bytes of this rank (per-element state only; scalar step counters excluded)."""
        n = 0
        for st in optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    n += v.numel() * v.element_size()
        self.acct.set("optim_state", n)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every original parameter, gathered in fp32 (for tests and export; costs a full copy)."""
        out = {}
        for flat in self.flats():
            full = torch.empty(flat.padded_numel, dtype=torch.float32, device=flat.shard.device)
            if self.mesh.shard_size > 1:
                _all_gather(full, flat.shard, group=self.mesh.shard_group)
            else:
                full.copy_(flat.shard)
            for info in flat.infos:
                out[info.fqn] = full[info.offset:info.offset + info.numel].view(info.shape).clone()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every original parameter's reduced fp32 gradient, gathered (for tests)."""
        out = {}
        for flat in self.flats():
            if not flat.requires_grad:
                continue
            g = flat.grad if flat.grad is not None else torch.zeros_like(flat.shard)
            full = torch.empty(flat.padded_numel, dtype=torch.float32, device=g.device)
            if self.mesh.shard_size > 1:
                _all_gather(full, g, group=self.mesh.shard_group)
            else:
                full.copy_(g)
            for info in flat.infos:
                out[info.fqn] = full[info.offset:info.offset + info.numel].view(info.shape).clone()
        return out

    def num_params(self) -> int:
        return sum(f.numel for f in self.flats())

    def largest_unit_bytes(self) -> int:
        return max(u.gathered_bytes for u in self.all_units())


def _view_at(flat: FlatParameter, off: int):
    """The optimizer view (and its start in the shard) that holds shard offset `off`."""
    for p, _, base in flat.opt_params:
        if base <= off < base + p.numel():
            return p, base
    raise KeyError(off)


def _checkpointed(fn):
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def _register_output_hooks(output, hook) -> None:
    """Call hook(grad) when the gradient of any tensor in `output` arrives (before its backward)."""
    tensors = [output] if torch.is_tensor(output) else [t for t in _flatten_out(output) if torch.is_tensor(t)]
    for t in tensors:
        if t.requires_grad:
            t.register_hook(lambda g: (hook(g), g)[1])


def _flatten_out(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten_out(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten_out(y)
    else:
        yield x
