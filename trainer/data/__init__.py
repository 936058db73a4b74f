"""Data: documents from files or object storage -> token shards (once) -> each worker's batches.

    info = prepare(cfg.data)                          # preparation.py, planning.py, units.py
    data = PreparedData.open(info.uri)                # dataset.py: manifest + token streams
    batches = Batches(data, seq_len, seed, global_batch, weights)   # loader.py, sampler.py
    loader = Loader(batches, rank, world, micro_batches, start, stop, depth)

    python -m trainer.data inspect data/prepared      # what a preparation holds, a decoded sample
    python -m trainer.data prepare data=chat data.source=sft.jsonl data.tokenizer=tok.json
    python -m trainer.data prepare data=chat data.source=vqa.parquet \
        data.tokenizer=/models/Qwen2-VL-2B-Instruct/tokenizer.json   # images: chat_images.py
    python -m trainer.data train-tokenizer data.source=corpus/ --vocab-size 32000 --out tok.json
    python -m trainer.data prepare data.source=corpus/ data.tokenizer=tok.json   # in this process
    python -m cluster.prepare data.source=s3://...    # the same on Ray Data, on a cluster

The data order is a pure function of (seed, epoch, global position) over the prepared dataset's
global index (sampler.py), so a run resumes exactly at any world size.
"""

from .chat import ChatTemplate, encode_conversation, load_chat_template
from .checks import check_vocab, plan_and_check
from .dataset import MANIFEST, DataError, PreparedData, TokenStream, find_dataset
from .images import ImageProcessing
from .loader import EVAL_TAG, Batches, Loader, MicroBatch
from .planning import WorkUnit, dataset_dir, plan_preparation
from .preparation import PreparedInfo, prepare
from .run_defaults import with_run_defaults
from .sampler import GlobalOrder, Permutation, global_tokens_per_step, rank_range
from .sources import InputFile, detect_format, list_files
from .template_files import find_template, read_tokenizer_config
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, token_dtype, train_tokenizer
from .units import process_unit

__all__ = [
    "Batches",
    "ByteTokenizer",
    "ChatTemplate",
    "DataError",
    "EVAL_TAG",
    "GlobalOrder",
    "HFTokenizer",
    "ImageProcessing",
    "InputFile",
    "Loader",
    "MANIFEST",
    "MicroBatch",
    "Permutation",
    "PreparedData",
    "PreparedInfo",
    "TokenStream",
    "WorkUnit",
    "check_vocab",
    "dataset_dir",
    "encode_conversation",
    "detect_format",
    "find_dataset",
    "find_template",
    "global_tokens_per_step",
    "list_files",
    "load_chat_template",
    "load_tokenizer",
    "plan_and_check",
    "plan_preparation",
    "prepare",
    "process_unit",
    "rank_range",
    "read_tokenizer_config",
    "token_dtype",
    "train_tokenizer",
    "with_run_defaults",
]
