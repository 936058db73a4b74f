"""Generation from a checkpoint step or a Hugging Face folder, and the eval samples of a run.

    python -m trainer.generate runs/sft/checkpoints/step_000001000 --chat "Summarise FSDP."
    python -m trainer.generate /models/Qwen2.5-0.5B-Instruct --prompt "The capital of" --json
    python -m trainer.generate PATH --prompt-ids 1,2,3 --max-new-tokens 16 --temperature 0.7 \
        --top-p 0.9 --seed 0
    python -m trainer.generate /models/Qwen2-VL-2B-Instruct --chat "What colour?" --image a.png

    decode.py    generate_ids: prefill + KV cache, greedy or top-p, on a model or on every rank
    images.py    --image: pictures read and processed, their placeholders expanded in the prompt
    text.py      the tokenizer, the chat template and the stop ids of a checkpoint or a folder
    weights.py   the model of a checkpoint or a Hugging Face folder, filled tensor by tensor
    samples.py   eval prompts from eval windows (with their images), and the text block logged at
                 each evaluation
    __main__.py  the command
"""

from trainer.generate.decode import generate_ids
from trainer.generate.samples import Prompt, batch_prompts, eval_prompt, eval_prompts, sample_text

__all__ = ["Prompt", "batch_prompts", "eval_prompt", "eval_prompts", "generate_ids", "sample_text"]
