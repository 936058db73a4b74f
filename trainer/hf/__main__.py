"""Command line: Hugging Face checkpoints in and out.

    python -m trainer.hf import /models/Llama-3.2-1B/ runs/my-run/checkpoints/   # step 0 of ours
    python -m trainer.hf export runs/checkpoints/step_000000060 hf/ [--dtype bfloat16]

`import` writes a step-0 checkpoint a run resumes from, and prints the command that trains it;
`export` writes a checkpoint of ours in transformers' layout of its family, loadable by
transformers and vLLM. These commands live here, with the Hugging Face code, so that
trainer/checkpoint/ never imports trainer/hf/ (`python -m trainer.checkpoint` keeps the
format's own commands: inspect, verify and the native export).

Exit codes: 0 fine, 1 invalid/corrupt checkpoint or a model we cannot represent, 2 usage or I/O
error. Errors caused by the input are one line, `error: ...`, on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import sys

from trainer import storage
from trainer.checkpoint.__main__ import ONE_CHECKPOINT, require_dir
from trainer.checkpoint.format import CheckpointError, dtype_from_name
from trainer.config import ConfigError
from trainer.hf.config import config_from_hf, read_hf_config
from trainer.hf.importer import import_hf
from trainer.hf.writer import export_hf
from trainer.shell import python_m

DEFAULT_SEQ_LEN = 128
"""The default job's data.seq_len (conf/data/stdlib.yaml): the import's command lowers it to a
model whose context is shorter."""


def cmd_export(path: str, out: str, dtype, max_shard_gb: float) -> int:
    torch_dtype = dtype_from_name(dtype, "--dtype") if dtype else None
    export_hf(path, out, torch_dtype, int(max_shard_gb * 2**30))
    return 0


def cmd_import(src: str, dest: str) -> int:
    path = import_hf(src, dest)
    print(f"imported {src} -> {path} (step 0)")
    print("train from it (a run resumes from the newest checkpoint of its cluster.run_name):")
    print(f"  {train_command(src, dest)}")
    if not storage.exists(storage.resolve(src).child("tokenizer.json")):
        print(
            f"  (no tokenizer.json in {src}: add data.tokenizer=<the model's tokenizer.json>, "
            "or the data is byte-level)"
        )
    return 0


def train_command(src: str, dest: str) -> str:
    """The `python -m cluster.train` command whose run resumes from the import at `dest`: the
    model is the source's (model=hf model.hf_path=src: its shape and vocabulary), the run folder
    the one holding `dest` (<cluster.storage_path>/<cluster.run_name>/checkpoints, the layout
    of cluster/config.py's run_folder), the tokenizer the source's own when it has one, and the
    default data's windows within the model's context."""
    args = [python_m("cluster.train"), "model=hf", f"model.hf_path={src}"]
    parent, _, last = dest.rstrip("/").rpartition("/")
    storage_path, _, run_name = parent.rpartition("/")
    if last == "checkpoints" and storage_path and run_name:
        args += [f"cluster.storage_path={storage_path}", f"cluster.run_name={run_name}"]
    else:  # another folder: the run's checkpoints folder must be this one
        args += [f"cluster.run_name=<a name: then move {dest} to runs/<name>/checkpoints>"]
    tokenizer = storage.resolve(src).child("tokenizer.json")
    if storage.exists(tokenizer):
        args.append(f"data.tokenizer={src.rstrip('/')}/tokenizer.json")
    context = config_from_hf(read_hf_config(src), f"{src}/config.json").max_seq_len
    if context < DEFAULT_SEQ_LEN:
        args.append(f"data.seq_len={context}")
    return " ".join(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    im = sub.add_parser(
        "import",
        help="a step-0 checkpoint of a Hugging Face Llama, Qwen2/2.5, Qwen3, Mistral, "
        "Qwen3-MoE, Mixtral or Qwen2-VL model",
    )
    im.add_argument("src", help="folder or URI with config.json and model*.safetensors")
    im.add_argument("dest", help="a run's checkpoints folder, e.g. runs/my-run/checkpoints")
    ex = sub.add_parser(
        "export",
        help="transformers' layout of the model's family (Llama, Qwen2, Qwen3, Mistral, the "
        "mixtures, Qwen2-VL with the source's preprocessor_config.json: "
        "config.json, generation_config.json with every end-of-turn id, model*.safetensors, "
        "index, tokenizer files with the run's chat template), loadable by transformers and vLLM",
    )
    ex.add_argument("path", help=ONE_CHECKPOINT)
    ex.add_argument("out", help="output directory")
    ex.add_argument(
        "--dtype", default=None, help="cast weights, e.g. bfloat16 (default: as stored, fp32)"
    )
    ex.add_argument(
        "--max-shard-gb",
        type=float,
        default=5.0,
        help="safetensors files of at most this many GiB",
    )
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            return cmd_import(args.src, args.dest)
        require_dir(args.path, ONE_CHECKPOINT)
        return cmd_export(args.path, args.out, args.dtype, args.max_shard_gb)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # StorageError is an OSError; a bad URI a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
