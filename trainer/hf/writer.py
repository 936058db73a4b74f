"""Weights out: a checkpoint of ours in transformers' layout, written as a stream.

    export_hf(checkpoint_path, "out/", dtype=torch.bfloat16)   # config.json, model*.safetensors

What serving needs goes with the weights: config.json in the family's format,
generation_config.json with every id that ends a turn (the run's "stop_ids"; a model that does
not stop at its end-of-turn token is the best-known complaint of serving a fine-tune), the
tokenizer and its tokenizer_config.json carrying the chat template the run trained with.
Checkpoints from before those keys, or of byte-level runs, export what they know.

`SafetensorsWriter` writes each file's header first and then streams the tensors into it one at
a time, so the exporter holds the largest tensor, never the model.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Optional, Union

import torch

from trainer import storage
from trainer.checkpoint import CheckpointError, CheckpointReader
from trainer.checkpoint.keys import param_key
from trainer.config import ModelConfig
from trainer.data.chat import token_text
from trainer.hf.config import (
    CONFIG,
    GENERATION_CONFIG,
    config_to_hf,
    expected_tensors,
    family_of,
    ordered_params,
    special_ids,
)
from trainer.hf.importer import HF_SPECIAL_IDS
from trainer.hf.names import is_rotary, rotary_rows
from trainer.hf.safetensors import DTYPE_CODES, INDEX, SINGLE
from trainer.storage import Location

TOKENIZER_CONFIG = "tokenizer_config.json"


class SafetensorsWriter:
    """Writes tensors into safetensors files of at most `max_shard_bytes` (a tensor larger than
    that gets a file of its own), plus model.safetensors.index.json when there are several.

    The plan (every tensor's name, dtype and shape, in order) is given up front, so each file's
    header is written first and the tensors are then streamed into it one at a time."""

    def __init__(
        self,
        out: Location,
        plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
        max_shard_bytes: int,
        metadata: Optional[dict] = None,
    ):
        self.out, self.metadata = out, {k: str(v) for k, v in (metadata or {}).items()}
        groups, current, size = [], [], 0
        for name, dtype, shape in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if current and size + nbytes > max_shard_bytes:
                groups.append(current)
                current, size = [], 0
            current.append((name, dtype, shape, nbytes))
            size += nbytes
        if current:
            groups.append(current)
        n = len(groups)
        self.files = (
            [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        )
        self.groups = groups
        self.file_of = {t[0]: k for k, g in enumerate(groups) for t in g}
        self._k, self._stream, self._pending = -1, None, []

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the plan (in order)."""
        k = self.file_of[name]
        if k != self._k:
            self._open(k)
        expect = self._pending.pop(0)
        if expect[0] != name or tuple(tensor.shape) != expect[2] or tensor.dtype != expect[1]:
            raise ValueError(
                f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} out of plan: "
                f"expected {expect[:3]}"
            )
        self._stream.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())

    def _open(self, k: int) -> None:
        self._close()
        group = self.groups[k]
        header, offset = {}, 0
        for name, dtype, shape, nbytes in group:
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        if self.metadata:
            header["__metadata__"] = self.metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the reference writer does
        loc = self.out.child(self.files[k])
        self._stream = loc.fs.open_output_stream(loc.path, compression=None)
        self._stream.write(struct.pack("<Q", len(raw)) + raw)
        self._k, self._pending = k, list(group)

    def _close(self) -> None:
        if self._stream is not None:
            if self._pending:
                raise ValueError(f"{self.files[self._k]}: {len(self._pending)} tensors not written")
            self._stream.close()
            self._stream = None

    def close(self) -> list[str]:
        """Finish the files; write the index when there are several. Returns the file names."""
        self._close()
        if len(self.files) > 1:
            total = sum(t[3] for g in self.groups for t in g)
            index = {
                "metadata": {"total_size": total},
                "weight_map": {t[0]: self.files[k] for k, g in enumerate(self.groups) for t in g},
            }
            storage.write_bytes(self.out.child(INDEX), json.dumps(index, indent=2).encode())
            return self.files + [INDEX]
        return self.files


def export_hf(
    path: str,
    out_dir: str,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
    log=print,
) -> dict:
    """Transformers' layout of the model in the checkpoint at `path`, in its family's format:
    config.json, generation_config.json (every id that ends a turn), model.safetensors (or
    shards + index) and, when the run used a tokenizer.json, tokenizer_config.json (the chat
    template it trained with, its special tokens) and tokenizer.json itself when it is still
    readable; a checkpoint whose state names no tokenizer (a step-0 import) gets the tokenizer
    files of the folder it came from, as they are; a vision-language model gets that folder's
    preprocessor_config.json (the image processor) either way. One tensor at a time: the
    exporter holds the largest tensor, never the model."""

    with CheckpointReader(path) as reader:
        raw = reader.state.get("model_config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: no model_config in its state: cannot write config.json")
        cfg = ModelConfig(**raw)
        cfg.validate()
        out = storage.resolve(out_dir)
        out.fs.create_dir(out.path, recursive=True)
        dtype = dtype or torch.float32
        family = family_of(cfg)
        params = ordered_params(cfg)
        shapes = expected_tensors(cfg)
        tensors = {f: hf_tensors(family, f, shapes[f]) for f in params}
        plan = [(name, dtype, shape) for f in params for name, shape in tensors[f]]
        writer = SafetensorsWriter(
            out, plan, max_shard_bytes, {"format": "pt", "step": reader.step}
        )
        for fqn in params:
            t = reader.read_full(param_key(fqn)).view(shapes[fqn])
            if is_rotary(fqn):
                hd = cfg.head_size
                hf = torch.empty_like(t)
                hf[torch.from_numpy(rotary_rows(t.shape[0] // hd, hd))] = t
                t = hf
            pieces = t.unbind(0) if family.stacked.of(fqn) else (t,)  # experts: one each
            for (name, _), piece in zip(tensors[fqn], pieces):
                writer.write(name, piece.to(dtype))
            del t, pieces
        files = writer.close()
        tok = reader.state.get("tokenizer") or {}
        source = reader.state.get(HF_SPECIAL_IDS) or {}
        origin = reader.state.get("imported_from") or cfg.hf_path
        step = reader.step
    if not source and cfg.hf_path:  # trained from model=hf: the source may still be readable
        source = special_ids(cfg.hf_path)
    bos, eos = serving_ids(tok, source)
    write_json(out.child(CONFIG), config_to_hf(cfg, dtype, eos, bos))
    # No max_length: transformers warns when it is set beside max_new_tokens.
    write_json(out.child(GENERATION_CONFIG), {"bos_token_id": bos, "eos_token_id": eos})
    if tok or not origin:
        files += [CONFIG, GENERATION_CONFIG] + _export_tokenizer(tok, out, cfg, log)
    else:  # an import, or a run whose data named no tokenizer: the source's, as it was
        files += [CONFIG, GENERATION_CONFIG] + _copy_source_tokenizer(origin, out, log)
    if cfg.vision is not None and origin:  # the image processor the model was trained with
        files += _copy_files(origin, out, SOURCE_PROCESSOR_FILES)
    log(
        f"export: step {step}, {cfg.family} ({family_of(cfg).architecture}), {len(plan)} "
        f"tensors in {dtype}, eos {eos}, bos {bos} -> {out_dir}: {', '.join(files)}"
    )
    return {"step": step, "files": files, "tensors": len(plan), "eos": eos, "bos": bos}


def hf_tensors(family, fqn: str, shape: tuple) -> list[tuple[str, tuple]]:
    """The tensors an export writes for our parameter `fqn`: its Hugging Face name, or a
    mixture's stacked experts one per expert under the family's published names."""
    if family.stacked.of(fqn):
        return [(n, tuple(shape[1:])) for n in family.stacked.export_names(fqn, shape[0])]
    return [(family.names.hf(fqn), tuple(shape))]


def serving_ids(tok: dict, source: dict) -> tuple[Optional[int], Optional[Union[int, list]]]:
    """(bos_token_id, eos_token_id) of an export. eos: every id that ends a turn in the run's
    data (tokenizer "stop_ids", end-of-turn first: a list when more than one), else the
    tokenizer's end-of-document id, else the imported source's. bos: the tokenizer's, else the
    source's; None only when neither is known."""
    stops = [int(i) for i in tok.get("stop_ids") or []]
    if not stops and tok.get("eod_id") is not None:
        stops = [int(tok["eod_id"])]
    eos = (stops[0] if len(stops) == 1 else stops) if stops else source.get("eos_token_id")
    bos = tok.get("bos_id")
    return (source.get("bos_token_id") if bos is None else int(bos)), eos


def write_json(loc: Location, data: dict) -> None:
    storage.write_bytes(loc, json.dumps(data, indent=2).encode())


def _export_tokenizer(tok: dict, out: Location, cfg: ModelConfig, log) -> list[str]:
    """tokenizer.json (copied) and tokenizer_config.json; none for a byte-level run."""
    name = tok.get("name")
    if not name or name == "byte":
        return []
    files = []
    try:
        storage.write_bytes(out.child("tokenizer.json"), storage.read_bytes(storage.resolve(name)))
        files.append("tokenizer.json")
    except (OSError, storage.StorageError) as e:
        log(f"export: the run's tokenizer {name} is not readable here ({e}); copy it yourself")
    write_json(out.child(TOKENIZER_CONFIG), tokenizer_config(tok, cfg))
    return files + [TOKENIZER_CONFIG]


SOURCE_TOKENIZER_FILES = (
    "tokenizer.json",
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""What an export copies from the Hugging Face folder a checkpoint came from when its state names
no tokenizer of its own (a step-0 import): the files transformers and vLLM read a tokenizer and
its chat template from (a processor's chat_template.json too), those the source has."""

SOURCE_PROCESSOR_FILES = ("preprocessor_config.json",)
"""What an export of a vision-language model copies from the Hugging Face folder it came from,
whatever its tokenizer: the image processor's settings (patch and merge sizes, pixel bounds,
normalisation), which training did not change and serving needs to cut images as it did."""


def _copy_source_tokenizer(source: str, out: Location, log) -> list[str]:
    """The tokenizer files of the folder `source` (SOURCE_TOKENIZER_FILES), copied as they are;
    the names of those copied. None readable: said, and the export stands without them."""
    files = _copy_files(source, out, SOURCE_TOKENIZER_FILES)
    if not files:
        log(
            f"export: no tokenizer in the checkpoint's state nor readable at {source}: "
            "none exported"
        )
    return files


def _copy_files(source: str, out: Location, names: tuple[str, ...]) -> list[str]:
    """The files `names` of the folder `source` that it has, copied as they are; their names."""
    src, files = storage.resolve(source), []
    for name in names:
        try:
            data = storage.read_bytes(src.child(name))
        except (OSError, storage.StorageError):
            continue  # not every folder has every file
        storage.write_bytes(out.child(name), data)
        files.append(name)
    return files


def tokenizer_config(tok: dict, cfg: ModelConfig) -> dict:
    """The tokenizer_config.json of an export: the one beside the run's tokenizer when it was
    known (its added tokens, class and special tokens kept), else a minimal one; with the
    chat template the run trained with, and its bos/eos tokens."""
    config = dict(tok.get("tokenizer_config") or {})
    if not config:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
    specials = {
        "bos_token": tok.get("bos_token"),
        "eos_token": tok.get("eos_token") or tok.get("eod_token"),
    }
    for key, token in specials.items():
        if token is not None and token_text(config.get(key)) != token:
            config[key] = token
    if tok.get("chat_template"):
        config["chat_template"] = tok["chat_template"]
    return config
