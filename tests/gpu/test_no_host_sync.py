"""A training step queues its work and never waits for the GPU: Trainer.train_step (bf16,
FULL_SHARD, fused AdamW, batches from pinned memory) runs under
torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call (.item(),
float(tensor), a copy to the host, a blocking copy). Skipped without CUDA.

Its CPU twin runs the same Trainer steps on the CPU with gloo (no sync check there: a CPU has
nothing to wait for), so the path a bare GPU machine takes (the loop without Ray or MLflow, the
data preparation, the pinned-memory loader's code) is proven in CI before it meets CUDA.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import free_port
from trainer.config import TrainerConfig
from trainer.data import prepare

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.fixture()
def one_rank(device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_training_step_never_waits_for_the_device(tmp_path, device, one_rank):
    from trainer.loop import Trainer, WorkerContext

    cfg = TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim = 256, 4, 4, 768
    cfg.data.max_bytes, cfg.data.prepared_dir, cfg.data.seq_len = 100_000, str(tmp_path), 128
    cfg.train.device, cfg.train.steps, cfg.train.global_batch_size = device, 10, 8
    cfg.train.micro_batches = 2
    cfg.sharding.param_dtype = "bfloat16" if device == "cuda" else "float32"  # bf16 is slow on CPUs
    cfg.validate()
    prepare(cfg.data)
    trainer = Trainer(cfg, WorkerContext(rank=0, world_size=1, checkpoint_root=str(tmp_path)))
    trainer.loader = trainer.make_loader()
    try:
        for _ in range(2):  # the first steps record the orders and create the optimizer state
            trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            losses = [trainer.train_step()[0] for _ in range(3)]
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    finally:
        trainer.loader.close()
    assert all(torch.isfinite(torch.stack(losses)).tolist())
