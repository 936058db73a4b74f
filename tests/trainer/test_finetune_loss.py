"""The fine-tuning loss of one packed window against transformers, document by document.

A window of the prepared chat data holds several conversations. Our loss over it (one forward
with the per-document positions, the loss mask as weights) must equal transformers' loss of
each conversation run alone with labels -100 outside the loss tokens, summed over the
conversations and divided by their loss tokens (1e-5 relative, fp32): so the document mask,
the restarted positions, the mask and the shift all line up with the reference.
"""

import json

import pytest
import torch

from tests.data.chat_templates import CONVERSATIONS, write_tokenizer
from trainer.config import DataConfig
from trainer.data import Batches, PreparedData, prepare
from trainer.hf import HFWeights, config_from_hf, read_hf_config
from trainer.model import build_model, document_ids, loss_sum

FAMILY_TEMPLATE = {"llama": "llama3", "qwen2": "qwen2.5", "mistral": "mistral_v1"}


def _hf_model(family: str, vocab: int, path):
    import transformers

    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    if family == "mistral":
        kw["sliding_window"] = None
    config = getattr(transformers, f"{family.capitalize()}Config")(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family.capitalize()}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))  # biases and norms away from their init too
    model.save_pretrained(path)
    return model


def _ours(path):
    cfg = config_from_hf(read_hf_config(str(path)), hf_path=str(path))
    weights = HFWeights(str(path), cfg)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.read(name, 0, p.numel()).view_as(p))
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATE))
def test_packed_window_loss_equals_transformers_document_by_document(family, tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok", FAMILY_TEMPLATE[family])
    corpus = tmp_path / "chat.jsonl"
    with open(corpus, "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": CONVERSATIONS[i % len(CONVERSATIONS)]}) + "\n")
    cfg = DataConfig(
        source=str(corpus), kind="chat", tokenizer=str(tokenizer), seq_len=256,
        prepared_dir=str(tmp_path / "prep"),
    )  # fmt: skip
    data = PreparedData.open(prepare(cfg, log=lambda *a: None).uri)
    windows = Batches(data, 256, seed=0, global_batch=1)
    # The window that packs the most conversations (a few are plenty: 3 or more).
    mb = max(
        (windows.micro_batches(s, 0, 1, 1)[0] for s in range(windows.num_samples[0])),
        key=lambda m: int(document_ids(m.input_positions).max()),
    )
    docs = document_ids(mb.positions.long() & 0xFFFF)[0]
    assert docs.max() >= 3, docs

    reference = _hf_model(family, data.vocab_size, tmp_path / "hf")
    ours = _ours(tmp_path / "hf")
    with torch.no_grad():
        s, n = loss_sum(ours(mb.inputs, mb.input_positions), mb.targets, mb.loss_weights)
        window, mask = mb.windows[0], mb.loss_mask[0].bool()
        total, count = 0.0, 0
        for d in docs.unique():
            idx = (docs == d).nonzero().flatten()
            tokens = window[idx][None]
            labels = torch.where(mask[idx], window[idx], -100)[None]
            k = int((labels[:, 1:] != -100).sum())
            if k == 0:
                continue  # the padding
            out = reference(tokens, labels=labels)
            total, count = total + float(out.loss) * k, count + k
    assert int(n) == count == int(mb.loss_mask[0, 1:].sum())
    assert float(s) / int(n) == pytest.approx(total / count, rel=1e-5)
