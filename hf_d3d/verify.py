"""Verification math of speculative decoding, as pure functions of the draft and the two distributions."""

from __future__ import annotations

import torch


def verify_greedy(draft: torch.LongTensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Accept the longest prefix of ``draft`` (``[k]``) that matches the target's argmax at each position.

    ``target_logits`` is ``[k + 1, vocab]``: the target's (processed) logits after each committed/draft token.
    Returns (accepted count n, the target's token at position n: the correction, or the bonus when n == k).
    """
    choice = target_logits.argmax(-1)
    k = draft.shape[0]
    n = int((choice[:k] == draft).int().cumprod(0).sum())
    return n, int(choice[n])


def verify_sampling(
    draft: torch.LongTensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. 2023, algorithm 1).

    ``draft`` ``[k]`` was drawn with ``draft[i] ~ q_probs[i]``; ``p_probs`` ``[k + 1, vocab]`` is the target's
    distribution at each position. Token i is kept with probability min(1, p/q); at the first rejection the
    replacement comes from norm(max(0, p - q)); if all are kept the bonus comes from p at position k.
    The committed tokens are then distributed exactly as sampling from p alone.
    """
    k = draft.shape[0]
    idx = torch.arange(k, device=draft.device)
    p_tok, q_tok = p_probs[idx, draft], q_probs[idx, draft]
    # drawn where the generator lives (a CPU generator cannot draw on a GPU), then moved: the same numbers either way
    at = generator.device if generator is not None else draft.device
    u = torch.rand(k, generator=generator, device=at).to(draft.device)
    keep = u * q_tok < p_tok  # u < p/q without dividing by a q that may be tiny; strict, so p == 0 never keeps
    n = int(keep.int().cumprod(0).sum())
    if n < k:
        residual = (p_probs[n] - q_probs[n]).clamp_min(0)
        total = residual.sum()
        # p == q at this position leaves no residual mass; then rejection had probability 0 and p itself is right.
        dist = residual / total if total > 0 else p_probs[n]
    else:
        dist = p_probs[k]
    return n, int(torch.multinomial(dist.to(at), 1, generator=generator))
