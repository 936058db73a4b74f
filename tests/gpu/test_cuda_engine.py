"""The engine on CUDA with NCCL at world size 1 (one GPU cannot host two NCCL ranks): bf16,
fused AdamW, the collective streams, and the activation-checkpointing memory saving. World sizes
2-4 on one GPU: test_threaded_ranks.py. Skipped without CUDA; on a GPU machine `make gpu-check`
runs them (or `make test ARGS=tests/gpu`)."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import free_port
from trainer.config import OptimConfig, ShardingConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.model import build_model, initializer, loss_sum
from trainer.optim import build_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def nccl():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(cfg: ShardingConfig, steps=3, model=None, batch=8, seq=512):
    """(losses, peak bytes above what was allocated at the start: this run's own)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mcfg = model or model_config("125m", n_layers=4)
    fsdp = parallelize(
        build_model(mcfg, device="meta"), cfg, build_mesh(cfg, 0, 1), "cuda", init_fn=initializer(0)
    )
    opt = build_optimizer(fsdp, OptimConfig(lr=1e-3))  # fused on CUDA, as the loop builds it
    g = torch.Generator(device="cpu").manual_seed(0)
    losses = []
    for _ in range(steps):
        toks = torch.randint(0, 256, (batch, seq + 1), generator=g).cuda()
        s, _ = loss_sum(fsdp(toks[:, :-1]), toks[:, 1:])
        (s / toks[:, 1:].numel()).backward()
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        fsdp.zero_grad()
        losses.append(float(s) / toks[:, 1:].numel())
    torch.cuda.synchronize()
    return losses, torch.cuda.max_memory_allocated() - base


def test_bf16_full_shard_trains_on_cuda_with_nccl(nccl):
    fp32, _ = _train(ShardingConfig(strategy="FULL_SHARD"))
    bf16, _ = _train(ShardingConfig(strategy="FULL_SHARD", param_dtype="bfloat16"))
    assert all(torch.isfinite(torch.tensor(bf16)))
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 2e-2


def test_activation_checkpointing_saves_memory_on_cuda(nccl):
    # All 12 blocks of 125m: the planner puts this job at 5.14 GiB without checkpointing and 3.62
    # with (0.70). With 4 blocks the logits dominate and it predicts 0.84: no 0.8 bound holds.
    model = model_config("125m")
    bf16 = dict(strategy="FULL_SHARD", param_dtype="bfloat16")
    _, plain = _train(ShardingConfig(**bf16), steps=1, model=model)
    _, ckpt = _train(ShardingConfig(**bf16, activation_checkpointing=True), steps=1, model=model)
    assert ckpt < 0.8 * plain, (ckpt, plain)


def test_collectives_run_on_their_own_streams(nccl):
    cfg = ShardingConfig()
    fsdp = parallelize(
        build_model(model_config("tiny"), device="meta"),
        cfg,
        build_mesh(cfg, 0, 1),
        "cuda",
        init_fn=initializer(0),
    )
    streams = fsdp.comm.streams
    assert len({s.cuda_stream for s in streams.values()}) == 3
    assert torch.cuda.current_stream().cuda_stream not in {s.cuda_stream for s in streams.values()}
