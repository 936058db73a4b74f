"""The ZeRO paper's model-state memory per device (Rajbhandari et al. 2020, section 5 and figure 1).

Mixed-precision Adam over Psi parameters: fp16 parameters (2 Psi) and gradients (2 Psi), and
K Psi of optimizer state (fp32 master copy, momentum, variance: K = 12). On N devices:

    stage 0 (data parallel)       (2 + 2 + K) Psi
    stage 1 (optimizer states)    (2 + 2) Psi + K Psi / N
    stage 2 (+ gradients)         2 Psi + (2 + K) Psi / N
    stage 3 (+ parameters)        (2 + 2 + K) Psi / N

7.5B parameters on 64 devices: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.

How our strategies map (fp32 master, bf16 compute copy, fp32 gradient shards, AdamW):
  NO_SHARD = stage 0:     4 (master) + 4 (grad) + 8 (m, v) = 16 Psi, the paper's total; the
                          bf16 compute copy (2 Psi) exists only during forward/backward.
  FULL_SHARD = stage 3:   16 Psi / N, the paper's figure exactly (plus padding, < N per unit).
  SHARD_GRAD_OP ~ stage 2: the gathered bf16 parameters (2 Psi) through backward + 16 Psi / N:
                          2 Psi / N above the paper's, because our gradient shards are fp32.
  Stage 1 (replicated gradients, sharded optimizer) has no counterpart in the engine.
"""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)


def zero_stage_bytes(
    params: int, devices: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> float:
    """Model-state bytes per device for ZeRO `stage` (0 = plain data parallel)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage={stage!r}; valid: {', '.join(map(str, ZERO_STAGES))}")
    if devices < 1:
        raise ValueError(f"devices={devices!r}; valid: a positive integer")
    p, g, o = param_bytes * params, grad_bytes * params, k * params
    n = devices
    return {0: p + g + o, 1: p + g + o / n, 2: p + (g + o) / n, 3: (p + g + o) / n}[stage]
