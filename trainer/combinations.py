"""Which sections of a job combine: the checks across model, sharding, data and train that no
one section can make alone (TrainerConfig.validate calls them). A combination not built yet is
refused here with one line, before any worker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.fsdp.config import fail

if TYPE_CHECKING:
    from trainer.config import TrainerConfig


def check_combinations(cfg: TrainerConfig) -> None:
    """Experts against expert_parallel and context parallelism; context parallelism against the
    sequence length; a vision tower against context parallelism (its image tokens are placed by
    the whole sequence, which a context rank does not hold)."""
    experts, ep = cfg.model.moe_experts, cfg.sharding.expert_parallel
    if ep > 1 and not experts:
        fail("sharding.expert_parallel", ep, "1 (a dense model: model.moe_experts=0)")
    if experts and experts % ep:
        valid = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        fail(
            "sharding.expert_parallel",
            ep,
            f"a divisor of the model's {experts} experts ({valid})",
        )
    cp = cfg.train.context_parallel
    if cp > 1 and experts:
        fail(
            "train.context_parallel",
            cp,
            f"1 with a mixture of experts (model.moe_experts={experts}): context parallelism "
            "and expert routing do not combine yet",
        )
    if cp > 1 and cfg.data.seq_len < 2 * cp:
        fail(
            "train.context_parallel",
            cp,
            f"at most data.seq_len / 2 = {cfg.data.seq_len // 2} (each rank holds two "
            "chunks of every sequence)",
        )
    if cp > 1 and cfg.model.vision is not None:
        fail(
            "train.context_parallel",
            cp,
            f"1 with a vision-language model (model.family={cfg.model.family}): the image "
            "tokens and the 3-D rotary positions need the whole sequence on each rank",
        )
