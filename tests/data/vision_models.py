"""A Qwen2-VL-shaped model folder for the data tests and benchmarks/images.py: a small BPE
tokenizer with Qwen2-VL's special tokens, its published chat template, and a
preprocessor_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken

from trainer.data import train_tokenizer
from trainer.data.chat_images import IMAGE_TOKENS

# Qwen2-VL-7B-Instruct's chat template, as published (chat_template.json)
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_TOKENS, "<|video_pad|>"]
PROCESSOR = {  # Qwen2-VL's preprocessor_config.json with a small pixel budget: 4..12 tokens
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 12,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
WORDS = "a cat dog red blue sky tree what is in the picture here and there two one".split()
EOT = "<|im_end|>"


def write_model(folder: Path, processor: dict | None = PROCESSOR) -> Path:
    """A Qwen2-VL-shaped model folder: tokenizer.json, tokenizer_config.json with the published
    template, and preprocessor_config.json; returns the tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    model = train_tokenizer([" ".join(WORDS)] * 4, 320)
    model.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    (folder / "tokenizer.json").write_text(model.to_str())
    config = {"chat_template": QWEN2_VL, "eos_token": EOT, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder / "tokenizer.json"
