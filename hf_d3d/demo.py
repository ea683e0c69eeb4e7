"""``hf-d3d demo``: stream an answer with D3D, decode the same prompt plainly, and compare speed and output."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from hf_d3d.evaluate import count_forwards
from hf_d3d.train.distill import chat_prompt_ids

DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
MAX_NEW_TOKENS_LIMIT = 2048


@dataclass
class DemoResult:
    d3d_text: str
    plain_text: str
    d3d_tokens_per_second: float
    plain_tokens_per_second: float
    speedup: float
    tau: float
    identical: bool
    new_tokens: int


def no_outside_requests() -> None:
    """Switch off what would call home: Gradio's analytics and the Hub's telemetry (the demo and the Space make no
    request beyond loading the models they are asked to load)."""
    import huggingface_hub.constants

    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # read when a gr.Blocks is built
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"  # for processes started from here
    huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY = True  # read at import time: set it in this process too


def validate_request(prompt: str, max_new_tokens: int, tokenizer: PreTrainedTokenizerBase, context: int) -> list[int]:
    """Turn a user prompt into token ids, or raise ValueError with a message meant for a person."""
    if not prompt or not prompt.strip():
        raise ValueError("The prompt is empty: type a question or instruction.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if max_new_tokens > MAX_NEW_TOKENS_LIMIT:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} is too large for a demo; use at most {MAX_NEW_TOKENS_LIMIT}."
        )
    ids = chat_prompt_ids(tokenizer, prompt)
    if len(ids) + max_new_tokens > context:
        raise ValueError(
            f"The prompt is {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's context "
            f"of {context} tokens. Shorten the prompt or lower max_new_tokens."
        )
    return ids


class DraftView:
    """The text of a D3D decode, round by round, in pieces labelled by outcome: ``acc`` (draft tokens the target
    accepted), ``tgt`` (the target's own token) and ``rej`` (the rejected rest of a draft, never part of the output).

    Pieces are decoded in the context of the tokens before them back to the last line break (as ``TextStreamer``
    does), so a character that spans tokens (byte-level BPE) comes out whole, with the token that completes it, and a
    long answer costs no quadratic re-decoding; a round whose stop fell inside the accepted draft shows no token
    twice."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0  # ids: the current line's tokens; shown: its chars

    def round(self, draft: list[int], accepted: int, committed: list[int]) -> list[tuple[str, str]]:
        """Pieces for one round: ``speculative_generate``'s ``on_round(draft, accepted, committed)``."""
        pieces, context = [], list(self.ids)
        for i, tok in enumerate(committed):
            self.ids.append(tok)
            text = self.tokenizer.decode(self.ids)
            if not text.endswith("\ufffd"):  # an incomplete character waits for the token that completes it
                pieces.append((text[self.shown :], "acc" if i < accepted else "tgt"))
                self.shown = len(text)
                if text.endswith("\n"):  # decoding is additive across a line break: start a new line
                    self.ids, self.shown = [], 0
        if accepted < min(len(committed), len(draft)):  # the target corrected the draft here
            before = context + committed[:accepted]
            rejected = self.tokenizer.decode(before + draft[accepted:])[len(self.tokenizer.decode(before)) :]
            pieces.append((rejected, "rej"))
        return [(text, kind) for text, kind in pieces if text]


@torch.no_grad()
def run_demo(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 128,
    stream: bool = True,
) -> DemoResult:
    """Stream the D3D answer, then time D3D and plain greedy decoding of the same prompt, neither streamed.

    The streamed run is for the eye (and D3D's warm-up); the timed runs print nothing, so the terminal's speed
    counts in neither. One run each: ``hf-d3d bench`` is the measurement."""
    context = getattr(target.config, "max_position_embeddings", 1 << 30)
    ids = validate_request(prompt, max_new_tokens, tokenizer, context)
    x = torch.tensor([ids], device=target.device)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=tokenizer.pad_token_id)
    target.generate(x[:, :8], max_new_tokens=4, **kw)  # warm-up of the plain path
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    target.generate(x, max_new_tokens=max_new_tokens, assistant_model=drafter, streamer=streamer, **kw)
    start = time.perf_counter()
    ref = target.generate(x, max_new_tokens=max_new_tokens, **kw)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with count_forwards(target) as calls:
        out = target.generate(x, max_new_tokens=max_new_tokens, assistant_model=drafter, **kw)
    d3d_seconds = time.perf_counter() - start
    new = out.shape[1] - x.shape[1]
    return DemoResult(
        d3d_text=tokenizer.decode(out[0, x.shape[1] :], skip_special_tokens=True),
        plain_text=tokenizer.decode(ref[0, x.shape[1] :], skip_special_tokens=True),
        d3d_tokens_per_second=new / d3d_seconds,
        plain_tokens_per_second=(ref.shape[1] - x.shape[1]) / plain_seconds,
        speedup=plain_seconds / d3d_seconds,
        tau=new / max(calls["n"], 1),
        identical=bool(torch.equal(out, ref)),
        new_tokens=new,
    )


def report(result: DemoResult) -> str:
    return "\n".join(
        [
            f"D3D   : {result.d3d_tokens_per_second:6.1f} tokens/s   (tau {result.tau:.2f} tokens per target forward)",
            f"plain : {result.plain_tokens_per_second:6.1f} tokens/s",
            f"speedup {result.speedup:.2f}x over plain generate on {result.new_tokens} new tokens; "
            f"outputs identical: {'yes' if result.identical else 'NO'}",
        ]
    )
