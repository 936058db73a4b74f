"""The trainer state: what a checkpoint holds besides tensors (the manifest's JSON `state`).

`TrainerState` is the one home of its schema: each field says what it means and, in its `Kind`,
what JSON the manifest's schema accepts for it (trainer/checkpoint/schema.py checks every
manifest read against these kinds). The Checkpointer builds one for every save and reads one
back at resume; a Hugging Face import (trainer/hf) builds its step-0 one here too.

    state = TrainerState(step=..., ...); manifest_state = state.to_json()
    state = TrainerState.from_json(reader.state); state.restore_rng()

Light on purpose (the standard library and torch): the checkpoint format imports it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # annotations only: trainer.config pulls in the engine
    from trainer.config import ModelConfig


@dataclass(frozen=True)
class Kind:
    """The JSON one state key must hold when present (schema.py: check_state)."""

    json: str
    """'int', 'number' (finite), 'object', 'string' or 'base64' (a string of base64)."""
    lo: float = -math.inf
    """The least value an 'int' or a 'number' may have."""
    null: bool = False
    """null is valid (absent always is, unless `required`)."""
    required: bool = False
    """A trainer's state (one with a model_digest) must have the key."""
    null_when: Optional[str] = None
    """null is valid when this other key is set (a step-0 import has no batch size yet)."""


def _key(json_type: str, default: Any = dataclasses.MISSING, **kind) -> Any:
    """A TrainerState field whose key holds `json_type` (see Kind)."""
    return dataclasses.field(default=default, metadata={"kind": Kind(json_type, **kind)})


TRAINER_MARK = "model_digest"
"""The key that makes a state a trainer's (others, from tests and tools, are free-form)."""


@dataclass
class TrainerState:
    """What a checkpoint holds besides tensors (the manifest's JSON `state`)."""

    step: int = _key("int", lo=0, required=True)
    """Optimizer steps done; the next step to train. Also the data position: step s consumes
    global samples [s * B, (s + 1) * B). The manifest's own step must be the same."""
    consumed_samples: int = _key("int", lo=0)
    global_batch_size: Optional[int] = _key("int", lo=1, required=True, null_when="imported_from")
    """The data position depends on it: a checkpoint only resumes with the same global batch.
    None in a step-0 import (any batch continues it)."""
    optim_step: float = _key("number", lo=0.0, required=True)
    """AdamW's step count (bias correction), restored into every shard's state."""
    lr: float = _key("number")
    """The learning rate of the last step trained (for the record)."""
    world_size: int = _key("int", lo=1)
    strategy: str = _key("string")
    model_config: dict = _key("object", null=True)
    model_digest: str = _key("string")
    """model_digest(model_config): a checkpoint only loads into the same model shape."""
    grad_scaler: dict = _key("object", null=True)
    rng_cpu: Optional[str] = _key("base64", null=True)
    """torch's CPU RNG state, base64 (cpu_rng_state); None in an import: nothing drawn yet."""
    data: dict = _key("object", null=True)
    """What the sample order depends on besides the step (resume.data_identity): the prepared
    dataset's digest, seq_len, seed and the mix weights."""
    tokenizer: Optional[dict] = _key("object", None, null=True)
    """The data's tokenizer (name: 'byte' or its tokenizer.json, vocab_size, eod_id, eod_token):
    what an export hands over with the weights."""
    imported_from: Optional[str] = _key("string", None, null=True)
    """A Hugging Face checkpoint this step-0 checkpoint was imported from (trainer/hf)."""
    hf_special_ids: Optional[dict] = _key("object", None, null=True)
    """The imported model's {"bos_token_id", "eos_token_id"} (its config.json and
    generation_config.json), carried by every later checkpoint of the run: an export falls back
    on them when the run's tokenizer names none."""
    loss: Optional[float] = _key("number", None, null=True)
    """The mean token loss of the last step trained (for `inspect`; None when unknown)."""
    tokens_seen: Optional[int] = _key("int", None, lo=0, null=True)
    """Training tokens consumed up to this step: step x global batch x sequence length."""

    @staticmethod
    def kinds() -> dict[str, Kind]:
        """Each key and the JSON it must hold, in field order."""
        return {f.name: f.metadata["kind"] for f in dataclasses.fields(TrainerState)}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, state: dict) -> "TrainerState":
        """A checkpoint's state (checked by the schema on read): keys it lacks (an older or an
        imported checkpoint) are None, keys this trainer does not know are dropped."""
        return cls(**{k: state.get(k) for k in cls.kinds()})

    def restore_rng(self) -> None:
        if self.rng_cpu is None:  # an imported checkpoint: nothing was drawn yet
            return
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(self.rng_cpu)), dtype=torch.uint8)
        )


def cpu_rng_state() -> str:
    """torch's CPU RNG state as TrainerState.rng_cpu holds it."""
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def model_digest(model: ModelConfig) -> str:
    """A checkpoint only loads into the same model shape (where a Hugging Face model came from
    is not part of its shape)."""
    # Fields added after checkpoints existed count only away from their default (a Llama of
    # before them keeps its digest).
    later = {
        "family": "llama",
        "head_dim": None,
        "qkv_bias": False,
        "qk_norm": False,
        "mrope_section": None,
        "vision": None,
    }
    shape = {
        k: v
        for k, v in dataclasses.asdict(model).items()
        if k != "hf_path" and not (k in later and later[k] == v)
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
