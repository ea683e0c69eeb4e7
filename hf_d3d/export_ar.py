"""Export a drafter's layers as a plain causal LM of the target's family, for transformers' assisted generation.

Drafter layers are named like transformers' own, so the export is a strict state-dict copy; only the D3D-only
tensors (the mask embedding, the draft vocabulary) stay behind. This is how the benchmark's autoregressive peer is
made: the same model, the same data, the same training pipeline (``hf-d3d train --objective ar``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from hf_d3d.atomic import atomic_folder
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel

_D3D_ONLY = ("model.mask_embedding", "draft_vocab")


def export_autoregressive(drafter: D3DDrafterModel) -> PreTrainedModel:
    """A ``<Family>ForCausalLM`` with the drafter's embeddings, layers, norm and head; same next-token logits."""
    c = drafter.config
    if c.target_model_type is None:
        raise ValueError("the drafter does not record its target family (config.target_model_type)")
    if drafter.model.skip_layers:
        raise ValueError("export a drafter without skipped layers (drop them with hf_d3d.prune.drop_layers)")
    fields = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    if c.target_model_type != "qwen2":  # qwen2 always has q/k/v biases and no switch for them
        fields["attention_bias"] = c.attention_bias
    if c.target_model_type == "mistral":
        fields["sliding_window"] = None  # the drafter attends to its whole context
    config = AutoConfig.for_model(c.target_model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=drafter.dtype)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith(_D3D_ONLY)}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"drafter does not map onto {type(model).__name__}: {missing=} {unexpected=}")
    if c.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = drafter.generation_config.eos_token_id
    model.generation_config.pad_token_id = drafter.generation_config.pad_token_id
    return model.to(next(drafter.parameters()).device).eval()


def write_autoregressive(drafter_path: str | Path, out: str | Path) -> Path:
    """Export the drafter saved at ``drafter_path`` into a new folder ``out`` (built aside, renamed into place)."""
    if Path(out).exists():
        raise FileExistsError(f"{out} exists; choose a new folder")
    drafter = D3DDrafterModel.from_pretrained(drafter_path, dtype="auto")
    model = export_autoregressive(drafter)
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
    return Path(out)
