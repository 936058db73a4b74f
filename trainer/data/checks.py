"""The checks a driver makes of a preparation plan before any worker starts: every source lists
files, the tokenizer loads, the first record of each source has the columns the kind needs, the
chat template ends assistant turns with the end-of-turn token, and the model has an embedding
row for every token id. Each failure is a ConfigError naming the key, the value and what is
valid.
"""

from __future__ import annotations

from trainer.config import ConfigError, TrainerConfig

from . import chat as chatlib
from .chat_images import IMAGE_PAD
from .planning import Plan, plan_preparation
from .sources import check_text_column, first_record_fields, missing_chat_columns


def plan_and_check(cfg: TrainerConfig) -> Plan:
    """The preparation plan of cfg.data, after the checks a driver makes before any worker
    starts: every source lists files, the tokenizer loads, the first JSONL/Parquet file of each
    source has the text column, and the model has a row for every token id."""
    plan = plan_preparation(cfg.data)
    if plan.is_chat:
        check_chat(plan)
    else:
        for spec, files in zip(cfg.data.sources(), plan.files):
            check_text_column(files[0], spec.text_column)
    check_vocab(cfg, plan.tokenizer.vocab_size, cfg.data.tokenizer)
    check_images(cfg, plan)
    return plan


def check_images(cfg: TrainerConfig, plan: Plan) -> None:
    """Images in the data need a model with a vision tower, and its image token must be the
    tokenizer's <|image_pad|> (a different id would place the image features on text tokens
    and train on the result without a word). A preprocessor_config.json beside the tokenizer
    makes a preparation prepare images."""
    vision, model = cfg.model.vision, getattr(plan.tokenizer, "model", None)
    if plan.images is None or model is None:  # no image processor, or byte-level text
        return
    if vision is None:
        raise ConfigError(
            f"invalid config: model.family={cfg.model.family} has no vision tower, but the data's "
            f"tokenizer folder ({cfg.data.tokenizer}) holds an image processor, so its chat "
            "records' images are prepared; valid: a vision-language model (model=hf with "
            "model.hf_path=<a Qwen2-VL folder>), or a tokenizer without preprocessor_config.json"
        )
    pad = model.token_to_id(IMAGE_PAD)
    if pad != vision.image_token_id:
        raise ConfigError(
            f"invalid config: model.vision.image_token_id={vision.image_token_id} is not the "
            f"tokenizer's {IMAGE_PAD} ({pad}, {cfg.data.tokenizer}); valid: the model and the "
            "tokenizer of the same checkpoint"
        )


def check_chat(plan: Plan) -> None:
    """Chat: the template renders the end-of-turn token for a sample conversation, and the
    first record of each source holds the messages or the prompt/completion columns (and
    messages are not asked to be trained on as completions). ConfigError otherwise."""
    cfg, eot = plan.cfg, plan.eot_token
    try:
        text = plan.template.render(chatlib.SAMPLE_CONVERSATION)
    except Exception as e:  # noqa: BLE001 -- any template failure is the user's to see
        raise ConfigError(
            f"invalid config: the chat template from {plan.template.origin} fails on a sample "
            f"conversation ({type(e).__name__}: {e}); valid: a template that renders "
            "user/assistant turns"
        ) from None
    reply = chatlib.SAMPLE_CONVERSATION[-1]["content"]
    if eot not in text[text.find(reply) :]:
        raise ConfigError(
            f"invalid config: data.eot_token={eot!r} is never rendered by the chat template "
            f"from {plan.template.origin} after an assistant turn (sample: {text!r}); valid: "
            "data.eot_token=<the token the template ends assistant turns with>"
        )
    columns = (cfg.messages_column, cfg.prompt_column, cfg.completion_column)
    for files in plan.files:
        names = first_record_fields(files[0])
        has_pair = cfg.prompt_column in names and cfg.completion_column in names
        if cfg.messages_column not in names and not has_pair:
            raise ConfigError(missing_chat_columns(files[0], columns, names, "first record"))
        if cfg.train_on == "completion" and cfg.messages_column in names:
            raise ConfigError(
                f"invalid config: data.train_on='completion' with message records "
                f"({files[0].uri} has {cfg.messages_column!r}); valid: last_assistant (the "
                "final reply), assistant or all; completion is for prompt/completion records"
            )


def check_vocab(cfg: TrainerConfig, vocab_size: int, tokenizer: str) -> None:
    """The model must have an embedding row for every token id the data can hold."""
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"invalid config: model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary of {vocab_size} ({tokenizer}); "
            f"valid: model.vocab_size >= {vocab_size}"
        )
