"""Vision-language fine-tuning end to end through the real CLI: a tiny random Qwen2-VL folder
(model=hf), chat records whose user turns hold pictures (paths beside the JSONL), local Ray with
2 CPU workers, the vision tower frozen and replicated (train.freeze, sharding.modules), the
export, and the exported model answering held-out pictures in transformers.

The task (tests/cluster/vision_task.py): the colour of a noisy picture with a square of
another colour on it, asked in the same words whatever the colour, so only the image's features
can answer. The tower stays the random one it was imported with (frozen, merger included): the
decoder learns to read its features. Held-out pictures are processed by transformers' own image
processor (the Pillow backend) and answered by transformers' generate.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.cluster.conftest import REPO, run_cli
from tests.cluster.vision_task import QUESTIONS, answer, write_records, write_vlm_folder
from trainer.checkpoint import list_checkpoints

STEPS = 80


def overrides(launch, model) -> list[str]:
    return [
        "model=hf",
        f"model.hf_path={model}",
        "data=chat",
        f"data.source={launch}/data/records.jsonl",
        f"data.tokenizer={model}/tokenizer.json",
        "data.seq_len=128",
        "data.eval_fraction=0",
    ]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    launch = tmp_path_factory.mktemp("vl")
    model = write_vlm_folder(launch / "model")
    write_records(launch / "data", 240, seed=0)
    result = run_cli(
        launch,
        *overrides(launch, model),
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.checkpoint_every=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "train.freeze=[visual.*]",
        "sharding.modules={visual*:no_shard}",
        "cluster.num_workers=2",
        "cluster.run_name=vl",
        "tracking.experiment=vl",
        timeout=420,
    )
    assert result.returncode == 0, result.output[-6000:]
    (last,) = [c for c in list_checkpoints(f"{launch}/runs/vl/checkpoints") if c.step == STEPS]
    out = launch / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "trainer.hf", "export", last.path, str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    return launch, model, out, result.output


def test_the_exported_model_names_the_colour_of_held_out_pictures_in_transformers(finetuned):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    launch, _, out, _ = finetuned
    held = write_records(launch / "held", 8, seed=99)  # pictures the run never saw
    model = Qwen2VLForConditionalGeneration.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    processor = AutoImageProcessor.from_pretrained(out, backend="pil")  # the export's own file
    answers = [answer(model, tokenizer, processor, p, QUESTIONS[i % 3]) for i, (p, _) in
               enumerate(held)]  # fmt: skip
    right = sum(a == colour for a, (_, colour) in zip(answers, held))
    assert right >= 7, list(zip(answers, [c for _, c in held]))


def test_the_frozen_tower_is_bitwise_the_imported_one_and_the_decoder_moved(finetuned):
    _, model, out, output = finetuned
    before = load_file(str(model / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    tower = [k for k in before if k.startswith("visual.")]
    assert len(tower) == 31
    for k in tower:
        assert torch.equal(before[k], after[k]), k
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert "train.freeze: 31 of 58 tensors frozen" in output
    assert "[visual.*: 31 tensors, 79,552]" in output


@pytest.mark.parametrize(
    "extra, says",
    [
        (["train.context_parallel=2"], "train.context_parallel=2"),
        (["train.freeze=[vision.*]"], "train.freeze"),
    ],
)
def test_what_a_vision_run_cannot_be_stops_before_ray_starts(tmp_path, extra, says):
    model = write_vlm_folder(tmp_path / "model")
    write_records(tmp_path / "data", 4, seed=1)
    result = run_cli(tmp_path, *overrides(tmp_path, model), *extra, timeout=120)
    assert result.returncode != 0
    assert says in result.output, result.output[-3000:]
    assert "started a local Ray for this job" not in result.output


def test_image_data_for_a_text_model_stops_before_ray_starts(tmp_path):
    model = write_vlm_folder(tmp_path / "model")
    write_records(tmp_path / "data", 4, seed=1)
    result = run_cli(
        tmp_path, "data=chat", f"data.source={tmp_path}/data/records.jsonl",
        f"data.tokenizer={model}/tokenizer.json", "model.vocab_size=320", timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "has no vision tower" in result.output, result.output[-3000:]
    assert "started a local Ray for this job" not in result.output
