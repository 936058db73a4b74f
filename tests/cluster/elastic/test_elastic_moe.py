"""A mixture of experts fine-tuned through the real CLI on an elastic Ray cluster that grows and
shrinks, across expert degrees (issue 36).

A tiny random Qwen3-MoE from transformers (4 experts, top 2, both layers sparse), saved as
transformers saves it, is fine-tuned with model=hf on the chat lookup task of
tests/cluster/test_finetune_e2e.py, with sharding.expert_parallel=2 and 2..3 workers of a
ray.cluster_utils cluster: it starts on 2 workers (experts over 2 ranks), a third node joins
(the group drains the step it is at and grows to 3, where 2 does not divide the world: experts
over 1 rank, said in the mesh line), then the third node is preempted (the group drains and
goes on at 2: experts over 2 again). Every step's loss (with the aux loss) equals the same config
trained without Ray at the same world sizes (tests/cluster/elastic/elastic_reference.py) to 1e-5,
no step lost or skipped; the run logs its aux loss and expert loads; its export loads in
transformers (Qwen3MoeForCausalLM) and answers the lookup.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from benchmarks.packing import write_chat_tokenizer
from cluster.compose import register_schemas, to_job_config
from tests.cluster.elastic.elastic_reference import reference_losses
from tests.cluster.elastic_cluster import LocalCluster, attempts, start_cli, wait_until
from tests.cluster.test_finetune_e2e import FACTS, write_lookup_corpus
from trainer.checkpoint import list_checkpoints
from trainer.data import prepare

REPO = Path(__file__).resolve().parents[3]
STEPS = 240  # the events come by step ~60 (a join is seen within ~8 steps here)
RUN_TIMEOUT = 420.0
REL = 1e-5


def tiny_qwen3_moe(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
        tie_word_embeddings=False, router_aux_loss_coef=0.01,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


def overrides(launch: Path, tokenizer: str) -> list[str]:
    return [
        "model=hf",
        f"model.hf_path={launch}/qwen3-moe",
        "data=chat",
        f"data.source={launch}/sft.jsonl",
        f"data.tokenizer={tokenizer}",
        f"data.prepared_dir={launch}/prepared",
        "data.seq_len=64",
        "train.global_batch_size=6",
        f"train.steps={STEPS}",
        "train.checkpoint_every=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "sharding.expert_parallel=2",
    ]


def job_config(args: list[str]):
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return to_job_config(compose("config", overrides=args)).validate()


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    launch = tmp_path_factory.mktemp("moe")
    write_lookup_corpus(launch / "sft.jsonl")
    tokenizer = write_chat_tokenizer(str(launch), str(launch / "sft.jsonl"), 320)
    tiny_qwen3_moe(launch / "qwen3-moe")
    args = overrides(launch, tokenizer)
    prepare(job_config(args).data)  # the CLI finds it ready, as the reference does
    cluster = LocalCluster(head_cpus=1)
    try:
        cluster.add_node(1)
        run_dir = launch / "runs" / "moe"
        run = start_cli(
            launch, cluster.address, *args,
            "cluster.min_workers=2", "cluster.max_workers=3",
            "cluster.elastic_resize_monitor_interval_s=1", "cluster.grow_settle_s=0",
            "train.snapshot_every=1", "cluster.run_name=moe", "tracking.experiment=moe",
        )  # fmt: skip

        def trained(world: int, steps: int, what: str, since: float = 0.0) -> list[dict]:
            return wait_until(
                lambda: (
                    (a := attempts(run_dir))
                    and a[-1]["world_size"] == world
                    and a[-1]["started"] > since
                    and a[-1]["start_step"] is not None
                    and (a[-1]["last_step"] or -1) >= a[-1]["start_step"] + steps - 1
                    and a
                ),
                RUN_TIMEOUT,
                what,
                run,
            )

        trained(2, 20, "20 steps at world size 2")
        added_at = time.time()
        third = cluster.add_node(1)
        trained(3, 20, "20 steps at world size 3", since=added_at)
        cluster.occupy(third)  # lives on after the drain: Ray must not grow back onto it
        cluster.preempt_node(third)
        rc = run.wait(RUN_TIMEOUT)
    finally:
        cluster.close()
    records = attempts(run_dir)
    trained_groups = [a for a in records if a["start_step"] is not None]
    path = [(a["world_size"], b["start_step"]) for a, b in zip(trained_groups, trained_groups[1:])]
    reference = reference_losses(
        job_config(args), path + [(trained_groups[-1]["world_size"], None)],
        str(tmp_path_factory.mktemp("ref-moe") / "ckpt"),
    )  # fmt: skip
    return dict(launch=launch, run_dir=run_dir, rc=rc, out=run.output(), records=records,
                reference=reference)  # fmt: skip


def _history(launch: Path, key: str) -> dict[int, float]:
    client = MlflowClient(f"sqlite:///{launch}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("moe").experiment_id])
    return {m.step - 1: m.value for m in client.get_metric_history(run.info.run_id, key)}


def test_the_run_resizes_across_expert_degrees_and_says_how_it_placed_the_experts(resized):
    r = resized
    assert r["rc"] == 0, r["out"][-6000:]
    sizes = [a["world_size"] for a in r["records"] if a["start_step"] is not None]
    assert sizes == [2, 3, 2], sizes
    assert "experts over 2 ranks (sharding.expert_parallel)" in r["out"]
    assert (
        "experts over 1 rank: sharding.expert_parallel=2 does not divide the 3 ranks they are "
        "cut from; 1 is the largest degree below it dividing both them and the 4 experts"
    ) in r["out"]
    for group in r["records"][1:]:  # a join and a preemption: drained, nothing lost
        assert group["recovery"]["steps_lost"] == 0, group


def test_the_resized_run_has_the_loss_curve_of_the_same_run_without_ray(resized):
    losses = _history(resized["launch"], "train/loss")
    assert sorted(losses) == list(range(STEPS))
    for step, loss in losses.items():
        assert loss == pytest.approx(resized["reference"][step], rel=REL), step
    aux = _history(resized["launch"], "train/aux_loss")
    assert sorted(aux) == list(range(STEPS)) and all(0.5 < a < 4 for a in aux.values())
    assert all(v >= 1.0 for v in _history(resized["launch"], "moe_load/layer_1").values())
    assert losses[STEPS - 1] < 0.1 * losses[0]


def test_its_export_loads_in_transformers_and_answers_the_lookup(resized, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (last,) = [
        c for c in list_checkpoints(str(resized["run_dir"] / "checkpoints")) if c.step == STEPS
    ]
    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "trainer.hf", "export", last.path, str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    right = 0
    for word, code in FACTS.items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"code of {word}? #7"}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True,
        )["input_ids"]  # fmt: skip
        new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        assert eos in new, (word, tok.decode(new))
        right += tok.decode(new[: new.index(eos)]).strip() == code
    assert right >= 3, right
