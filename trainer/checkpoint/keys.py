"""The tensor-key scheme, in both directions: the only place checkpoint keys are spelled.

    model/<fqn>              an original parameter (fp32, or bf16 from a bf16 master), by its
                             fully-qualified name
    optim/<fqn>/<state>      its optimizer state (AdamW: exp_avg, exp_avg_sq)

Keys name tensors of the MODEL, never ranks, flat parameters or wrap units, so any world size,
strategy or wrap policy reads what any other wrote (DESIGN.md invariant 3).
"""

from __future__ import annotations

from typing import Optional

MODEL = "model/"
OPTIM = "optim/"


def param_key(fqn: str) -> str:
    return f"{MODEL}{fqn}"


def optim_key(fqn: str, state: str) -> str:
    return f"{OPTIM}{fqn}/{state}"


def param_name(key: str) -> Optional[str]:
    """The parameter a `model/` key names, None for any other key."""
    return key[len(MODEL) :] if key.startswith(MODEL) else None
