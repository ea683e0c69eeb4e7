"""D3D drafter: a token-only decoder that drafts blocks of tokens for speculative decoding.

The layers are the target family's (RMSNorm, rotary positions, grouped-query attention, gated MLP, optional q/k
norm and attention bias) and are named like transformers' Llama/Qwen layers, so target layers copy over as they are.
The drafter never reads the target's hidden states: it keeps its own KV cache over context tokens only.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import cached_file

from .attention_d3d import CONTEXT, D3DLayout, d3d_attention_mask
from .compat_d3d import MODEL_OUTPUT_CACHE_FIELD, passed_cache
from .configuration_d3d import D3DConfig

_SUPPORTED_TARGETS = ("llama", "mistral", "qwen2", "qwen3")
# from_pretrained keywords that say how to reach the Hub; a base LM is fetched with the same ones
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "proxies")
_OWN_FILE_KWARGS = (*_HUB_KWARGS, "revision", "subfolder")  # where the drafter's own files are, not its base's


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware. An x86 CPU needs AVX512-BF16 or AMX units: without them
    (AVX2, and AVX512 alone, where oneDNN still reports bf16 support) bf16 matrix multiplies are emulated, slower
    than fp32. Elsewhere (Arm) oneDNN's own answer is taken."""
    try:
        if torch.cpu._is_avx2_supported():  # x86
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without these probes or without oneDNN: keep the stored dtype
        return True


class D3DRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the target families do, so copied layers behave as they did in the target.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class D3DRotary(nn.Module):
    def __init__(self, config: D3DConfig):
        super().__init__()
        self.config = config
        inv_freq, self.scaling = self.compute_inv_freq()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        params = self.config.rope_parameters
        if params.get("rope_type", "default") == "default":
            dim = self.config.head_dim
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[params["rope_type"]](self.config)  # scaled variants: transformers' own table

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [batch, 1, T, head_dim]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class D3DBlockAdapter(nn.Module):
    """A low-rank update of one projection that only block tokens (the rows after the forward's context) receive.

    Context tokens keep the converted LM's exact computation, so its next-token predictions, which a shifted
    drafter's first slot reads, survive training; the block tokens learn to look further ahead.
    """

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Parameter(torch.zeros(out_features, rank))  # zero: a new adapter changes nothing

    def forward(self, x: torch.Tensor, num_context: int, clean: torch.Tensor | None = None) -> torch.Tensor:
        """The adapter's change to every block row: zero for the context rows and for ``clean`` block rows (``[batch,
        rows after the context]``, True where a block holds a clean token, as a packed-pass hypothesis does)."""
        delta = F.linear(self.down(x[:, num_context:]), self.up)
        if clean is not None:
            delta = delta.masked_fill(clean[..., None], 0.0)
        return F.pad(delta, (0, 0, num_context, 0))

    def add_to(self, out: torch.Tensor, x: torch.Tensor, num_context: int, clean: torch.Tensor | None = None):
        """``out + self(x, num_context, clean)``, written into ``out``'s block rows (inference: nothing needs
        ``out``)."""
        if clean is not None:
            out[:, num_context:] += F.linear(self.down(x[:, num_context:]), self.up).masked_fill(clean[..., None], 0.0)
        elif out.shape[0] == 1:  # one fused multiply-add on 2-D rows
            out[0, num_context:].addmm_(self.down(x[0, num_context:]), self.up.t())
        else:
            out[:, num_context:] += F.linear(self.down(x[:, num_context:]), self.up)
        return out


def _adapters(config: D3DConfig, layer_idx: int, shapes: dict[str, tuple[int, int]]) -> nn.ModuleDict | None:
    layers = config.block_adapter_layers
    if not config.block_adapter_rank or (layers is not None and layer_idx not in layers):
        return None
    return nn.ModuleDict({k: D3DBlockAdapter(i, o, config.block_adapter_rank) for k, (i, o) in shapes.items()})


def _project(linear: nn.Linear, adapters: nn.ModuleDict | None, name: str, x: torch.Tensor, num_context: int, clean):
    out = linear(x)
    if adapters is None or out.shape[1] <= num_context:
        return out
    if torch.is_grad_enabled():  # training: autograd needs the sum as a new tensor
        return out + adapters[name](x, num_context, clean)
    return adapters[name].add_to(out, x, num_context, clean)


class D3DAttention(nn.Module):
    def __init__(self, config: D3DConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        if config.use_qk_norm:
            self.q_norm = D3DRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = D3DRMSNorm(self.head_dim, config.rms_norm_eps)
        h, q_out, kv_out = config.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        shapes = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h)}
        self.block_adapters = _adapters(config, layer_idx, shapes)

    def forward(self, x, cos, sin, mask, cache: DynamicCache | None, num_context: int, clean=None) -> torch.Tensor:
        b, t, _ = x.shape
        ad, n = self.block_adapters, num_context
        q = _project(self.q_proj, ad, "q_proj", x, n, clean).view(b, t, self.n_heads, self.head_dim)
        k = _project(self.k_proj, ad, "k_proj", x, n, clean).view(b, t, self.n_kv, self.head_dim)
        v = _project(self.v_proj, ad, "v_proj", x, n, clean).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
        if cache is not None:
            # Only context tokens enter the cache; block tokens are scratch that the next round must not see.
            k_ctx, v_ctx = cache.update(k[:, :, :num_context], v[:, :, :num_context], self.layer_idx)
            k = torch.cat([k_ctx, k[:, :, num_context:]], dim=2)
            v = torch.cat([v_ctx, v[:, :, num_context:]], dim=2)
        out = _attend(q, k, v, mask, repeat_kv=q.is_cuda)
        return _project(self.o_proj, ad, "o_proj", out.transpose(1, 2).reshape(b, t, -1), n, clean)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, repeat_kv: bool) -> torch.Tensor:
    """SDPA with grouped KV heads (query head h reads KV head h // groups). ``repeat_kv``: repeat the KV heads instead
    of ``enable_gqa``, which with a mask leaves CUDA only its math kernel (every score materialised, as transformers'
    ``use_gqa_in_sdpa`` notes); the memory-efficient kernel takes a mask with repeated heads."""
    groups = q.shape[1] // k.shape[1]
    if repeat_kv and groups > 1 and mask is not None:
        k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)


class D3DMLP(nn.Module):
    def __init__(self, config: D3DConfig, layer_idx: int):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT2FN[config.hidden_act]
        self.block_adapters = _adapters(
            config, layer_idx, {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        )

    def forward(self, x: torch.Tensor, num_context: int, clean=None) -> torch.Tensor:
        ad, n = self.block_adapters, num_context
        gated = self.act(_project(self.gate_proj, ad, "gate_proj", x, n, clean))
        return _project(
            self.down_proj, ad, "down_proj", gated * _project(self.up_proj, ad, "up_proj", x, n, clean), n, clean
        )


class D3DDecoderLayer(nn.Module):
    def __init__(self, config: D3DConfig, layer_idx: int):
        super().__init__()
        self.self_attn = D3DAttention(config, layer_idx)
        self.mlp = D3DMLP(config, layer_idx)
        self.input_layernorm = D3DRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = D3DRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, num_context, clean=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, num_context, clean)
        return x + self.mlp(self.post_attention_layernorm(x), num_context, clean)


class D3DPreTrainedModel(PreTrainedModel):
    config_class = D3DConfig
    config: D3DConfig
    base_model_prefix = "model"
    _no_split_modules = ["D3DDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, D3DRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, D3DRotary):
            # from_pretrained leaves non-persistent buffers empty and relies on this to fill them
            with torch.no_grad():
                module.inv_freq.copy_(module.compute_inv_freq()[0])
        elif isinstance(module, D3DBlockAdapter):
            nn.init.zeros_(module.up)  # a new adapter changes nothing until it is trained
        elif isinstance(module, D3DBackbone) and module.mask_embedding is not None:
            nn.init.normal_(module.mask_embedding, std=self.config.initializer_range)


class D3DBackbone(D3DPreTrainedModel):
    def __init__(self, config: D3DConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        # A learned mask vector lives outside the output vocabulary, so vocab_size still equals the target's.
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size)) if config.mask_token_id is None else None
        self.layers = nn.ModuleList(D3DDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = D3DRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = D3DRotary(config)
        self.skip_layers: set[int] = set()  # layers bypassed at run time (used to measure pruning candidates)
        self.post_init()

    def mask_vector(self) -> torch.Tensor:
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self.embed_tokens.weight[self.config.mask_token_id]

    def forward(self, input_ids, is_slot, position_ids, mask, cache, num_context, clean=None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if is_slot is not None:
            h = torch.where(is_slot[..., None], self.mask_vector().to(h.dtype), h)
        cos, sin = self.rotary(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            if i in self.skip_layers:
                if cache is not None:  # keep cache layer indices aligned with the layer list
                    cache.update(*(torch.zeros_like(h[:, None, :num_context, :1]),) * 2, i)
                continue
            h = layer(h, cos, sin, mask, cache, num_context, clean)
        return self.norm(h)


class D3DDrafterModel(D3DPreTrainedModel, GenerationMixin):
    """The D3D drafter. Pass it as ``assistant_model`` to ``target.generate`` to decode faster, losslessly."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: D3DConfig):
        super().__init__(config)
        self.model = D3DBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.draft_vocab_size is not None:
            self.draft_vocab = nn.Buffer(torch.arange(config.draft_vocab_size))  # saved with the weights
        self._draft_head: tuple[tuple, Callable] | None = None  # (state of lm_head.weight and the ids, the head)
        self.last_stats = None  # D3DStats of the most recent drafting session (set by the candidate generator)
        self.post_init()
        # Both Auto classes resolve to the drafter in a saved folder (save_pretrained copies these files there).
        config.auto_map = {
            "AutoConfig": "configuration_d3d.D3DConfig",
            "AutoModel": "modeling_d3d.D3DDrafterModel",
            "AutoModelForCausalLM": "modeling_d3d.D3DDrafterModel",
        }
        if self.generation_config is not None:
            # transformers' assisted loop asks the assistant for `num_assistant_tokens` tokens per round.
            self.generation_config.num_assistant_tokens = config.block_size
            self.generation_config.num_assistant_tokens_schedule = "constant"
            # 0 rather than None: transformers replaces None with its default (0.4), which turns on a per-round
            # confidence fit that D3D does not use and that costs a host sync
            self.generation_config.assistant_confidence_threshold = 0.0

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        layout: D3DLayout | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        draft_logits: bool = False,
        past_key_values: DynamicCache | None = None,
        frozen_context: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Run context tokens and draft blocks described by ``layout``; without one, a plain causal LM pass.

        ``logits_to_keep``: an int keeps the last n positions (0 = all); an index tensor keeps those positions; a
        boolean ``[batch, T]`` tensor keeps the marked positions, flattened to ``[N, vocab]`` (training).
        ``draft_logits``: logits over the draft vocabulary only, ``[..., draft_vocab_size]`` in its order (training
        the distribution the drafter proposes from, at a sixth of the head's cost for 8k of 49k tokens).
        ``past_key_values``: the KV cache under its name before transformers 5.24 (whose generate passes ``cache``).
        ``frozen_context``: the caller promises that no trainable weight acts on context tokens (block adapters
        alone are trained), so under autograd the context runs first without it and the blocks then attend to its
        keys: the same outputs, without storing or back-propagating the context's activations.
        """
        cache = passed_cache(cache, past_key_values)
        past = cache.get_seq_length() if cache is not None else 0
        if layout is None:
            layout = _causal_layout(input_ids, past, position_ids)
        mask = d3d_attention_mask(layout, past)
        if attention_mask is not None and attention_mask.dim() == 2:  # padding mask over past + current keys
            mask = mask & attention_mask[:, None, None, -mask.shape[-1] :].bool()
        if use_cache is False:
            cache = None
        elif cache is None and (use_cache or self.config.use_cache):
            cache = DynamicCache()
        n = layout.num_context
        if frozen_context and cache is not None:
            raise ValueError("frozen_context is for training: pass use_cache=False")
        # A clean token in a block (a packed-pass hypothesis's guessed token) is computed as the same token in the
        # context would be, adapters off: training never puts one there, and sync drafting has it in the context.
        clean = ~layout.is_slot[:, n:] if layout.clean_block_rows else None
        if frozen_context and torch.is_grad_enabled() and 0 < n < input_ids.shape[1]:
            keys = DynamicCache()
            with torch.no_grad():
                context = self.model(input_ids[:, :n], None, layout.position_ids[:, :n], mask[..., :n, :n], keys, n)
            blocks = self.model(
                input_ids[:, n:], layout.is_slot[:, n:], layout.position_ids[:, n:], mask[..., n:, :], keys, 0, clean
            )
            hidden = torch.cat([context, blocks], dim=1)
        else:
            hidden = self.model(input_ids, layout.is_slot, layout.position_ids, mask, cache, n, clean)
        if self.config.shifted_slots:
            hidden = hidden.gather(1, _shifted_index(layout)[..., None].expand_as(hidden))
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        elif logits_to_keep.dtype == torch.bool:
            hidden = hidden[logits_to_keep]
        else:
            hidden = hidden[:, logits_to_keep]
        if draft_logits and self.config.draft_vocab_size is None:
            raise ValueError("draft_logits=True needs a draft vocabulary (set_draft_vocab)")
        return CausalLMOutputWithPast(logits=self._logits(hidden, draft_logits), **{MODEL_OUTPUT_CACHE_FIELD: cache})

    def _logits(self, hidden: torch.Tensor, draft_only: bool = False) -> torch.Tensor:
        """Full-vocabulary logits; with a draft vocabulary (at inference) tokens outside it get ``-inf``.

        ``draft_only`` returns the draft vocabulary's columns alone. Training uses the full head unless asked.
        """
        if self.config.draft_vocab_size is None or (self.training and not draft_only):
            return self.lm_head(hidden)
        if self.training:  # fresh rows, so a trainable head gets its gradient
            sub = F.linear(hidden, self.lm_head.weight.index_select(0, self.draft_vocab))
        else:
            sub = self.draft_head()(hidden)
        return sub if draft_only else self.expand_draft_logits(sub)

    def draft_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The inference head over the draft vocabulary: ``lm_head``'s rows of the draft vocabulary, gathered once
        and reused until the head or the ids change (device, dtype or an in-place update; tensors made under
        inference_mode have no version counter and cannot be updated in place outside it)."""
        key = self._draft_head_key()
        if self._draft_head is None or self._draft_head[0] != key:
            rows = self.lm_head.weight.detach().index_select(0, self.draft_vocab)
            self._draft_head = (key, functools.partial(F.linear, weight=rows))
        return self._draft_head[1]

    def set_draft_head(self, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Compute the draft-vocabulary logits with ``head`` (the same rows in another layout, e.g. packed fp16
        weights) until ``lm_head`` or the draft vocabulary changes; then the plain rows are gathered again."""
        if self.config.draft_vocab_size is None:
            raise ValueError("set_draft_head needs a draft vocabulary (set_draft_vocab)")
        self._draft_head = (self._draft_head_key(), head)

    def _draft_head_key(self) -> tuple:
        tensors = (self.lm_head.weight, self.draft_vocab)
        return tuple((t.data_ptr(), t.device, t.dtype, -1 if t.is_inference() else t._version) for t in tensors)

    def _apply(self, fn, *args, **kwargs):
        self._draft_head = None  # a move or cast: gather the head again (a freed address can be reused)
        return super()._apply(fn, *args, **kwargs)

    def expand_draft_logits(self, sub: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (its order) as full-vocabulary logits, ``-inf`` outside it."""
        full = sub.new_full((*sub.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(full.dim() - 1, self.draft_vocab, sub)

    def set_draft_vocab(self, token_ids: list[int] | torch.Tensor | None) -> None:
        """Restrict proposals to ``token_ids`` (deduplicated, sorted; ``None`` lifts the restriction)."""
        if token_ids is None:
            self.config.draft_vocab_size = None
            if hasattr(self, "draft_vocab"):
                del self.draft_vocab
            self._draft_head = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique()
        if len(ids) == 0 or ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary must be a non-empty set of ids in [0, {self.config.vocab_size})")
        self.config.draft_vocab_size = len(ids)
        self.draft_vocab = nn.Buffer(ids.to(self.lm_head.weight.device))
        self._draft_head = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load safetensors weights only, and refuse a checkpoint whose tensors do not match the config.

        With no ``dtype`` (or ``"auto"``) on a machine without a GPU whose CPU has no bf16 units, a bf16 checkpoint
        is loaded in fp32, which such a CPU multiplies faster than the bf16 it would emulate.

        A checkpoint saved without its base weights (``config.base_model``) gets them from that LM here, fetched as
        ``AutoModelForCausalLM.from_pretrained`` fetches any model (Hub cache, ``revision``, offline mode)."""
        if kwargs.get("use_safetensors") is False:
            raise ValueError("D3D drafters load safetensors weights only")
        kwargs["use_safetensors"] = True
        if kwargs.get("dtype", "auto") == "auto" and "torch_dtype" not in kwargs and kwargs.get("device_map") is None:
            if not torch.cuda.is_available() and not cpu_computes_bf16():
                kwargs["dtype"] = torch.float32  # a bf16 checkpoint on a CPU without bf16 units: fp32 is faster there
        want_info = kwargs.pop("output_loading_info", False)
        path = pretrained_model_name_or_path
        stored = _stored_config(path, kwargs) if path is not None else None
        state = _with_base_weights(path, kwargs) if kwargs.get("state_dict") is None and path is not None else None
        if state is None:
            model, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
        else:
            # transformers takes a state dict only without a checkpoint path: config and generation config by hand
            hub = {k: kwargs[k] for k in _OWN_FILE_KWARGS if k in kwargs}
            overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in cls.config_class.__annotations__}
            config = kwargs.pop("config", None) or cls.config_class.from_pretrained(path, **hub, **overrides)
            for k in _OWN_FILE_KWARGS:
                kwargs.pop(k, None)
            model, info = super().from_pretrained(
                None, *args, config=config, state_dict=state, output_loading_info=True, **kwargs
            )
            generation = cached_file(path, "generation_config.json", _raise_exceptions_for_missing_entries=False, **hub)
            if generation is not None:
                model.generation_config = GenerationConfig.from_pretrained(path, **hub)
        with_base = state is not None
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            # A partly random drafter would still be lossless but silently slow: say so instead.
            raise ValueError(f"drafter checkpoint does not match its config: {bad}")
        drift = model._base_drift() if with_base else None
        if drift is not None:
            warnings.warn(
                f"the base LM {model.config.base_model!r} has other weights than the one this drafter was trained "
                f"with (checksum {drift[0]:.6g}, expected {drift[1]:.6g}): drafts stay lossless, "
                "acceptance may be lower",
                stacklevel=2,
            )
        if with_base and model.config.base_model_checksum is None:
            # An older checkpoint records no checksum: keep the fetched base's, so that a save without the base
            # weights still refuses a base trained since (it would be replaced by the original at load).
            model._base_checksum_at_load = model.base_checksum()
        if stored and stored.get("base_model"):  # base_model= at load says where to fetch from, not what to save
            model.config.base_model = stored["base_model"]
            model.config.base_model_revision = stored.get("base_model_revision")
        return (model, info) if want_info else model

    def base_weight_names(self) -> list[str]:
        """Names of the tensors that are copies of ``config.base_model``'s: embeddings, final norm, head, and every
        layer tensor but the block adapters."""
        names = [n for n, _ in self.named_parameters(remove_duplicate=False)]
        return [n for n in names if "block_adapters" not in n and n != "model.mask_embedding"]

    def save_pretrained(self, save_directory, *args, omit_base_weights: bool = False, **kwargs):
        """``save_pretrained``; with ``omit_base_weights``, the checkpoint leaves out the tensors that are
        ``config.base_model``'s own (a drafter whose base stayed frozen, e.g. one trained with block adapters only):
        a few MB instead of the whole LM, and loading fetches the base."""
        if omit_base_weights:
            if not self.config.base_model:
                raise ValueError("omit_base_weights needs config.base_model (the LM the weights are fetched from)")
            drift = self._base_drift()
            if drift is not None:  # a fine-tuned base saved this way would be replaced by the original at load
                raise ValueError(
                    f"the base weights changed since the drafter was made from {self.config.base_model!r} "
                    f"(checksum {drift[0]:.6g}, expected {drift[1]:.6g}): saving without them would lose "
                    "that training; save with omit_base_weights=False"
                )
            base = set(self.base_weight_names())
            kwargs["state_dict"] = {k: v for k, v in self.state_dict().items() if k not in base}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def base_unchanged(self) -> bool:
        """False only when the base weights no longer match ``config.base_model_checksum`` (or, for a checkpoint
        that records none, the base fetched at load), up to the rounding of a bf16 or fp16 copy: a base that was
        trained must be saved, not fetched."""
        return self._base_drift() is None

    def _base_drift(self) -> tuple[float, float] | None:
        """(checksum now, checksum recorded) when they differ by more than 0.1%, else None."""
        want = self.config.base_model_checksum
        if want is None:
            want = getattr(self, "_base_checksum_at_load", None)
        if want is None:
            return None
        have = self.base_checksum()
        return (have, want) if abs(have - want) > 1e-3 * abs(want) else None

    @torch.no_grad()
    def base_checksum(self) -> float:
        """Sum of squares of the base weights (fp64), which tells one base LM from another."""
        params = dict(self.named_parameters())
        total = 0.0
        for n in self.base_weight_names():
            if n in params:  # in chunks: an fp64 copy of a large embedding whole would take GBs of GPU memory
                total += sum(float(c.double().square().sum()) for c in params[n].reshape(-1).split(1 << 24))
        return total

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, **kwargs):
        """As an ``assistant_model``, answer with one D3D draft block; otherwise behave as a plain causal LM."""
        generation_config = kwargs.get("generation_config")
        if generation_config is not None and getattr(generation_config, "is_assistant", False):
            from .generation_d3d import assistant_generate

            return assistant_generate(self, inputs if inputs is not None else kwargs.pop("input_ids"), **kwargs)
        return super().generate(inputs, **kwargs)

    @classmethod
    def from_pretrained_lm(
        cls,
        lm: PreTrainedModel,
        block_size: int = 8,
        target: PreTrainedModel | None = None,
        mask_token_id: int | None = None,
        tokenizer_fingerprint: str | None = None,
        shifted_slots: bool = True,
        base_model: str | None = None,
        **config_overrides,
    ) -> D3DDrafterModel:
        """Convert a whole pretrained causal LM (every layer, its embeddings, final norm and head) into a drafter.

        ``lm`` shares the target's tokenizer: a smaller sibling (Qwen3-1.7B for Qwen3-8B) or the target itself.
        With ``shifted_slots`` (the default) the first slot of a block reads the anchor's causal output, so before
        any training the drafter's first draft token is ``lm``'s own greedy next token. ``base_model`` (default
        ``lm.name_or_path``) names where ``save_pretrained(..., omit_base_weights=True)`` checkpoints fetch it from;
        an ``lm`` loaded from the Hub also pins the commit it came from (``base_model_revision``).
        """
        lm_vocab = lm.config.get_text_config().vocab_size
        if target is not None and target.config.get_text_config().vocab_size != lm_vocab:
            raise ValueError(
                f"the LM's vocab_size ({lm_vocab}) differs from the target's "
                f"({target.config.get_text_config().vocab_size}): a drafter must share the target's tokenizer"
            )
        n = lm.config.get_text_config().num_hidden_layers
        drafter = cls.from_target(
            lm,
            block_size=block_size,
            layer_ids=list(range(n)),
            mask_token_id=mask_token_id,
            tokenizer_fingerprint=tokenizer_fingerprint,
            shifted_slots=shifted_slots,
            **config_overrides,
        )
        drafter.config.base_model = base_model or lm.name_or_path or None
        if base_model in (None, lm.name_or_path):  # the Hub commit ``lm`` was loaded from, where it came from one
            drafter.config.base_model_revision = getattr(lm.config, "_commit_hash", None)
        drafter.config.base_model_checksum = drafter.base_checksum()
        return drafter

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_hidden_layers: int | None = None,
        block_size: int = 8,
        layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        tokenizer_fingerprint: str | None = None,
        **config_overrides,
    ) -> D3DDrafterModel:
        """Build a drafter whose embeddings, LM head, final norm and layers are copies of ``target``'s.

        ``layer_ids`` picks target layers to copy; by default ``num_hidden_layers`` layers spread evenly from the
        first to the last. ``tokenizer_fingerprint`` (see ``hf_d3d.checks``) lets a mismatched pair be caught later.
        """
        if config_overrides.get("draft_vocab_size") is not None:
            raise ValueError("choose a draft vocabulary with drafter.set_draft_vocab(token_ids), not a size alone")
        tcfg = target.config.get_text_config()
        if tcfg.model_type not in _SUPPORTED_TARGETS:
            raise ValueError(f"from_target supports {_SUPPORTED_TARGETS} targets, got {tcfg.model_type!r}")
        n_target = tcfg.num_hidden_layers
        if layer_ids is None:
            n = num_hidden_layers or max(1, n_target // 8)
            if not 1 <= n <= n_target:
                raise ValueError(f"num_hidden_layers must be in [1, {n_target}], got {n}")
            layer_ids = [round(i * (n_target - 1) / max(n - 1, 1)) for i in range(n)] if n > 1 else [0]
        if any(not 0 <= i < n_target for i in layer_ids):
            raise ValueError(f"layer_ids must lie in [0, {n_target}), got {layer_ids}")
        rope = dict(getattr(tcfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        config = D3DConfig(
            vocab_size=tcfg.vocab_size,
            hidden_size=tcfg.hidden_size,
            intermediate_size=tcfg.intermediate_size,
            num_hidden_layers=len(layer_ids),
            num_attention_heads=tcfg.num_attention_heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
            head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads,
            hidden_act=tcfg.hidden_act,
            max_position_embeddings=tcfg.max_position_embeddings,
            rms_norm_eps=tcfg.rms_norm_eps,
            rope_theta=rope.get("rope_theta", 10000.0),
            rope_parameters=rope,
            attention_bias=getattr(tcfg, "attention_bias", tcfg.model_type == "qwen2"),
            use_qk_norm=tcfg.model_type == "qwen3",
            tie_word_embeddings=bool(getattr(tcfg, "tie_word_embeddings", False)),
            pad_token_id=tcfg.pad_token_id,
            bos_token_id=tcfg.bos_token_id,
            eos_token_id=tcfg.eos_token_id,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_model_type=tcfg.model_type,
            target_layer_ids=list(layer_ids),
            tokenizer_fingerprint=tokenizer_fingerprint,
            **config_overrides,
        )
        drafter = cls(config).to(dtype=target.dtype)
        rotary = drafter.model.rotary
        rotary.inv_freq = rotary.compute_inv_freq()[0]  # rotary frequencies stay fp32 whatever the weight dtype
        state = _lm_state(target, list(layer_ids), config.tie_word_embeddings, config.vocab_size)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        # norms a family lacks (q/k norms) stay at one; block adapters and the mask vector are the drafter's own
        own = ("norm", "block_adapters", "mask_embedding") + (("lm_head",) if config.tie_word_embeddings else ())
        if unexpected or any(all(o not in k for o in own) for k in missing):
            raise ValueError(f"{type(target).__name__} does not map onto a D3D drafter: {missing} {unexpected}")
        if mask_token_id is None:
            # Start the learned mask vector at the mean token embedding: a neutral point the training moves from.
            drafter.model.mask_embedding.data.copy_(drafter.model.embed_tokens.weight.mean(0))
        if target.generation_config is not None:
            drafter.generation_config.eos_token_id = target.generation_config.eos_token_id
            drafter.generation_config.pad_token_id = target.generation_config.pad_token_id
        return drafter.to(target.device).eval()


def _layer_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    # Some families name the rotary / sliding window buffers inside layers; only parameters travel.
    return {k: v for k, v in layer.state_dict().items() if "rotary" not in k}


def _lm_state(lm: PreTrainedModel, layer_ids: list[int], tied: bool, vocab_size: int) -> dict[str, torch.Tensor]:
    """A causal LM's embeddings, final norm, head (unless tied) and layers ``layer_ids``, under drafter names."""
    source = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    if len(source.layers) <= max(layer_ids) or lm.config.get_text_config().vocab_size != vocab_size:
        raise ValueError(
            f"{type(lm).__name__} ({len(source.layers)} layers) does not match this drafter (layers {layer_ids}, "
            f"vocab_size {vocab_size})"
        )
    state = {"model.embed_tokens.weight": source.embed_tokens.weight}
    state.update({f"model.norm.{k}": v for k, v in source.norm.state_dict().items()})
    if not tied:
        state["lm_head.weight"] = lm.get_output_embeddings().weight
    for i, j in enumerate(layer_ids):
        state.update({f"model.layers.{i}.{k}": v for k, v in _layer_state(source.layers[j]).items()})
    return state


def _tensor_names(safetensors_file: str) -> set[str]:
    """The tensor names of a safetensors file, from its header alone (an 8-byte length, then JSON)."""
    with open(safetensors_file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        end = f.seek(0, 2)
        f.seek(8)
        try:
            if not 0 < size <= end - 8:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
            raise ValueError(f"{safetensors_file} is not a safetensors file (corrupt or truncated): {err}") from err
    return set(header) - {"__metadata__"}


def _own_file(path, kwargs: dict, name: str) -> str | None:
    """One of the drafter's own files (Hub cache, revision, subfolder), or ``None`` if it has none by that name."""
    own = {k: kwargs[k] for k in _OWN_FILE_KWARGS if k in kwargs}
    return cached_file(path, name, _raise_exceptions_for_missing_entries=False, **own)


def _stored_config(path, kwargs: dict) -> dict | None:
    """The checkpoint's ``config.json`` as stored, before any override passed to ``from_pretrained``."""
    config_file = _own_file(path, kwargs, "config.json")
    if config_file is None:
        return None
    with open(config_file) as f:
        return json.load(f)


def _with_base_weights(path, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """For a checkpoint stored without its base weights: the whole state dict, its own tensors plus the base LM's
    (fetched); ``None`` for a checkpoint stored whole."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import load_state_dict

    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}  # the base is another repo: no revision, no subfolder
    config = _stored_config(path, kwargs)
    weights_file = _own_file(path, kwargs, "model.safetensors")
    if config is None or weights_file is None:
        return None  # let from_pretrained report it
    # AutoModel.from_pretrained moves config kwargs (base_model=...) into the config object it passes on
    given = kwargs.get("config")
    base = kwargs.get("base_model", getattr(given, "base_model", config.get("base_model")))
    if not base or "model.embed_tokens.weight" in _tensor_names(weights_file):
        return None  # stored whole: from_pretrained reads it once, as any checkpoint
    stored = load_state_dict(weights_file)
    revision = getattr(given, "base_model_revision", config.get("base_model_revision"))
    revision = kwargs.get("base_model_revision", revision)
    try:  # safetensors only: the base is named by a downloaded config, so its pickles are never unpickled
        lm = AutoModelForCausalLM.from_pretrained(
            base, revision=revision, dtype=kwargs.get("dtype", "auto"), use_safetensors=True, **hub
        )
    except OSError as err:
        raise OSError(
            f"this drafter stores only its trained tensors and takes the rest from its base LM {base!r}, which could "
            f"not be loaded in safetensors (pass base_model=<local folder> to from_pretrained to use a copy you "
            f"have): {err}"
        ) from err
    ids = config.get("target_layer_ids") or list(range(config["num_hidden_layers"]))
    return {**_lm_state(lm, ids, bool(config.get("tie_word_embeddings")), config["vocab_size"]), **stored}


def _shifted_index(layout: D3DLayout) -> torch.LongTensor:
    """For each token, the index whose output it reads under the AR shift: a slot reads the token before it in its
    block, or the block's anchor among the forward's context tokens; every other token reads its own output."""
    t = layout.position_ids.shape[1]
    own = torch.arange(t, device=layout.position_ids.device).expand_as(layout.position_ids)
    blocks = layout.block_ids
    follows = torch.zeros_like(layout.is_slot)
    follows[:, 1:] = (blocks[:, 1:] == blocks[:, :-1]) & (blocks[:, 1:] != CONTEXT)
    anchor = layout.anchors - layout.past_length
    opens = layout.is_slot & ~follows
    if anchor.device.type == "cpu":  # a host check is free here; on accelerators it would cost a sync
        if bool(((anchor < 0) & opens).any()):
            raise ValueError("shifted_slots needs every block's anchor among the forward's context tokens")
    else:
        torch._assert_async(~((anchor < 0) & opens).any())
    src = torch.where(follows, own - 1, anchor.clamp(0, max(layout.num_context - 1, 0)))
    return torch.where(layout.is_slot, src, own)


def _causal_layout(input_ids: torch.LongTensor, past: int, position_ids: torch.LongTensor | None) -> D3DLayout:
    b, t = input_ids.shape
    pos = position_ids if position_ids is not None else torch.arange(past, past + t, device=input_ids.device)
    pos = pos.expand(b, t)
    return D3DLayout(
        position_ids=pos,
        block_ids=torch.full_like(pos, CONTEXT),
        is_slot=torch.zeros_like(pos, dtype=torch.bool),
        anchors=pos,
        past_length=past,
        num_context=t,
    )


# save_pretrained copies these files next to the weights and writes `auto_map`, so a Hub repo of the drafter loads
# with `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` and no hf_d3d installed.
D3DConfig.register_for_auto_class()
D3DDrafterModel.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["D3DDrafterModel", "D3DConfig"]
