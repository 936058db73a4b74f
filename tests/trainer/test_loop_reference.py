"""The loop against the outside world, not against itself: trainer/loop.py's run_training at world
sizes 1, 2 and 3 trains a tiny Llama (model=hf) step for step as a reference written from
transformers' LlamaForCausalLM, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW, with the
schedule the docs state (optim.lr: linear warmup over optim.warmup_steps, then cosine decay to
lr x optim.min_lr_ratio at train.steps), and clipping active at every step (optim.grad_clip
below every step's gradient norm).

Each step's loss agrees to fp32 1e-5, and the final weights to 1e-4 of the update's size. The
negative controls are the same reference without clipping, and with a constant lr: each parts
from the loop by far more than the tolerance, so a loop that ignored optim.grad_clip or the
schedule fails here (the deliberate bugs of issue 35 survived every loop test before this one).
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.hf.tiny import ours_from_hf, save
from trainer.config import DataConfig, ModelConfig, TrainerConfig
from trainer.data import Batches, PreparedData, find_dataset, prepare

transformers = pytest.importorskip("transformers")
STEPS, BATCH, SEQ = 8, 6, 32  # 6 sequences: 6 / 3+3 / 2+2+2 rows per rank
LR, WARMUP, MIN_LR_RATIO, CLIP, WD = 3e-3, 3, 0.1, 0.05, 0.1


def _train(rank, world, cfg, root):
    from trainer.fsdp.state import full_parameters
    from trainer.loop import Trainer, WorkerContext

    ctx = WorkerContext(rank=rank, world_size=world, checkpoint_root=root)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, ctx)
        result = trainer.run()
    params = full_parameters(trainer.model)
    return dict(losses=[loss for _, loss in result.losses], params=params)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TrainerConfig:
    d = tmp_path_factory.mktemp("reference")
    data = DataConfig(max_bytes=60_000, prepared_dir=str(d / "prep"), seq_len=SEQ)
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(data)
    hf = save("llama_head_dim", d / "llama", fields=dict(vocab_size=300))
    c = TrainerConfig(model=ModelConfig(name="hf", hf_path=str(hf)), data=data)
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = STEPS, BATCH, 0
    c.optim.lr, c.optim.warmup_steps, c.optim.min_lr_ratio = LR, WARMUP, MIN_LR_RATIO
    c.optim.grad_clip, c.optim.weight_decay = CLIP, WD
    c.optim.beta1, c.optim.beta2, c.optim.eps = 0.9, 0.95, 1e-8
    return c.validate()


def documented_lr(step: int, lr=LR, warmup=WARMUP, total=STEPS, floor=MIN_LR_RATIO) -> float:
    """The schedule as docs/configuration.md states it, written here from the words."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def reference(job: TrainerConfig, clip: bool = True, schedule: bool = True) -> dict:
    """transformers' model, the whole global batch in one process, torch's clip and AdamW
    (decay on tensors of 2+ dimensions, none on norms: the documented rule)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(job.model.hf_path).float()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    data = PreparedData.open(find_dataset(job.data.prepared_dir))
    batches = Batches(data, SEQ, job.data.seed, BATCH)
    losses, norms = [], []
    for step in range(STEPS):
        (mb,) = batches.micro_batches(step, 0, 1, 1)
        logits = model(mb.inputs).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
        loss = loss / mb.targets.numel()  # pre-training: every token of the global batch
        loss.backward()
        bound = CLIP if clip else math.inf  # negative control: the step without clipping
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), bound)))
        for group in opt.param_groups:
            group["lr"] = documented_lr(step) if schedule else LR
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return dict(losses=losses, norms=norms, model=model)


def in_our_names(model, path) -> dict:
    """`model`'s weights as our model names and lays them out (saved, then read back through
    the importer: tensor names and the rotary row order are the interchange's business)."""
    model.save_pretrained(path)
    return {k: p.detach() for k, p in ours_from_hf(path)[1].named_parameters()}


@pytest.fixture(scope="module")
def ref(job, tmp_path_factory):
    out = reference(job)
    out["params"] = in_our_names(out.pop("model"), tmp_path_factory.mktemp("trained"))
    _, start = ours_from_hf(job.model.hf_path)
    out["p0"] = {k: p.detach() for k, p in start.named_parameters()}
    return out


def test_every_step_clips_so_the_comparison_exercises_the_clip(ref):
    assert min(ref["norms"]) > 2 * CLIP, ref["norms"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_loop_trains_as_transformers_with_torch_clip_adamw_and_the_schedule(
    job, ref, tmp_path, world
):
    ours = run_distributed(_train, world, job, str(tmp_path / "ckpt"))[0]
    worst = max(abs(a - b) / b for a, b in zip(ours["losses"], ref["losses"]))
    assert worst <= 1e-5, (ours["losses"], ref["losses"])
    for name, value in ours["params"].items():
        theirs, start = ref["params"][name], ref["p0"][name]
        err = (value - theirs).norm() / (theirs - start).norm()
        assert err <= 1e-4, (name, float(err))
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the steps moved the model


@pytest.mark.parametrize("control", ["no clipping", "constant lr"])
def test_a_loop_that_ignored_the_clip_or_the_schedule_would_fail(job, ref, control):
    """The negative controls: each bug's reference parts from the real one by far more than the
    loop test's tolerance (losses 1e-5), within the 8 steps."""
    bugged = reference(job, clip=control != "no clipping", schedule=control != "constant lr")
    worst = max(abs(a - b) / b for a, b in zip(bugged["losses"], ref["losses"]))
    assert worst > 100 * 1e-5, (control, worst)
