"""Configuration of the D3D drafter: a small decoder over the target's vocabulary that drafts blocks of tokens."""

from __future__ import annotations

from transformers import PreTrainedConfig


class D3DConfig(PreTrainedConfig):
    r"""Configuration for [`D3DDrafterModel`].

    Layer fields mirror the target family (Llama, Qwen2, Qwen3, Mistral) so that target layers copy over as they are.
    D3D fields:
        block_size: draft slots per block (tokens proposed per round).
        mask_token_id: a token of the vocabulary whose embedding fills draft slots, or ``None`` for a learned mask
            embedding that lives outside the output vocabulary.
        target_layer_ids: which target layers the drafter layers were copied from (provenance; kept through pruning).
        tokenizer_fingerprint: short hash of the target tokenizer's vocabulary, checked against the target's.
        shifted_slots: the autoregressive "shift" of AR-to-diffusion adaptations (Dream, Fast-dLLM v2). ``False``:
            a slot's output predicts the token at its own position. ``True``: each slot reads the output of the
            token before it (the first slot reads the block's anchor, the last committed token, whose output is the
            causal LM's own next-token prediction), so a drafter converted from a whole LM starts from that LM's
            predictions. Either way a slot proposes the token at its own position; only where its logits come from
            differs. The anchor must be one of the forward's context tokens, which every caller arranges.
        block_adapter_rank: rank of low-rank updates that only block tokens receive, in every projection of the
            layers ``block_adapter_layers`` (all layers if ``None``); 0 for none. Context tokens then run the
            converted LM's exact computation, so training the adapters alone teaches the slots to look ahead
            without touching the LM's own next-token predictions (which a shifted first slot reads).
        base_model: Hub id or folder of the causal LM the drafter was converted from whole (``from_pretrained_lm``).
            A checkpoint saved with ``save_pretrained(..., omit_base_weights=True)`` stores only what training
            changed (block adapters, the mask vector); loading fetches the rest from this LM, as PEFT adapters do.
        base_model_revision: the base LM's revision (a Hub commit) to fetch; ``None`` for the default branch.
        base_model_checksum: sum of squares of the base weights the drafter was trained with; loading warns when
            the fetched ones differ (drafts stay lossless, acceptance may change).
        async_drafting: draft the next block for likely verification outcomes while the target verifies;
            ``None`` means off: measured on one H200 in eager mode, a side stream hid none of the packed pass.
        num_hypotheses: how many (acceptance length, correction token) outcomes one packed pass drafts for.
        draft_vocab_size: if set, the drafter proposes only this many tokens (the ``draft_vocab`` buffer, chosen
            by frequency in the training data) and computes its LM head over them alone at inference; on a small
            target the full head is most of a draft's cost. Verification still uses the target's full vocabulary.
        round_cost: per device type and target dtype (``"cpu"`` and ``"cuda"`` for an fp32 target,
            ``"cpu:bfloat16"`` for a bf16 one; ``"cpu-avx2"`` for CPUs of that kind only, which then come before
            ``"cpu"``; ``"cpu-avx2+skinny"`` measured with few-row linears, used inside ``hf_d3d.skinny_linears``
            and the fast loop's default), the measured cost of a round that proposes k = 1, 2, ...
            tokens (one draft plus one target forward over k + 1 tokens), in target decode steps. Where set, each
            round proposes the number of tokens (up to ``num_assistant_tokens``) with the most expected committed
            tokens per unit of cost; elsewhere every round proposes ``num_assistant_tokens``. ``hf-d3d calibrate``
            measures it; it only changes speed, never the output.
    """

    model_type = "d3d_drafter"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the name from transformers 5.24, and before

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    attention_bias: bool = False
    use_qk_norm: bool = False
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    block_size: int = 8
    mask_token_id: int | None = None
    target_model_type: str | None = None
    target_layer_ids: list[int] | None = None
    shifted_slots: bool = False
    block_adapter_rank: int = 0
    block_adapter_layers: list[int] | None = None
    tokenizer_fingerprint: str | None = None
    base_model: str | None = None
    base_model_revision: str | None = None
    base_model_checksum: float | None = None
    async_drafting: bool | None = None
    num_hypotheses: int = 4
    draft_vocab_size: int | None = None
    round_cost: dict[str, list[float]] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        super().__post_init__(**kwargs)
        self.validate_d3d()

    def validate_d3d(self) -> None:
        """Reject settings the drafter cannot run with, with a message that names the field."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is out of range for vocab_size {self.vocab_size}; "
                "use an id of the vocabulary or None for a learned mask embedding"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        for device, costs in (self.round_cost or {}).items():
            if not costs or any(not c > 0 for c in costs):
                raise ValueError(f"round_cost[{device!r}] must be a non-empty list of positive costs, got {costs}")
        if self.block_adapter_rank < 0:
            raise ValueError(f"block_adapter_rank must be >= 0, got {self.block_adapter_rank}")
        if self.block_adapter_layers is not None and any(
            not 0 <= i < self.num_hidden_layers for i in self.block_adapter_layers
        ):
            raise ValueError(
                f"block_adapter_layers must lie in [0, {self.num_hidden_layers}), got {self.block_adapter_layers}"
            )
        if self.num_hypotheses < 1:
            raise ValueError(f"num_hypotheses must be >= 1, got {self.num_hypotheses}")


__all__ = ["D3DConfig"]
