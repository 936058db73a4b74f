"""Qwen3-MoE and Mixtral through the Hugging Face interchange, against transformers itself: tiny
random models (Qwen3-MoE with a dense layer among its sparse ones: mlp_only_layers), saved in
both layouts a folder may hold: per expert (transformers 5's save_pretrained, as published
checkpoints are) and fused (its in-memory gate_up_proj / down_proj, written with safetensors).

- model=hf reads either layout into logits equal to transformers' (fp32 1e-5);
- the step's loss on the whole batch as one forward equals transformers' `loss` with
  output_router_logits (cross-entropy + router_aux_loss_coef x aux, padding left out by the
  attention mask / our real-token mask), and its aux equals transformers' `aux_loss`;
- import -> export gives the per-expert layout transformers saves, bitwise, from either layout,
  and transformers loads the export to the same logits; greedy ids equal transformers' generate;
- a folder holding one expert tensor both fused and per expert, or missing an expert, is refused
  naming the tensor; the refusal of an unknown family names these two.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf.tiny import assert_logits_equal, ours_from_hf, transformers_logits
from trainer.config import ConfigError
from trainer.generate import generate_ids
from trainer.generate.weights import open_source
from trainer.hf import export_hf, import_hf
from trainer.hf.config import config_from_hf
from trainer.step import train_step

transformers = pytest.importorskip("transformers")
QUIET = dict(log=lambda *_: None)
VOCAB = 64
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.02,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_model(family: str):
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **BASE, intermediate_size=40, moe_intermediate_size=24, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], head_dim=8,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(
            **BASE, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2
        )
        model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)  # large: the routing and the greedy path vary
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def saved(family, tmp_path_factory) -> dict:
    """{layout: folder} of one model of `family`."""
    model = hf_model(family)
    per_expert = tmp_path_factory.mktemp(f"{family}_per_expert")
    model.save_pretrained(per_expert)
    fused = tmp_path_factory.mktemp(f"{family}_fused")
    model.config.save_pretrained(fused)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors"
    )
    return {"per_expert": per_expert, "fused": fused}


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_either_layout_reads_into_transformers_logits(saved, layout):
    _, ours = ours_from_hf(saved[layout])
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_equal(ours(tokens), transformers_logits(saved["per_expert"], tokens))


def test_the_step_loss_and_aux_equal_transformers_with_router_logits_and_padding(saved):
    folder = saved["per_expert"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[2, 8:] = 0  # right padding in the last row
    labels = tokens.clone()
    labels[mask == 0] = -100
    out = theirs(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
    cfg, ours = ours_from_hf(folder)
    ours.train()
    # every token through the model, as transformers runs them (the routing statistics count
    # them all); the last one predicts nothing (weight 0), as transformers' shift leaves it
    inputs = tokens
    targets = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], dim=1)
    weight = (targets != -100).float()
    real = mask.bool()
    opt = torch.optim.SGD(ours.parameters(), lr=0.0)
    peer = _Peer(ours)
    step = train_step(
        peer, opt, [(inputs, targets.clamp_min(0), weight, None, real)],
        global_tokens=int(weight.sum()), grad_clip=0.0,
    )  # fmt: skip
    assert float(step.aux.detach()) == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert float(step.loss) == pytest.approx(float(out.loss), rel=1e-5)
    assert cfg.router_aux_loss_coef == 0.02


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_import_then_export_writes_transformers_layout_bitwise_and_it_loads(
    saved, layout, tmp_path
):
    ckpt = import_hf(str(saved[layout]), str(tmp_path / "ckpt"), **QUIET)
    out = tmp_path / "out"
    export_hf(ckpt, str(out), torch.float32, **QUIET)
    want = load_file(saved["per_expert"] / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert (
        config["model_type"]
        == json.loads((saved[layout] / "config.json").read_text())["model_type"]
    )
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    assert_logits_equal(
        transformers_logits(out, tokens), transformers_logits(saved[layout], tokens)
    )


def test_greedy_ids_equal_transformers_generate(saved):
    folder = saved["per_expert"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = [1, 30, 2, 44, 50, 11, 23, 45]
    want = theirs.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=0,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()
    source = open_source(str(folder), log=lambda *_: None)
    model = source.load("cpu", torch.float32)
    assert generate_ids(model, prompt, 12, ()) == want
    assert len(set(want)) > 3, want  # the path is not one token repeated


def test_a_folder_with_one_tensor_in_both_layouts_or_an_expert_missing_is_refused(saved, tmp_path):
    per = load_file(saved["per_expert"] / "model.safetensors")
    fused = load_file(saved["fused"] / "model.safetensors")
    expert = next(k for k in per if ".experts.3." in k)
    broken = {k: v for k, v in per.items() if k != expert}
    for name, tensors in (("mixed", {**per, **fused}), ("missing", broken)):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text((saved["per_expert"] / "config.json").read_text())
        with pytest.raises(ConfigError) as e:
            ours_from_hf(folder)
        assert ("both per expert and fused" if name == "mixed" else "experts [3]") in str(e.value)


def test_an_unknown_family_is_refused_naming_the_mixtures_supported(tmp_path):
    hf = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf, "config.json")
    assert "qwen3_moe (Qwen3MoeForCausalLM)" in str(e.value)
    assert "mixtral (MixtralForCausalLM)" in str(e.value)


class _Peer:
    """Our plain model behind the step interface (one process, no engine)."""

    def __init__(self, model):
        self.module = model

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        import contextlib

        return contextlib.nullcontext()

    def grad_shards(self):
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters()])

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)
