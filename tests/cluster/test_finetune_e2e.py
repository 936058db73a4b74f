"""Fine-tuning end to end through the real CLI: chat data, local Ray, 2 CPU workers, export, and
the exported model answering in transformers.

The task is a lookup: each of a few made-up words has a made-up code, asked in varied ways. The
tiny model learns it from the assistant turns only (the prompts are not trained on), so after
training, the exported model prompted with the chat template's generation prompt must answer
each word's code and end its turn with <|im_end|> (the eos id the export writes). A model that
never trained, or an export that loses the template or the eos, fails.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from benchmarks.packing import write_chat_tokenizer
from tests.cluster.conftest import REPO, run_cli
from trainer.checkpoint import list_checkpoints

FACTS = {"zorp": "kiwi", "blen": "fig", "quax": "lime", "drem": "plum"}
ASK = ["{w}?", "code of {w}?", "what is {w}", "{w} please"]
STEPS = 120


def write_lookup_corpus(path) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(400):
            word = rng.choice(sorted(FACTS))
            ask = rng.choice(ASK).format(w=word)  # a number makes every record its own document
            messages = [
                {"role": "user", "content": f"{ask} #{i}"},
                {"role": "assistant", "content": FACTS[word]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    launch = tmp_path_factory.mktemp("ft")
    write_lookup_corpus(launch / "sft.jsonl")
    tokenizer = write_chat_tokenizer(str(launch), str(launch / "sft.jsonl"), 320)
    result = run_cli(
        launch,
        "data=chat",
        f"data.source={launch}/sft.jsonl",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "data.eval_fraction=0.1",
        "model.vocab_size=320",
        "model.dim=128",
        "model.n_layers=2",
        "model.ffn_dim=384",
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.checkpoint_every=0",
        f"train.eval_every={STEPS}",
        "train.sample_prompts=2",
        "train.sample_tokens=8",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "cluster.num_workers=2",
        "cluster.run_name=ft",
        "tracking.experiment=ft",
        timeout=420,
    )
    assert result.returncode == 0, result.output[-6000:]
    (last,) = [c for c in list_checkpoints(f"{launch}/runs/ft/checkpoints") if c.step == STEPS]
    out = launch / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "trainer.hf", "export", last.path, str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    return launch, out, last.path, result.output


def test_the_exported_model_answers_the_lookup_and_ends_its_turn(finetuned):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, out, _, _ = finetuned
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    stops = GenerationConfig.from_pretrained(out).eos_token_id
    assert eos in (stops if isinstance(stops, list) else [stops]), stops
    right = 0
    for word, code in FACTS.items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"code of {word}? #7"}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True,
        )["input_ids"]  # fmt: skip
        new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        assert eos in new, (word, tok.decode(new))  # it stops at the end of its turn
        right += tok.decode(new[: new.index(eos)]).strip() == code
    assert right >= 3, right


def test_trainer_generate_answers_from_the_sharded_checkpoint(finetuned):
    _, _, step, _ = finetuned
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.generate", step, "--chat", "code of zorp? #3", "--json",
         "--max-new-tokens", "12"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["text"].strip() == FACTS["zorp"], answer


def test_the_run_logged_its_loss_masked_training_and_generated_samples(finetuned):
    launch, _, _, output = finetuned
    client = MlflowClient(f"sqlite:///{launch}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ft").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["data.train_on"] == "assistant"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert f"samples/step_{STEPS}.txt" in artifacts, artifacts
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_tokenizer_without_a_chat_template_stops_before_ray_starts(tmp_path):
    write_lookup_corpus(tmp_path / "sft.jsonl")
    tokenizer = write_chat_tokenizer(str(tmp_path), str(tmp_path / "sft.jsonl"), 320)
    (tmp_path / "tokenizer_config.json").unlink()  # no template beside the tokenizer
    result = run_cli(
        tmp_path, "data=chat", f"data.source={tmp_path}/sft.jsonl", f"data.tokenizer={tokenizer}",
        "model.vocab_size=320", timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "data.chat_template" in result.output, result.output[-3000:]
    assert "started a local Ray for this job" not in result.output
