"""Step 1 of a preparation: the plan. Every source's files listed, the tokenizer loaded, the
files cut into work units (one JSONL or Parquet file, or text files grouped up to UNIT_BYTES),
and the digest that names the preparation: of the file listing (names, sizes, mtimes), the
tokenizer and the settings. It lives in `<prepared_dir>/<digest[:16]>/`, never mixes with
another, never changes (DESIGN.md inv. 2). A chat preparation's digest also holds the kind,
the template's sha256, the end-of-turn token, train_on, pack, overlong, seq_len, the
columns and, when a preprocessor_config.json lies beside the tokenizer, the image processor's
settings (images.py); a text preparation's digest is as it always was.

    plan = plan_preparation(cfg.data)       # ConfigError before anything is written
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from trainer import storage
from trainer.config import ConfigError, DataConfig
from trainer.storage import Location

from . import chat as chatlib
from .images import ImageProcessing
from .sources import InputFile, list_files
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from .preparation import PreparedInfo

UNIT_BYTES = 64 * 2**20
"""Text files are grouped into work units of about this many input bytes."""
PREPARE_VERSION = 2
AUTO_RAY_BYTES = 256 * 2**20
"""data.prepare_with=auto prepares on Ray Data above this many bytes of sources (`on_ray_data`);
below, the driver prepares in its own process, before Ray starts (cluster/preflight.py)."""


@dataclass
class WorkUnit:
    source: int
    index: int
    files: list[InputFile]
    budgets: list[Optional[int]]
    """Per file: bytes to read (the last file before data.max_bytes is cut), None = all."""

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "index": self.index,
            "budgets": self.budgets,
            "files": [asdict(f) for f in self.files],
        }

    @classmethod
    def from_json(cls, d: dict) -> "WorkUnit":
        return cls(d["source"], d["index"], [InputFile(**f) for f in d["files"]], d["budgets"])

    @property
    def input_bytes(self) -> int:
        return sum(
            f.size if b is None else min(b, f.size) for f, b in zip(self.files, self.budgets)
        )


@dataclass
class Plan:
    """What a preparation will do: its digest, where it goes, the units, the tokenizer."""

    cfg: DataConfig
    digest: str
    root: Location
    tokenizer: Tokenizer
    files: list[list[InputFile]]
    units: list[WorkUnit]
    tokenizer_config: Optional[dict] = None
    """The tokenizer_config.json beside data.tokenizer, as read (None: there is none)."""
    template: Optional[chatlib.ChatTemplate] = None
    """The chat template: data.kind=chat always; text when one is known (for the export)."""
    eot_token: Optional[str] = None
    images: Optional[ImageProcessing] = None
    """Chat: the image processor of the preprocessor_config.json beside data.tokenizer (a
    vision-language model's), which prepares the records' images; None: there is none."""
    prepared: Optional["PreparedInfo"] = None
    """What `prepare` made of this plan in this process: a second `prepare` of the same plan (the
    driver's preflight prepared small data, the launch asks again) returns it as it was, `created`
    included, without reading the storage again."""

    @property
    def is_chat(self) -> bool:
        return self.cfg.kind == "chat"

    @property
    def settings(self) -> dict:
        out = {
            "max_bytes": self.cfg.max_bytes,
            "eval_fraction": self.cfg.holdout,
            "unit_bytes": UNIT_BYTES,
        }
        if self.is_chat:
            c = self.cfg
            out.update(
                kind="chat",
                train_on=c.train_on,
                pack=c.pack,
                overlong=c.overlong,
                width=c.seq_len + 1,
                eot_token=self.eot_token,
                columns=[c.messages_column, c.prompt_column, c.completion_column],
            )
            if self.images is not None:
                out["images"] = self.images.to_json()
        return out

    def unit_args(self) -> dict:
        """What `process_unit` needs besides the unit, as JSON (sent to Ray Data tasks)."""
        tok = self.tokenizer
        return {
            "root": str(self.root),
            "digest": self.digest,
            "settings": self.settings,
            "tokenizer": tok.name,
            "eod_token": getattr(tok, "eod_token", None),
            "text_columns": [s.text_column for s in self.cfg.sources()],
            **({"chat": self.chat_args()} if self.is_chat else {}),
        }

    def chat_args(self) -> dict:
        return {"template": self.template.text, "tokens": self.template.tokens}


def dataset_dir(prepared_dir: str, digest: str) -> str:
    """Where the preparation with this digest lives under data.prepared_dir."""
    return str(storage.resolve(prepared_dir).child(digest[:16]))


def plan_preparation(cfg: DataConfig) -> Plan:
    """List the sources, load the tokenizer, cut the work units, compute the digest.
    ConfigError (before anything is written) for an empty source or a bad tokenizer."""
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.eod_token)
    sources = cfg.sources()
    files = [
        list_files(s, f"data.mix[{i}].path" if cfg.mix else "data.source")
        for i, s in enumerate(sources)
    ]
    units = []
    for i, source_files in enumerate(files):
        units += _units(i, source_files, cfg.max_bytes)
    listing = [
        [s.path, s.format, s.text_column, [[f.uri, f.size, f.mtime_ns] for f in fs]]
        for s, fs in zip(sources, files)
    ]
    key = [
        PREPARE_VERSION,
        tokenizer.digest,
        tokenizer.eod_id,
        cfg.max_bytes,
        cfg.holdout,  # data=chat's null is 0 unless the run evaluates (DataConfig.for_run)
        UNIT_BYTES,
        listing,
    ]
    try:
        config = chatlib.read_tokenizer_config(cfg.tokenizer)
    except ConfigError:
        if cfg.kind == "chat":
            raise
        config = None  # text never needed it: a broken one beside the tokenizer is not fatal
    template, eot = _template_and_eot(cfg, config, tokenizer)
    images = ImageProcessing.beside(cfg.tokenizer) if cfg.kind == "chat" else None
    if cfg.kind == "chat":  # text keeps its digest: prepared text data stays valid
        chat = {
            "kind": "chat",
            "template_sha256": template.sha256,
            "eot_token": eot,
            "train_on": cfg.train_on,
            "pack": cfg.pack,
            "overlong": cfg.overlong,
            "seq_len": cfg.seq_len,
            "columns": [cfg.messages_column, cfg.prompt_column, cfg.completion_column],
        }
        if images is not None:  # chat without an image processor keeps its digest too
            chat["images"] = images.to_json()
        key.append(chat)
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    root = storage.resolve(dataset_dir(cfg.prepared_dir, digest))
    return Plan(cfg, digest, root, tokenizer, files, units, config, template, eot, images)


def _template_and_eot(cfg: DataConfig, config: Optional[dict], tokenizer: Tokenizer):
    """(chat template, end-of-turn token) of cfg: required for chat (ConfigError naming where
    it looked), for text whatever is known (None when nothing is)."""
    if cfg.kind != "chat":
        if tokenizer.name == "byte":
            return None, None
        try:
            template = chatlib.load_chat_template(cfg, config)
        except ConfigError:
            template = None
        eot = cfg.eot_token or chatlib.token_text((config or {}).get("eos_token"))
        return template, eot
    template = chatlib.load_chat_template(cfg, config)
    eot = cfg.eot_token or chatlib.token_text((config or {}).get("eos_token"))
    eot = eot or getattr(tokenizer, "eod_token", None)
    if tokenizer.model.token_to_id(eot) is None:
        given = (
            f"data.eot_token={eot!r}"
            if cfg.eot_token
            else f"data.eot_token=None (the tokenizer_config's eos_token {eot!r})"
        )
        raise ConfigError(
            f"invalid config: {given} is not a token of {cfg.tokenizer}; valid: "
            f"data.eot_token=<the special token that ends an assistant turn: one of "
            f"{', '.join(tokenizer._special_tokens()) or 'it has none'}>"
        )
    return template, eot


def on_ray_data(cfg: DataConfig, plan: Plan) -> bool:
    """Whether `plan` is prepared on Ray Data (data.prepare_with=ray, or auto with more than
    AUTO_RAY_BYTES of sources) rather than in the driver's process."""
    if cfg.prepare_with != "auto":
        return cfg.prepare_with == "ray"
    return sum(u.input_bytes for u in plan.units) > AUTO_RAY_BYTES


def _units(source: int, files: list[InputFile], max_bytes: int) -> list[WorkUnit]:
    """Consecutive text files up to UNIT_BYTES per unit; a JSONL or Parquet file per unit. With
    max_bytes, files are taken in order until the cap; a text file crossing it is cut there."""
    units, group, budgets, group_bytes, taken = [], [], [], 0, 0
    for f in files:
        if max_bytes and taken >= max_bytes:
            break
        budget = None
        if max_bytes and taken + f.size > max_bytes and f.format == "text" and not f.compression:
            budget = max_bytes - taken
        size = f.size if budget is None else budget
        taken += size
        if f.format != "text" or group_bytes + size > UNIT_BYTES:
            if group:
                units.append(WorkUnit(source, len(units), group, budgets))
            group, budgets, group_bytes = [], [], 0
        group.append(f)
        budgets.append(budget)
        group_bytes += size
        if f.format != "text":
            units.append(WorkUnit(source, len(units), group, budgets))
            group, budgets, group_bytes = [], [], 0
    if group:
        units.append(WorkUnit(source, len(units), group, budgets))
    return units
