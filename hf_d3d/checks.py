"""Early, explicit checks that a target and a drafter belong together (before any decoding work starts)."""

from __future__ import annotations

import hashlib
import json

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of a tokenizer's vocabulary, so a drafter can tell whether a tokenizer is its target's."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def check_verifiable(target: PreTrainedModel) -> None:
    """Refuse a target whose verify forward over several tokens is not the same as one decode step per token.

    bitsandbytes' LLM.int8 (8-bit with ``llm_int8_threshold > 0``) computes the columns that hold an activation
    above the threshold in any row of the forward in fp16: a forward over k + 1 tokens picks its outlier columns
    from all of them, one decode step from its own row, so greedy output would part from plain ``generate``.
    Row-wise int8 (``llm_int8_threshold=0.0``) and 4-bit (nf4, fp4) targets verify exactly.
    """
    quant = getattr(target.config, "quantization_config", None)
    if quant is None:
        return
    get = quant.get if isinstance(quant, dict) else lambda k, d=None: getattr(quant, k, d)
    if get("load_in_8bit", False) and (get("llm_int8_threshold", 6.0) or 0) > 0:
        raise ValueError(
            f"this 8-bit target uses LLM.int8 outlier columns (llm_int8_threshold={get('llm_int8_threshold', 6.0)}), "
            "chosen over every row of a forward, so verifying a draft is not the same as decoding it and the output "
            "would differ from plain generate; load it with BitsAndBytesConfig(load_in_8bit=True, "
            "llm_int8_threshold=0.0) (row-wise int8, exact) or in 4-bit"
        )


def check_pair(
    target: PreTrainedModel, drafter: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Raise ``ValueError`` if the drafter cannot serve this target losslessly: vocabulary size or tokenizer differ,
    or the target's kernels make a verify forward differ from decode steps (see :func:`check_verifiable`)."""
    check_verifiable(target)
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
