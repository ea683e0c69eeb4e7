"""Drafting with a D3D drafter: the candidate generator behind ``target.generate(assistant_model=drafter)``.

transformers' assisted loop calls ``drafter.generate`` once per round and hands back whatever came out as
``past_key_values``. We return a :class:`D3DCandidateGenerator` there, so the drafter state (its KV cache over
committed tokens, its statistics) lives exactly as long as one ``target.generate`` call and needs no global patch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation import CandidateGenerator, LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .attention_d3d import pack_blocks


@dataclass
class D3DStats:
    """What one generation did. ``tau`` is committed tokens per target forward, bonus token included.

    Inside ``target.generate`` the outcome of the final round is never shown to the drafter, so the counts cover
    the rounds whose outcome it saw; the fast loop and the benchmark count every round.
    """

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        observed = len(self.acceptance_lengths)
        return self.committed_tokens / observed if observed else 0.0

    def record(self, accepted: int, committed: int) -> None:
        self.acceptance_lengths.append(accepted)
        self.accepted_tokens += accepted
        self.committed_tokens += committed

    def as_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau}


class D3DCandidateGenerator(CandidateGenerator):
    """Proposes one block of ``block_size`` tokens per round from the drafter's own cache of committed tokens.

    It also answers the two cache calls that transformers' assisted loop makes on the assistant's
    ``past_key_values`` (``get_seq_length`` and ``crop``), which is how it rides along between rounds.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        logits_processor: LogitsProcessorList | None = None,
        do_sample: bool = False,
        block_size: int | None = None,
    ):
        self.drafter = drafter
        self.block_size = block_size or drafter.config.block_size
        # transformers hands the assistant a plain list of processors; the wrapper makes it callable
        self.logits_processor = LogitsProcessorList(logits_processor or [])
        self.do_sample = do_sample
        self.cache = DynamicCache()
        self.stats = D3DStats()
        self._last_draft: torch.LongTensor | None = None  # [1, k] tokens proposed last round
        self._last_len = 0  # committed length when they were proposed
        fill = drafter.config.mask_token_id
        self._fill_id = fill if fill is not None else 0  # slot embeddings are replaced, the id only fills the tensor

    # -- the cache protocol of transformers' AssistedCandidateGenerator -------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self.cache.crop(tokens_to_remove)

    # -- drafting -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, max_new_tokens: int | None = None, **kwargs
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """Return ``input_ids`` extended by up to ``block_size`` draft tokens, and the logits they were drawn from."""
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"D3D drafting supports batch size 1 (as transformers' assisted decoding); got {input_ids.shape[0]}"
            )
        self._observe(input_ids)
        k = self.block_size if max_new_tokens is None else max(0, min(self.block_size, max_new_tokens))
        if k == 0:
            return input_ids, input_ids.new_zeros((1, 0, self.drafter.config.vocab_size), dtype=torch.float)
        logits = self._draft_logits(input_ids)[:, :k]
        draft, scores = self._choose(input_ids, logits)
        self._last_draft, self._last_len = draft, input_ids.shape[1]
        self.stats.rounds += 1
        self.stats.drafted_tokens += k
        return torch.cat([input_ids, draft], dim=1), scores

    def _observe(self, input_ids: torch.LongTensor) -> None:
        """Infer how much of the last draft the target accepted from the tokens it committed since."""
        if self._last_draft is None:
            return
        new = input_ids[0, self._last_len :]
        draft = self._last_draft[0, : max(len(new) - 1, 0)]
        accepted = int((new[: len(draft)] == draft).int().cumprod(0).sum()) if len(draft) else 0
        self.stats.record(accepted, len(new))
        self._last_draft = None

    def _draft_logits(self, input_ids: torch.LongTensor) -> torch.FloatTensor:
        """One drafter forward: uncached committed tokens as context plus one block anchored at the last of them."""
        past = self.cache.get_seq_length()
        if past >= input_ids.shape[1]:  # the cache must end before the last committed token, which anchors the block
            self.cache.crop(-(past - input_ids.shape[1] + 1))
            past = input_ids.shape[1] - 1
        ids, layout = pack_blocks(input_ids[:, past:], past, [input_ids.shape[1] - 1], self.block_size, self._fill_id)
        slots = torch.arange(layout.num_context, ids.shape[1], device=ids.device)
        out = self.drafter(ids, layout=layout, past_key_values=self.cache, logits_to_keep=slots)
        return out.logits.float()

    def _choose(
        self, input_ids: torch.LongTensor, logits: torch.FloatTensor
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """Pick draft tokens. Each slot's processed logits are returned: exactly the distribution it was drawn from."""
        if not self.do_sample and len(self.logits_processor) == 0:
            return logits.argmax(-1), logits
        seq = input_ids
        scores = torch.empty_like(logits)
        for i in range(logits.shape[1]):
            # Processors such as repetition penalty read the tokens drafted so far, as they will at verification.
            scores[:, i] = self.logits_processor(seq, logits[:, i])
            if self.do_sample:
                nxt = torch.multinomial(scores[:, i].softmax(-1), 1)
            else:
                nxt = scores[:, i].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        return seq[:, input_ids.shape[1] :], scores


def assistant_generate(drafter, input_ids: torch.LongTensor, **kwargs) -> GenerateDecoderOnlyOutput:
    """What ``drafter.generate`` answers when transformers' assisted loop asks it for candidates."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"D3D assisted generation supports batch size 1, got {input_ids.shape[0]}")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("D3D assisted generation does not support padded inputs (attention_mask with zeros)")
    config = kwargs["generation_config"]
    generator = kwargs.get("past_key_values")
    if not isinstance(generator, D3DCandidateGenerator):
        generator = D3DCandidateGenerator(drafter, kwargs.get("logits_processor"), do_sample=bool(config.do_sample))
        drafter.last_stats = generator.stats
    sequences, scores = generator.get_candidates(input_ids, max_new_tokens=kwargs.get("max_new_tokens"))
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(scores.unbind(1)), past_key_values=generator)
