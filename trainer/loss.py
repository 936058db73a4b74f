"""The token loss: a sum of fp32 cross-entropies, plain (from the logits) or chunked (from the
hidden states, through the output projection, never holding the full logits).

    s, n = loss_sum(model(tokens), targets, weight)                  # plain: [tokens, vocab]
    s, n = projected_loss_sum(h, head_weight, targets, weight, 512)  # chunked: [512, vocab]

Both return (sum of token cross-entropies as an fp32 scalar, number of tokens counted) and agree
to fp32 rounding, gradients included. The caller divides by the GLOBAL token count of the step
(DESIGN.md invariant 1). `weight` is None, a number (a micro-batch weight: 0.0 marks a padding
micro-batch that must still run backward but adds nothing) or a tensor shaped like `targets`
(per-token weights, the loss mask of fine-tuning; tokens of weight 0 are not counted, and the
count is then a device tensor). Targets of -100 are ignored, as F.cross_entropy does.

The chunked form (train.loss_chunk_tokens) is one autograd Function: its forward walks the
tokens `chunk` at a time, each chunk's logits -> fp32 -> cross-entropy -> the gradient of the
chunk's weighted loss with respect to its logits (softmax - one-hot) -> d/dh for the chunk's
hidden states and d/dW accumulated for the projection; only those two are kept, and backward
scales them by the incoming gradient (1 / global tokens, the fp16 loss scale). So at most one
chunk's [chunk, vocab] logits exist at a time, with no extra matmul (the gradients come from
the very logits the loss was computed from). d/dW is accumulated in the projection's dtype, as
the plain backward produces it, so it never holds more than the plain path; at a 128k vocabulary
the fp32 logits of 8k tokens (4 GiB, and as much again for their gradient) become 256 MiB.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""F.cross_entropy's default: a target of -100 adds nothing and gets no gradient."""

AUTO_MIN_VOCAB = 16384
"""train.loss_chunk_tokens=null turns chunking on from this vocabulary size up. benchmarks.loss
measured no vocabulary where it costs step time on the CPU (paired step-time ratios chunked /
plain of 0.62 at 8k, 0.98 at 32k, 0.85-1.01 at 128k): the fused gradient makes fewer passes over
the logits than autograd's log_softmax backward. The bar sits above 8k so the small models of the
tests and benchmarks (vocab <= 8192: fp32 logits <= 256 MiB at 8k tokens, nothing to save) keep
the plain loss; every real tokenizer (32k and up: Llama 2's 32000, Llama 3's 128256, Qwen's
151936) gets it."""

AUTO_CHUNK_BYTES = 256 * 2**20
"""train.loss_chunk_tokens=null: chunks of as many tokens as keep one chunk's fp32 logits near
this (512 tokens at a 128k vocabulary), a multiple of 128 tokens, at least 128."""


def resolve_chunk_tokens(setting: Optional[int], vocab_size: int) -> int:
    """train.loss_chunk_tokens against the model's vocabulary: the chunk in tokens, 0 = plain.

    None (auto): on from AUTO_MIN_VOCAB up, chunks of about AUTO_CHUNK_BYTES of fp32 logits; 0:
    off; N > 0: chunks of N tokens."""
    if setting is not None:
        if not isinstance(setting, int) or isinstance(setting, bool) or setting < 0:
            raise ValueError(
                f"train.loss_chunk_tokens: got {setting!r}; valid: null (on for large "
                "vocabularies), 0 (off) or a positive number of tokens"
            )
        return setting
    return auto_chunk_tokens(vocab_size) if vocab_size >= AUTO_MIN_VOCAB else 0


def auto_chunk_tokens(vocab_size: int) -> int:
    """The chunk auto takes: about AUTO_CHUNK_BYTES of fp32 logits, a multiple of 128 tokens."""
    return max(128, AUTO_CHUNK_BYTES // (4 * vocab_size) // 128 * 128)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, weight=None):
    """(sum of token cross-entropies as an fp32 scalar, number of tokens counted) from the
    logits [..., vocab], in fp32 even from bf16 logits (see the module docstring for `weight`)."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    if weight is None or not torch.is_tensor(weight):
        w = 1.0 if weight is None else float(weight)
        total = F.cross_entropy(flat_logits, flat_targets, reduction="sum") * w
        return total, (flat_targets.numel() if w != 0 else 0)
    per_token = F.cross_entropy(flat_logits, flat_targets, reduction="none")
    w = weight.reshape(-1).to(per_token.dtype)
    return (per_token * w).sum(), (w != 0).sum()  # a device count: reading it would sync


def projected_loss_sum(
    h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, weight=None, chunk: int = 0
):
    """loss_sum(F.linear(h, head), targets, weight) computed `chunk` tokens at a time (see the
    module docstring); chunk 0 is the plain loss. h [..., dim], head [vocab, dim]."""
    if not chunk:
        return loss_sum(F.linear(h, head), targets, weight)
    flat_h = h.reshape(-1, h.shape[-1])
    flat_targets = targets.reshape(-1)
    if weight is None or not torch.is_tensor(weight):
        scale = 1.0 if weight is None else float(weight)
        token_weights, count = None, (flat_targets.numel() if scale != 0 else 0)
    else:
        scale, token_weights = 1.0, weight.reshape(-1).float()
        count = (token_weights != 0).sum()
    if torch.is_grad_enabled() and (flat_h.requires_grad or head.requires_grad):
        total = _ChunkedCrossEntropy.apply(flat_h, head, flat_targets, token_weights, scale, chunk)
    else:  # evaluation: the loss only, one chunk of logits at a time
        total = (
            sum(
                _chunk_loss(flat_h[a:b], head, flat_targets[a:b], _slice(token_weights, a, b))
                for a, b in _chunks(flat_h.shape[0], chunk)
            )
            * scale
        )
    return total, count


def _chunks(n: int, chunk: int):
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)] or [(0, 0)]


def _slice(w: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if w is None else w[a:b]


def _chunk_ce(z: torch.Tensor, targets: torch.Tensor, w: Optional[torch.Tensor]):
    """(weighted CE sum, log-sum-exp per token, the gather-safe targets, valid) of fp32 logits z
    [c, vocab]; without a host sync (ignored targets are masked, never looked for)."""
    valid = targets != IGNORE_INDEX
    safe = targets.clamp_min(0)
    lse = torch.logsumexp(z, 1)
    ce = (lse - z.gather(1, safe[:, None]).squeeze(1)) * valid
    return (ce if w is None else ce * w).sum(), lse, safe, valid


def _chunk_loss(h, head, targets, w) -> torch.Tensor:
    return _chunk_ce(F.linear(h, head).float(), targets, w)[0]


def _scale_(t: torch.Tensor, g: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """t *= g in place, the product rounded once from fp32 (a bf16 copy of g would be 0.4% off),
    a block of rows at a time so the fp32 temporary stays small."""
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(g)
    for a in range(0, t.shape[0], rows):
        t[a : a + rows] = t[a : a + rows].float() * g
    return t


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ head.T, t_i) * scale, its gradients computed in forward (see the
    module docstring). Inputs: h [N, dim], head [vocab, dim], targets [N], token weights [N] or
    None, scale (a number), chunk (tokens)."""

    @staticmethod
    def forward(ctx, h, head, targets, token_weights, scale, chunk):
        need_h, need_head = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None
        dhead = torch.zeros_like(head) if need_head else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a, b in _chunks(h.shape[0], chunk):
            hc, w = h[a:b], _slice(token_weights, a, b)
            z = F.linear(hc, head).float()  # from bf16 a copy (the bf16 logits die here)
            valid = targets[a:b] != IGNORE_INDEX
            safe = targets[a:b].clamp_min(0)
            target_logit = z.gather(1, safe[:, None]).squeeze(1)
            top = z.amax(1, keepdim=True)
            z.sub_(top).exp_()  # in place: no second [chunk, vocab] tensor
            norm = z.sum(1)
            ce = top.squeeze(1) + norm.log() - target_logit
            tw = valid.float() if w is None else valid * w  # ignored targets weigh 0
            total += (ce * tw).sum()
            # d(sum w * ce)/dz = w * (softmax(z) - onehot): one pass scales exp(z - top) by
            # w / norm (an ignored target's row becomes all zero), then -w at the target.
            z.mul_((tw / norm)[:, None])
            z.scatter_add_(1, safe[:, None], -tw[:, None])
            dz = z.to(head.dtype)
            del z
            if dh is not None:
                torch.mm(dz, head, out=dh[a:b])
            if dhead is not None:
                dhead.addmm_(dz.t(), hc)
            del dz
        ctx.scale, ctx.done = scale, False
        ctx.save_for_backward(dh, dhead)
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        if ctx.done:
            raise RuntimeError(
                "the chunked loss (train.loss_chunk_tokens) runs backward once: its gradients "
                "are scaled in place (retain_graph is not supported; set loss_chunk_tokens=0)"
            )
        ctx.done = True
        dh, dhead = ctx.saved_tensors
        g = grad.float() * ctx.scale
        gh = None if dh is None else _scale_(dh, g)
        ghead = None if dhead is None else _scale_(dhead, g)
        return gh, ghead, None, None, None, None
