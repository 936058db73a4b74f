"""Hugging Face Llama interchange: config.json <-> ModelConfig, tensor names and the rotary layout
both ways, weights in by byte range, weights out in transformers' safetensors layout.

    cfg = config_from_hf(read_hf_config("s3://bucket/Llama-3.2-1B"))   # ConfigError if unsupported
    weights = HFWeights("s3://bucket/Llama-3.2-1B", cfg)
    load_params(fsdp, weights.read)          # each rank reads only the byte ranges of its shard
    export_hf(checkpoint_path, "out/", dtype="bfloat16")    # config.json, model*.safetensors, ...

Names: Hugging Face's `model.layers.{i}.self_attn.q_proj.weight` is our `layers.{i}.attention.wq
.weight`, and so on (NAMES). Layout: our rotary embedding rotates interleaved pairs of each head's
dimensions (Meta's layout, dims 2i and 2i+1); transformers rotates the two halves (i and
i + head_dim/2). The rows of the query and key projections are permuted between the two
(`rotary_rows`), exactly as transformers' own Llama conversion does, so both compute the same
attention. Everything else is the same math: RMSNorm in fp32, SwiGLU, grouped-query attention
with query head h reading key/value head h // (heads / kv_heads).

A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte offsets of
every tensor) and the raw little-endian data: `Safetensors` reads the headers once and then any
byte range of any tensor; `SafetensorsWriter` writes a header first and then streams tensors one
at a time, so neither ever holds a model in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from trainer import storage
from trainer.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter, TensorChunk
from trainer.checkpoint.keys import param_key
from trainer.checkpointing import model_digest
from trainer.config import ConfigError, ModelConfig, fail
from trainer.storage import Location

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

# (Hugging Face name, our name), {i} a block index.
NAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
]


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_OURS = [(_pattern(h), o) for h, o in NAMES]
_TO_HF = [(_pattern(o), h) for h, o in NAMES]


def _translate(name: str, table) -> Optional[str]:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.replace("{i}", m.group(1)) if m.groups() else template
    return None


def hf_name(fqn: str) -> str:
    name = _translate(fqn, _TO_HF)
    if name is None:
        raise KeyError(f"no Hugging Face name for parameter {fqn!r}")
    return name


def our_name(name: str) -> Optional[str]:
    """Our parameter for a Hugging Face tensor name; None when the model has no such tensor."""
    return _translate(name, _TO_OURS)


def rotary_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """perm[r] = the Hugging Face row of our row r of a query or key projection: within each
    head, our row 2i + j is transformers' row j * head_dim / 2 + i."""
    half = head_dim // 2
    r = np.arange(n_heads * head_dim)
    h, m = np.divmod(r, head_dim)
    i, j = np.divmod(m, 2)
    return h * head_dim + j * half + i


def is_rotary(fqn: str) -> bool:
    return fqn.endswith(("attention.wq.weight", "attention.wk.weight"))


# ----------------------------------------------------------------------------- config


def read_hf_config(path: str) -> dict:
    loc = storage.resolve(path).child(CONFIG)
    try:
        return json.loads(storage.read_bytes(loc))
    except FileNotFoundError:
        raise ConfigError(
            f"invalid config: model.hf_path={path!r} has no {CONFIG}; valid: the "
            "folder or URI of a Hugging Face Llama checkpoint"
        ) from None
    except ValueError as e:
        raise ConfigError(f"invalid config: {loc} is not JSON ({e})") from None


def _rope(hf: dict) -> tuple[float, dict]:
    """(theta, scaling parameters) from either transformers 4's (rope_theta, rope_scaling) or
    transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    merged.setdefault("rope_type", merged.pop("type", "default"))
    return float(theta), merged


def config_from_hf(
    hf: dict, where: str = "config.json", hf_path: Optional[str] = None
) -> ModelConfig:
    """Our ModelConfig of a Hugging Face Llama config; anything our model cannot represent is a
    ConfigError naming the field and its value, never approximated."""

    def refuse(key: str, valid: str) -> None:
        fail(f"{where}: {key}", hf.get(key), valid)

    if hf.get("model_type") != "llama":
        refuse("model_type", "llama (LlamaForCausalLM)")
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if archs != ["LlamaForCausalLM"]:
        refuse("architectures", "['LlamaForCausalLM']")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "silu (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(key, "false (the model has no biases)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        refuse("head_dim", f"hidden_size / num_attention_heads = {dim // heads}")
    theta, rope = _rope(hf)
    if rope.get("rope_type") not in ("default", "llama3"):
        fail(f"{where}: rope_scaling.rope_type", rope.get("rope_type"), "default (none) or llama3")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"{where}: partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
    llama3 = rope.get("rope_type") == "llama3"
    cfg = ModelConfig(
        name="hf",
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling="llama3" if llama3 else None,
        rope_factor=float(rope.get("factor", 8.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 8192)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        hf_path=hf_path,
    )
    cfg.validate()
    return cfg


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """cfg itself, or, with model.hf_path, the shape of that checkpoint's config.json."""
    if not cfg.hf_path:
        return cfg
    return config_from_hf(read_hf_config(cfg.hf_path), f"{cfg.hf_path}/{CONFIG}", cfg.hf_path)


def config_to_hf(
    cfg: ModelConfig, dtype: torch.dtype, eos_id: Optional[int] = None, bos_id: Optional[int] = None
) -> dict:
    """transformers' LlamaConfig fields of our model (the format transformers and vLLM read)."""
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameters and shapes, without building it."""
    hd = cfg.dim // cfg.n_heads
    kv = cfg.kv_heads * hd
    out = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "attention.wq.weight": (cfg.dim, cfg.dim),
                p + "attention.wk.weight": (kv, cfg.dim),
                p + "attention.wv.weight": (kv, cfg.dim),
                p + "attention.wo.weight": (cfg.dim, cfg.dim),
                p + "feed_forward.w1.weight": (cfg.ffn_dim, cfg.dim),
                p + "feed_forward.w3.weight": (cfg.ffn_dim, cfg.dim),
                p + "feed_forward.w2.weight": (cfg.dim, cfg.ffn_dim),
                p + "attention_norm.weight": (cfg.dim,),
                p + "ffn_norm.weight": (cfg.dim,),
            }
        )
    return out


# ----------------------------------------------------------------------------- safetensors in


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
    (rounded out to whole heads for the query and key projections, whose rows are permuted)."""

    def __init__(self, path: str, cfg: ModelConfig):
        self.cfg, self.path = cfg, path
        self.st = Safetensors(path)
        self.expected = expected_tensors(cfg)
        self.check()

    def check(self) -> None:
        """ConfigError naming the tensor for an unknown name, a missing one or a wrong shape."""
        seen = set()
        for name, info in self.st.tensors.items():
            ours = our_name(name)
            if ours is None or (ours == "output.weight" and self.cfg.tie_embeddings):
                if name == "lm_head.weight" and self.cfg.tie_embeddings:
                    continue  # some tied checkpoints store the head too: it is the embedding
                raise ConfigError(
                    f"invalid data: {self.path}: unknown tensor {name!r} (shape "
                    f"{list(info.shape)}); valid: the tensors of a Llama model"
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
        missing = sorted(set(self.expected) - seen)
        if missing:
            raise ConfigError(
                f"invalid data: {self.path}: missing tensors "
                f"{[hf_name(m) for m in missing[:5]]}{'...' if len(missing) > 5 else ''}"
            )

    @property
    def bytes_read(self) -> int:
        return self.st.bytes_read

    def read(self, fqn: str, start: int, count: int) -> torch.Tensor:
        name = hf_name(fqn)
        shape = self.expected[fqn]
        if not is_rotary(fqn):
            return self.st.read(name, start, count).float()
        cols = shape[1]
        hd = self.cfg.dim // self.cfg.n_heads
        heads = shape[0] // hd
        first, last = start // cols, (start + count - 1) // cols  # our rows touched
        h0, h1 = first // hd, last // hd + 1  # whole heads: the permutation stays inside a head
        block = self.st.read(name, h0 * hd * cols, (h1 - h0) * hd * cols).view(-1, cols)
        perm = rotary_rows(heads, hd)[h0 * hd : h1 * hd] - h0 * hd
        ours = block[torch.from_numpy(perm)].reshape(-1)
        offset = start - h0 * hd * cols
        return ours[offset : offset + count].float()


# ----------------------------------------------------------------------------- safetensors out


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


# ----------------------------------------------------------------------------- checkpoints

IMPORT_RANK_BYTES = 2**30
"""import_hf writes its step-0 checkpoint as files of about this size (one "rank" each), so the
importer holds one such file's tensors at a time, never the model."""


def ordered_params(cfg: ModelConfig) -> list[str]:
    """Our parameters in transformers' order (embedding, blocks, norm, head)."""
    names = list(expected_tensors(cfg))
    first = ["tok_embeddings.weight"]
    last = ["norm.weight"] + ([] if cfg.tie_embeddings else ["output.weight"])
    return first + [n for n in names if n not in first + last] + last


def import_hf(src: str, dest_root: str, log=print) -> str:
    """A step-0 sharded checkpoint of the Hugging Face checkpoint at `src`, under `dest_root`
    (a run's checkpoints folder): fp32 weights, no optimizer state. Any world size, strategy or
    wrap policy resumes from it. Returns its path."""

    cfg = config_from_hf(read_hf_config(src), f"{src}/{CONFIG}", hf_path=src)
    weights = HFWeights(src, cfg)
    groups, current, size = [], [], 0
    for fqn in ordered_params(cfg):
        nbytes = math.prod(weights.expected[fqn]) * 4
        if current and size + nbytes > IMPORT_RANK_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(fqn)
        size += nbytes
    groups.append(current)
    state = {
        "step": 0,
        "imported_from": src,
        "model_config": _asdict(cfg),
        "model_digest": model_digest(cfg),
        "global_batch_size": None,
        "optim_step": 0.0,
        "world_size": len(groups),
        "strategy": "imported",
        "grad_scaler": {},
        "rng_cpu": None,
        "data": {},
        "lr": 0.0,
        "consumed_samples": 0,
        "tokenizer": None,
    }
    world = len(groups)
    for rank in list(range(1, world)) + [0]:  # rank 0 commits: after every other file is there
        chunks = []
        for fqn in groups[rank]:
            shape = weights.expected[fqn]
            t = weights.read(fqn, 0, math.prod(shape))
            chunks.append(TensorChunk(param_key(fqn), shape, torch.float32, 0, t))
        with CheckpointWriter(dest_root, keep=1_000_000, async_save=False) as writer:
            writer.save(0, rank, world, chunks, state, barrier=lambda: None)
            path = writer.wait()
        log(
            f"import: wrote {len(chunks)} tensors ({sum(c.numel for c in chunks) * 4 / 2**20:,.1f} "
            f"MiB) as file {rank + 1 if rank else world} of {world}"
        )
    return path


def _asdict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def export_hf(
    path: str,
    out_dir: str,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
    log=print,
) -> dict:
    """Transformers' layout of the model in the checkpoint at `path`: config.json,
    generation_config.json, model.safetensors (or shards + index) and, when the run used a
    tokenizer.json that is still readable, tokenizer.json and tokenizer_config.json. One
    tensor at a time: the exporter holds the largest tensor, never the model."""

    with CheckpointReader(path) as reader:
        raw = reader.state.get("model_config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: no model_config in its state: cannot write config.json")
        cfg = ModelConfig(**raw)
        cfg.validate()
        out = storage.resolve(out_dir)
        out.fs.create_dir(out.path, recursive=True)
        dtype = dtype or torch.float32
        params = ordered_params(cfg)
        shapes = expected_tensors(cfg)
        plan = [(hf_name(f), dtype, shapes[f]) for f in params]
        writer = SafetensorsWriter(
            out, plan, max_shard_bytes, {"format": "pt", "step": reader.step}
        )
        for fqn in params:
            t = reader.read_full(param_key(fqn)).view(shapes[fqn])
            if is_rotary(fqn):
                hd = cfg.dim // cfg.n_heads
                hf = torch.empty_like(t)
                hf[torch.from_numpy(rotary_rows(t.shape[0] // hd, hd))] = t
                t = hf
            writer.write(hf_name(fqn), t.to(dtype))
            del t
        files = writer.close()
        tok = reader.state.get("tokenizer") or {}
        step = reader.step
    eos = tok.get("eod_id")
    storage.write_bytes(
        out.child(CONFIG), json.dumps(config_to_hf(cfg, dtype, eos), indent=2).encode()
    )
    generation = {"eos_token_id": eos, "max_length": cfg.max_seq_len}
    storage.write_bytes(out.child(GENERATION_CONFIG), json.dumps(generation, indent=2).encode())
    files += [CONFIG, GENERATION_CONFIG] + _export_tokenizer(tok, out, cfg, log)
    log(f"export: step {step}, {len(params)} tensors in {dtype} -> {out_dir}: {', '.join(files)}")
    return {"step": step, "files": files, "tensors": len(params)}


def _export_tokenizer(tok: dict, out: Location, cfg: ModelConfig, log) -> list[str]:
    name = tok.get("name")
    if not name or name == "byte":
        return []
    try:
        data = storage.read_bytes(storage.resolve(name))
    except (OSError, storage.StorageError) as e:
        log(f"export: the run's tokenizer {name} is not readable here ({e}); copy it yourself")
        return []
    storage.write_bytes(out.child("tokenizer.json"), data)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_seq_len,
        "eos_token": tok.get("eod_token"),
        "clean_up_tokenization_spaces": False,
    }
    storage.write_bytes(out.child("tokenizer_config.json"), json.dumps(config, indent=2).encode())
    return ["tokenizer.json", "tokenizer_config.json"]
