"""fp32 values into bf16 storage: round to nearest, or stochastically with reproducible noise.

    round_into(dst, value32, Rounding.stochastic, key, index)   # dst: bf16 (or fp32: a copy)

bf16 keeps 8 bits of mantissa: an update smaller than half an ulp of the value it is added to
(lr * g against |w| / 256) vanishes under round-to-nearest, and a long run of them is lost
(plain bf16 training drifts). Stochastic rounding rounds up with probability equal to the
distance from the lower neighbour, so the rounded value equals the exact one in expectation and
small updates survive on average (torchao's `bf16_stochastic_round`: add 16 random bits below the
bf16 mantissa, then truncate).

The noise is not drawn from a generator: it is a hash of (`key`, the element's global `index`),
where the caller's key mixes the seed, the step and what is rounded (the master, a moment) and
which flat parameter. So it does not depend on how many ranks share the flat parameter or in
which order they run: the same element of the same step gets the same bits at world size 1, 2
or 3, and a resumed run draws what an uninterrupted one would have.
"""

from __future__ import annotations

import zlib

import torch

from .config import Rounding

MASK32 = 0xFFFFFFFF
CHUNK = 1 << 16
"""Elements rounded per pass: the int64 temporaries of the hash (512 KiB each) stay in cache;
at 4M elements a pass the same hash ran ~10x slower on a loaded 2-core host (memory-bound)."""


def hash32(x):
    """A 32-bit integer mix (Wellons' lowbias32 shape) of x in [0, 2**32): a Python int or an
    int64 tensor. Both multipliers are below 2**31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & MASK32
    return x ^ (x >> 16)


def name_key(name: str) -> int:
    """A stable 32-bit key of a name (a flat parameter's first parameter, a state's name)."""
    return zlib.crc32(name.encode()) & MASK32


def step_key(seed: int, step, stream: int):
    """The key of one rounding stream at one step: a Python int, or an int64 tensor when `step`
    is one (on the device, so the host never reads the step count)."""
    base = hash32((hash32(seed & MASK32) ^ stream) & MASK32)
    if torch.is_tensor(step):
        return hash32((step.to(torch.int64) * 0x9E3779B + base) & MASK32)
    return hash32((int(step) * 0x9E3779B + base) & MASK32)


def noise16(key, start: int, numel: int, device) -> torch.Tensor:
    """16 pseudo-random bits (int32 in [0, 2**16)) for global elements [start, start + numel)."""
    x = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    x.bitwise_xor_(key).bitwise_and_(MASK32)
    for _ in range(2):  # two rounds of hash32, in place
        x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(MASK32)
        x.bitwise_xor_(x >> 15).mul_(0x68E31DA5).bitwise_and_(MASK32)
        x.bitwise_xor_(x >> 16)
    return (x >> 16).to(torch.int32)


def stochastic_bf16(value: torch.Tensor, key, start: int) -> torch.Tensor:
    """`value` (fp32, 1-D) rounded to bf16 stochastically; element i is global element start+i."""
    bits = value.contiguous().view(torch.int32) + noise16(key, start, value.numel(), value.device)
    # Truncating the low 16 bits of sign-magnitude bits rounds the magnitude down; the noise
    # carried into bit 16 with probability (dropped bits / 2**16): the rounding up.
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)


def round_into(dst: torch.Tensor, value: torch.Tensor, rounding: Rounding, key, start: int) -> None:
    """dst <- value (fp32), rounded as `rounding` says when dst is bf16; in chunks of CHUNK.
    `start`: the global index of dst's first element (what the noise is keyed by)."""
    if dst.dtype != torch.bfloat16 or rounding is Rounding.nearest:
        dst.copy_(value)
        return
    for a in range(0, dst.numel(), CHUNK):
        b = min(a + CHUNK, dst.numel())
        dst[a:b].copy_(stochastic_bf16(value[a:b], key, start + a))
