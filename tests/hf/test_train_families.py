"""model=hf and import-hf train every family's new tensors: a tiny Qwen3 (q/k norms, head_dim
24) trained with model=hf and a tiny tied Qwen2 (q/k/v biases) resumed from `import-hf` both
start from transformers' own loss on the first batch and learn, on 2 ranks."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.dist_utils import run_distributed
from tests.hf.tiny import save, transformers_first_loss
from trainer.config import DataConfig, ModelConfig, TrainerConfig
from trainer.data import prepare
from trainer.hf.__main__ import main as hf_main

transformers = pytest.importorskip("transformers")
BYTE_VOCAB = dict(vocab_size=300)  # byte-level data: at least 256 ids


def _train(rank, world, cfg, root):
    from trainer.loop import WorkerContext, run_training

    with contextlib.redirect_stdout(io.StringIO()) as out:
        r = run_training(cfg, WorkerContext(rank=rank, world_size=world, checkpoint_root=root))
    return dict(losses=[x for _, x in r.losses], printed=out.getvalue())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    d = DataConfig(max_bytes=100_000, prepared_dir=str(tmp_path_factory.mktemp("prep")), seq_len=32)
    prepare(d)
    return d


def job(hf_path, data: DataConfig) -> TrainerConfig:
    c = TrainerConfig(model=ModelConfig(name="hf", hf_path=str(hf_path)), data=data)
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = 3, 4, 0
    c.optim.warmup_steps, c.optim.lr = 1, 3e-3
    return c


def test_a_qwen3_trains_from_model_hf_starting_at_transformers_loss(data, tmp_path):
    cfg = job(save("qwen3", tmp_path / "qwen3", fields=BYTE_VOCAB), data)
    run = run_distributed(_train, 2, cfg, str(tmp_path / "ckpt"))[0]
    assert "initialised from" in run["printed"]
    assert run["losses"][0] == pytest.approx(transformers_first_loss(cfg), rel=1e-4)
    assert run["losses"][-1] < run["losses"][0]


def test_a_tied_qwen2_resumes_from_import_hf_starting_at_transformers_loss(data, tmp_path):
    src = save("qwen2_tied", tmp_path / "qwen2", fields=BYTE_VOCAB)
    root = tmp_path / "runs" / "ft" / "checkpoints"
    with contextlib.redirect_stdout(io.StringIO()):
        assert hf_main(["import", str(src), str(root)]) == 0
    cfg = job(src, data)
    run = run_distributed(_train, 2, cfg, str(root))[0]
    assert "resumed from" in run["printed"] and "initialised from" not in run["printed"]
    assert run["losses"][0] == pytest.approx(transformers_first_loss(cfg), rel=1e-4)
    assert run["losses"][-1] < run["losses"][0]
