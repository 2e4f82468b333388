"""A tiny byte-level BPE tokenizer built offline, and tiny model directories that use it.

Command-line tests need a model *directory* (config, weights, tokenizer) like
a real checkpoint, without downloading anything. The tokenizer is trained in
memory on a fixed text, so it is the same on every machine; it is byte-level,
so any text (accents, CJK, emoji) round-trips and a random model's output
still decodes, which exercises the multi-byte handling of streaming.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from cbcore.testing.tiny_models import VOCAB, tiny_model

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad, bos and eos
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
_TEXT = (
    "the capital of France is Paris today weather so cold in machine learning a transformer once "
    "upon time land far away quantum computing differs from classical because history Roman Empire "
    "began model token batch step cache prefill decode slot request sequence policy attention "
    "café crème brûlée naïve 東京 日本語 テキスト 🙂 🎉 résumé Zürich"
)


def _corpus(seed: int = 0, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    words = _TEXT.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def tiny_tokenizer(vocab_size: int = VOCAB) -> Any:
    """A ``PreTrainedTokenizerFast`` of at most ``vocab_size`` ids with a simple chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tiny_model_dir(path: str | Path, family: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random ``family`` model and the tiny tokenizer to ``path``, like a checkpoint."""
    path = Path(path)
    tiny_model(family, seed=seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
