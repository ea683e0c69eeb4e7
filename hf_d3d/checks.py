"""Early, explicit checks that a target and a drafter belong together (before any decoding work starts)."""

from __future__ import annotations

import hashlib
import json

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of a tokenizer's vocabulary, so a drafter can tell whether a tokenizer is its target's."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def check_pair(
    target: PreTrainedModel, drafter: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Raise ``ValueError`` if the drafter cannot serve this target: vocabulary size or tokenizer differ."""
    t_vocab = target.config.get_text_config().vocab_size
    d_vocab = drafter.config.vocab_size
    if t_vocab != d_vocab:
        raise ValueError(
            f"drafter vocab_size {d_vocab} != target vocab_size {t_vocab}: this drafter was built for another "
            "tokenizer; train one for this target with `hf-d3d train`"
        )
    expected = getattr(drafter.config, "tokenizer_fingerprint", None)
    if tokenizer is not None and expected is not None and tokenizer_fingerprint(tokenizer) != expected:
        raise ValueError(
            "the tokenizer does not match the one the drafter was trained with (vocabulary fingerprint differs)"
        )
