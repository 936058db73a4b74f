"""Weights in: the safetensors format read by byte range, and a Hugging Face checkpoint read as
our parameters.

    weights = HFWeights("s3://bucket/Llama-3.2-1B", cfg)
    load_params(fsdp, weights.read)          # each rank reads only the byte ranges of its shard

A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte offsets of
every tensor) and the raw little-endian data: `Safetensors` reads the headers once and then any
byte range of any tensor, so it never holds a model in memory.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from trainer import storage
from trainer.config import ConfigError, ModelConfig
from trainer.hf.config import expected_tensors, family_of
from trainer.hf.names import is_rotary, rotary_rows
from trainer.hf.stacked import Source, expected_shape
from trainer.storage import Location

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: Location
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's data in its file."""
    nbytes: int


class Safetensors:
    """The tensors of model.safetensors, or of the files model.safetensors.index.json names,
    readable by byte range (one positional read each; an HTTP range request on object stores)."""

    def __init__(self, path: str):
        self.root = storage.resolve(path)
        listing = storage.list_dir(self.root)
        if INDEX in listing:
            index = json.loads(storage.read_bytes(self.root.child(INDEX)))
            files = sorted(set(index["weight_map"].values()))
        elif SINGLE in listing:
            files = [SINGLE]
        else:
            raise ConfigError(
                f"invalid config: model.hf_path={path!r} holds neither {SINGLE} nor "
                f"{INDEX}; valid: a Hugging Face checkpoint folder"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            if name not in listing:
                raise ConfigError(
                    f"invalid config: {self.root}/{name} is missing (named by {INDEX})"
                )
            self.tensors.update(self._header(self.root.child(name)))
        self.bytes_read = 0
        self._files: dict[str, object] = {}

    def _header(self, loc: Location) -> dict[str, TensorInfo]:
        with loc.fs.open_input_file(loc.path) as f:
            (n,) = struct.unpack("<Q", f.read_at(8, 0))
            header = json.loads(f.read_at(n, 8))
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in DTYPES:
                raise ConfigError(
                    f"invalid data: {loc}: tensor {name} has dtype {meta['dtype']}; "
                    f"valid: {', '.join(DTYPES)}"
                )
            a, b = meta["data_offsets"]
            out[name] = TensorInfo(
                loc, DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + a, b - a
            )
        return out

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of tensor `name` (flat, row-major), in its dtype."""
        info = self.tensors[name]
        size = info.dtype.itemsize
        f = self._files.get(str(info.file))
        if f is None:
            f = self._files[str(info.file)] = info.file.fs.open_input_file(info.file.path)
        data = f.read_at(count * size, info.start + start * size)
        if len(data) != count * size:
            raise ConfigError(f"invalid data: {info.file}: tensor {name} is truncated")
        self.bytes_read += len(data)
        return torch.frombuffer(bytearray(data), dtype=info.dtype)


class HFWeights:
    """A Hugging Face checkpoint as our parameters: read(fqn, start, count) gives elements
    [start, start + count) of our (flattened) parameter fqn in fp32, reading only those bytes
    (rounded out to whole heads for the query and key projections, their biases and norms,
    whose rows are permuted within a head)."""

    def __init__(self, path: str, cfg: ModelConfig):
        self.cfg, self.path = cfg, path
        self.family = family_of(cfg)
        self.st = Safetensors(path)
        self.expected = expected_tensors(cfg)
        self.source: dict[str, str] = {}  # our tensor -> the name it has in this folder
        self.stacked: dict[str, Source] = {}  # our stacked experts -> where they lie
        self.check()

    def check(self) -> None:
        """ConfigError naming the tensor for an unknown name, a missing one or a wrong shape."""
        names, seen = self.family.names, set()
        head = names.hf("output.weight")
        for name, info in self.st.tensors.items():
            hits = self.family.stacked.match(name)
            if hits:
                seen.update(self._stacked(name, info, hit) for hit in hits)
                continue
            ours = names.ours(name)
            if ours is None or (ours == "output.weight" and self.cfg.tie_embeddings):
                if name == head and self.cfg.tie_embeddings:
                    continue  # some tied checkpoints store the head too: it is the embedding
                raise ConfigError(
                    f"invalid data: {self.path}: unknown tensor {name!r} (shape "
                    f"{list(info.shape)}); valid: the tensors of a {self.family.title} model"
                )
            want = self.expected.get(ours)
            if want is None:
                raise ConfigError(
                    f"invalid data: {self.path}: tensor {name!r} does not belong to "
                    f"a model of {self.cfg.n_layers} layers"
                )
            if tuple(info.shape) != want:
                raise ConfigError(
                    f"invalid data: {self.path}: tensor {name!r} has shape "
                    f"{list(info.shape)}; the config says {list(want)}"
                )
            seen.add(ours)
            self.source[ours] = name
        for fqn, source in self.stacked.items():  # per expert: every one of them
            if not source.fused and len(source.names) != self.expected[fqn][0]:
                lost = sorted(set(range(self.expected[fqn][0])) - set(source.names))
                raise ConfigError(
                    f"invalid data: {self.path}: experts {lost[:5]} of {fqn} are missing "
                    f"(e.g. {source.stacked.per_expert[0].format(i=fqn.split('.')[1], e=lost[0])})"
                )
        missing = sorted(set(self.expected) - seen)
        if missing:
            raise ConfigError(
                f"invalid data: {self.path}: missing tensors "
                f"{[self._hf_name(m) for m in missing[:5]]}{'...' if len(missing) > 5 else ''}"
            )

    def _hf_name(self, fqn: str) -> str:
        stacked = self.family.stacked
        return stacked.describe(fqn) if stacked.of(fqn) else self.family.names.hf(fqn)

    def _stacked(self, name: str, info: TensorInfo, hit) -> str:
        """Record a tensor holding part of our stacked experts (checked against its expected
        shape; one layout per tensor of ours); our tensor's name."""
        want = self.expected.get(hit.fqn)
        if want is None:
            raise ConfigError(
                f"invalid data: {self.path}: tensor {name!r} does not belong to a model of "
                f"{self.cfg.n_layers} layers with experts in layers {list(self.cfg.sparse_layers)}"
            )
        shape = expected_shape(hit, want)
        if tuple(info.shape) != shape:
            raise ConfigError(
                f"invalid data: {self.path}: tensor {name!r} has shape {list(info.shape)}; "
                f"the config says {list(shape)}"
            )
        source = self.stacked.setdefault(hit.fqn, Source(hit.stacked, {}))
        key = -1 if hit.layout == "fused" else hit.expert
        if (key == -1) != source.fused and source.names:
            raise ConfigError(
                f"invalid data: {self.path}: {hit.fqn} is stored both per expert and fused "
                f"({name!r}); valid: one layout (transformers 5 saves per expert)"
            )
        source.names[key] = name
        return hit.fqn

    @property
    def bytes_read(self) -> int:
        return self.st.bytes_read

    def read(self, fqn: str, start: int, count: int) -> torch.Tensor:
        shape = self.expected[fqn]
        if fqn in self.stacked:  # a few contiguous ranges, one per expert it touches
            pieces = [
                self.st.read(n, a, k) for n, a, k in self.stacked[fqn].ranges(shape, start, count)
            ]
            return torch.cat(pieces).float()
        name = self.source.get(fqn) or self.family.names.hf(fqn)
        if not is_rotary(fqn):
            return self.st.read(name, start, count).float()
        cols = math.prod(shape[1:])  # 1 for a bias or a norm's weight
        hd = self.cfg.head_size
        heads = shape[0] // hd
        first, last = start // cols, (start + count - 1) // cols  # our rows touched
        h0, h1 = first // hd, last // hd + 1  # whole heads: the permutation stays inside a head
        block = self.st.read(name, h0 * hd * cols, (h1 - h0) * hd * cols).view(-1, cols)
        perm = rotary_rows(heads, hd)[h0 * hd : h1 * hd] - h0 * hd
        ours = block[torch.from_numpy(perm)].reshape(-1)
        offset = start - h0 * hd * cols
        return ours[offset : offset + count].float()
