"""Train a D3D drafter on distillation records with accelerate (one CPU/GPU, or `accelerate launch` on many).

Checkpoints are folders written beside their final name and renamed into place: ``checkpoint/`` holds the drafter
(``save_pretrained``; without the base LM where adapters alone train over a base a resume can fetch again),
``optimizer.safetensors`` and ``trainer_state.json``; no pickle anywhere, so resuming never unpickles a file. The
data order depends on the seed (and, grouped by length, on the step size it was drawn for, which the checkpoint
records) and the block anchors on (seed, step), so a resumed run draws exactly the batches the interrupted one
would have; resumed under more processes, it reads on from where the data stood.
"""

from __future__ import annotations

import array
import copy
import functools
import hashlib
import json
import math
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedType
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel, get_cosine_schedule_with_warmup
from transformers.trainer_pt_utils import get_length_grouped_indices

from hf_d3d.atomic import atomic_folder, recover_folder, write_json_atomic
from hf_d3d.evaluate import measure_tau
from hf_d3d.modeling.modeling_d3d import D3DBlockAdapter, D3DDrafterModel, cpu_computes_bf16
from hf_d3d.train.objective import IGNORE, d3d_loss, make_batch

CHECKPOINT = "checkpoint"
FINAL = "final"
# Distributed types that shard weights or optimizer state across processes: refused by `train`.
SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def widen_block_adapters(drafter: D3DDrafterModel, top: int = 0) -> list[int]:
    """Give the top ``top`` layers of ``drafter`` (all if 0) block adapters where they have none, like those it has;
    returns the layers that gained them. New adapters start at zero, so the drafter drafts exactly as before until
    training moves them, and ``config.block_adapter_layers`` records them, so the result saves and loads."""
    config = drafter.config
    n = config.num_hidden_layers
    have = set(range(n) if config.block_adapter_layers is None else config.block_adapter_layers)
    if not config.block_adapter_rank or not have:
        raise ValueError("the drafter has no block adapters to widen")
    if not 0 <= top <= n:
        raise ValueError(f"top must lie in [0, {n}], got {top}")
    adapted = drafter.model.layers[min(have)]  # which projections of each part are adapted: as the drafter has them
    parts = {name: list(getattr(adapted, name).block_adapters) for name in ("self_attn", "mlp")}
    added = sorted(set(range(n - top if top else 0, n)) - have)
    for idx in added:
        for name, projections in parts.items():
            part = getattr(drafter.model.layers[idx], name)
            weight = getattr(part, projections[0]).weight
            adapters = {
                k: D3DBlockAdapter(*reversed(getattr(part, k).weight.shape), config.block_adapter_rank)
                for k in projections
            }
            part.block_adapters = torch.nn.ModuleDict(adapters).to(device=weight.device, dtype=weight.dtype)
    everything = have | set(added)
    config.block_adapter_layers = None if everything == set(range(n)) else sorted(everything)
    return added


def grow_block_adapter_rank(drafter: D3DDrafterModel, rank: int) -> int:
    """Raise every block adapter of ``drafter`` to ``rank``; returns the rank it had. The added down rows start as a
    new ``nn.Linear``'s and the added up columns at zero, so the drafter drafts exactly as before until training moves
    them, and ``config.block_adapter_rank`` records the rank, so the result saves and loads."""
    old = drafter.config.block_adapter_rank
    if not old:
        raise ValueError("the drafter has no block adapters to grow")
    if rank < old:
        raise ValueError(f"the adapters have rank {old}; growing to {rank} would drop what they learned")
    for module in drafter.modules():
        if isinstance(module, D3DBlockAdapter):
            down = torch.nn.Linear(module.down.in_features, rank, bias=False)
            up = module.up.new_zeros(module.up.shape[0], rank)
            with torch.no_grad():
                down.weight[:old] = module.down.weight
                up[:, :old] = module.up
            module.down = down.to(device=module.up.device, dtype=module.up.dtype)
            module.up = torch.nn.Parameter(up)
    drafter.config.block_adapter_rank = rank
    return old


@dataclass
class TrainConfig:
    max_steps: int = 1000
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    num_blocks: int = 4
    ar_weight: float = 0.5
    slot_decay: float = 0.8
    max_ar_positions: int | None = 64
    freeze_embeddings: bool = True
    # Freeze the mask vector and the lowest N layers (embeddings too): backward then stops at layer N, which is
    # what makes a whole-LM drafter trainable on a few CPU cores; the upper layers learn to denoise.
    freeze_layers: int = 0
    # Train the block adapters alone (a drafter with block_adapter_rank > 0): the converted LM stays exactly as it
    # was, and so do its next-token predictions; backward stops at the lowest layer with adapters.
    adapters_only: bool = False
    # With a draft vocabulary, train the softmax the drafter proposes from (and skip most of the LM head).
    draft_vocab_loss: bool = True
    # Soft labels (adapters_only, a drafter built on the target itself): each slot also learns the target's
    # next-token distribution for its token, read off the frozen context rows of the same forward.
    kd_weight: float = 0.0
    kd_temperature: float = 1.0
    # Weight of a slot behind a wrongly drafted one in its block (greedy verification never reads it); 1: no change.
    unreached_weight: float = 1.0
    mixed_precision: str = "no"
    save_dtype: str = "float32"  # of the final weights only; checkpoints stay fp32 so that a resume loses nothing
    eval_every: int = 200
    save_every: int = 100
    seed: int = 0
    # Batch records of similar length (transformers' length-grouped order: shuffled, then sorted inside mega-batches
    # of 50 steps), so that less of each step is padding.
    group_by_length: bool = False

    def __post_init__(self) -> None:
        # Checked before any step runs: a zero here would otherwise fail mid-run (modulo by zero at step 1).
        for name in ("max_steps", "batch_size", "grad_accum", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.freeze_layers < 0:
            raise ValueError(f"freeze_layers must be at least 0, got {self.freeze_layers}")
        if self.num_blocks < 0:  # 0 is the AR peer's objective: no denoising blocks
            raise ValueError(f"num_blocks must be at least 0, got {self.num_blocks}")
        if self.kd_weight < 0 or self.kd_temperature <= 0:
            raise ValueError(f"need kd_weight >= 0 and kd_temperature > 0, got {self.kd_weight}, {self.kd_temperature}")
        if not 0.0 <= self.unreached_weight <= 1.0:
            raise ValueError(f"unreached_weight must be in [0, 1], got {self.unreached_weight}")
        if self.unreached_weight != 1.0 and not self.num_blocks:
            raise ValueError("unreached_weight weighs the slots of mask blocks; this objective has none (num_blocks 0)")
        if self.kd_weight and not self.adapters_only:
            raise ValueError("kd_weight needs adapters_only: the soft labels are the frozen context rows")
        if self.kd_weight and not self.num_blocks:
            raise ValueError("kd_weight needs num_blocks > 0: soft labels are for the slots of mask blocks")


def check_teacher(drafter: PreTrainedModel, target: PreTrainedModel, ids: list[int], tol: float = 0.05) -> None:
    """Refuse soft labels unless the drafter's context rows are the target's own next-token distribution (a
    drafter converted from the target itself, all layers kept): on the first 64 of ``ids``, the total variation
    distance between the two distributions may exceed ``tol`` at no position (bf16 rounding stays well below)."""
    x = torch.tensor([ids[:64]])
    with torch.no_grad():
        mine = drafter(x.to(drafter.device), use_cache=False).logits.float().softmax(-1).cpu()
        theirs = target(x.to(target.device)).logits.float().softmax(-1).cpu()
    n = min(mine.shape[-1], theirs.shape[-1])
    gap = 0.5 * (mine[..., :n] - theirs[..., :n]).abs().sum(-1).max().item()
    if gap > tol:
        base = getattr(drafter.config, "base_model", None)
        raise ValueError(
            f"soft labels (kd_weight) need a drafter built on the target itself; this one (base {base!r}) is "
            f"{gap:.3f} in total variation from the target's next-token distribution"
        )


def validate_records(records: list[dict], vocab_size: int, max_positions: int, block_size: int) -> None:
    """Refuse data the drafter cannot learn from, before any step runs."""
    if not records:
        raise ValueError("no training records")
    for r in records:
        for key in ("prompt_ids", "response_ids"):
            if key not in r:
                raise KeyError(f"record {r.get('idx', '?')} lacks {key!r}")
        if not r["response_ids"]:
            raise ValueError(f"record {r.get('idx', '?')} has an empty response")
        if not r["prompt_ids"]:  # a block opens after the last prompt token
            raise ValueError(f"record {r.get('idx', '?')} has an empty prompt")
        ids = r["prompt_ids"] + r["response_ids"]
        if len(ids) + block_size > max_positions:
            raise ValueError(
                f"record {r.get('idx', '?')} is {len(ids)} tokens; with a block of {block_size} it exceeds the "
                f"drafter's context of {max_positions} positions"
            )
        if max(ids) >= vocab_size or min(ids) < 0:
            raise ValueError(f"record {r.get('idx', '?')} has token ids outside the drafter vocabulary ({vocab_size})")


def _save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> dict:
    tensors, scalars = {}, {}
    for i, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{key}"] = value
    save_file(tensors, str(path))
    return {"scalars": scalars, "param_groups": optimizer.state_dict()["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, path: Path, meta: dict) -> None:
    tensors = load_file(str(path))
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        i, key = name.split(".", 1)
        state.setdefault(int(i), {})[key] = value
    for name, value in meta["scalars"].items():
        i, key = name.split(".", 1)
        state.setdefault(int(i), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def check_replicated(distributed_type: DistributedType) -> None:
    """Refuse a launch that shards weights or optimizer state across processes (FSDP, DeepSpeed, Megatron)."""
    if distributed_type in SHARDED:
        # Checkpoints and the final drafter are written from the main process's own copy of the weights, and the
        # optimizer state as that process holds it: under sharding those are one shard, so a run would save a
        # drafter that loads wrong and cannot resume. Every documented recipe fits replicated (DDP) training.
        raise ValueError(
            f"hf-d3d train runs on one device or replicated across processes (DDP); {distributed_type} shards the "
            "weights, which its checkpoints do not gather. Launch with a multi-GPU (DDP) accelerate config; for a "
            "drafter too large to replicate, train its block adapters alone (--block-adapter-rank)"
        )


# What a resumed run may change: how long it runs and how it saves, evaluates and computes (a run moves between
# machines), never what it trains (the optimizer's saved state would silently keep the old lr, for one).
RUN_LOGISTICS = ("max_steps", "save_every", "eval_every", "save_dtype", "mixed_precision")
DRAFTER_SHAPE = (
    "num_hidden_layers", "hidden_size", "block_size", "vocab_size", "target_layer_ids", "block_adapter_rank",
    "block_adapter_layers", "draft_vocab_size", "mask_token_id", "shifted_slots",
)  # fmt: skip


# What a setting was before it existed, where that is not its default: a draft vocabulary's drafter trained over the
# full vocabulary until draft_vocab_loss came. Every other setting was added with the old behaviour as its default.
BEFORE_IT_EXISTED = {"draft_vocab_loss": False}


def warn_emulated_bf16(device: torch.device, mixed_precision: str) -> bool:
    """Warn when bf16 autocast would run on a CPU without bf16 units (an AVX2 or AVX512-only x86): its bf16 matrix
    multiplies are emulated, and a training step is about 2.5x slower than ``--mixed-precision no``. Returns whether
    it warned."""
    if mixed_precision != "bf16" or device.type != "cpu" or cpu_computes_bf16():
        return False
    warnings.warn(
        "--mixed-precision bf16 on a CPU without AVX512-BF16 or AMX: bf16 matrix multiplies are emulated here, "
        "slower than fp32; --mixed-precision no trains faster on this machine",
        stacklevel=2,
    )
    return True


def data_fingerprint(records: list[dict]) -> str:
    """sha256 of the records' token ids in order: which data, in which order, a run reads."""
    digest = hashlib.sha256()
    for r in records:
        for ids in (r["prompt_ids"], r["response_ids"]):
            digest.update(len(ids).to_bytes(4, "little") + array.array("q", [int(i) for i in ids]).tobytes())
    return digest.hexdigest()


def check_resume(
    state: dict, config: TrainConfig, data_id: str, given: PretrainedConfig, saved: PretrainedConfig, ckpt: Path
) -> None:
    """Refuse to resume ``ckpt`` as another run: other settings, another drafter, other data, or past its end."""
    if state["step"] > config.max_steps:
        raise ValueError(
            f"{ckpt} is at step {state['step']}, past --steps {config.max_steps} (an --epochs count shrinks under "
            f"more processes): pass --steps {state['step']} or more, or a new --out"
        )
    before = state.get("config", {})
    if before:
        # A setting added after the checkpoint was written ran as the code did before the setting existed.
        before = (
            {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING} | BEFORE_IT_EXISTED | before
        )
    free = set(RUN_LOGISTICS)
    if not getattr(saved, "draft_vocab_size", None):
        free.add("draft_vocab_loss")  # no draft vocabulary: both settings train the same softmax
    diffs = [
        f"{k}: {before[k]!r} -> {v!r}"
        for k, v in asdict(config).items()
        if k in before and k not in free and before[k] != v
    ]
    diffs += [
        f"drafter {k}: {getattr(saved, k, None)!r} -> {getattr(given, k, None)!r}"
        for k in DRAFTER_SHAPE
        if getattr(saved, k, None) != getattr(given, k, None)
    ]
    if state.get("data") not in (None, data_id):
        diffs.append("the training data (other records, or in another order)")
    if diffs:
        raise ValueError(
            f"{ckpt} holds another run ({'; '.join(diffs)}). Resume it with the settings it was started with, or "
            f"train in a new --out (--init-from {ckpt} starts a new run from its weights)"
        )


def base_refetchable(drafter: PreTrainedModel, config: TrainConfig) -> bool:
    """Whether checkpoints may leave the base LM out: adapters-only training over an unchanged base that a resume,
    here or on another machine, fetches again (the embedded default target, or a Hub id in the local cache; not a
    folder of this machine, nor a Hub id this machine could not fetch)."""
    from huggingface_hub import try_to_load_from_cache

    from hf_d3d.targets import resolve_target

    base = drafter.config.base_model
    if not (config.adapters_only and base and drafter.base_unchanged()):
        return False
    if resolve_target(base) != base:
        return True
    if Path(base).exists() or base.count("/") != 1:
        return False
    return isinstance(try_to_load_from_cache(base, "config.json"), str)


def save_checkpoint(
    out_dir: Path,
    drafter: PreTrainedModel,
    optimizer,
    step: int,
    config: TrainConfig,
    log: list,
    data_id: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
    data_cursor: dict | None = None,
    base_checksum: float | None = None,
    lr_steps: int | None = None,
) -> None:
    """Write ``out_dir/checkpoint`` atomically: build it in a temporary folder, then swap it in.

    ``scaler``: fp16 training's loss scaler, whose scale a resume continues from (a fresh one would start at its
    initial scale and skip steps on overflow until it had backed off again). ``data_cursor``: where the next
    records are read (:func:`take_records`). ``base_checksum``: given where :func:`base_refetchable` holds, the
    checkpoint stores what trains and not the base LM (MBs, not the GBs of a large LM every --save-every steps),
    and a resume checks that the base it fetches again is this one. ``lr_steps``: the updates applied so far, which
    the learning-rate schedule has followed (fewer than ``step`` where fp16 overflow skipped some)."""
    with atomic_folder(out_dir / CHECKPOINT, overwrite=True) as tmp:
        drafter.save_pretrained(tmp, omit_base_weights=base_checksum is not None)
        optimizer_meta = _save_optimizer(optimizer, tmp / "optimizer.safetensors")
        state = {"step": step, "config": asdict(config), "data": data_id, "optimizer": optimizer_meta, "log": log}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        if data_cursor is not None:
            state["data_cursor"] = data_cursor
        if base_checksum is not None:
            state["base_checksum"] = base_checksum
        if lr_steps is not None:
            state["lr_steps"] = lr_steps
        write_json_atomic(tmp / "trainer_state.json", state)


def train(
    drafter: D3DDrafterModel,
    records: list[dict],
    out_dir: str | Path,
    config: TrainConfig,
    target: PreTrainedModel | None = None,
    eval_prompts: list[list[int]] | None = None,
    eval_max_new_tokens: int = 64,
) -> Path:
    """Train ``drafter`` on ``records``; resumes from ``out_dir/checkpoint`` if present. Returns ``out_dir/final``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=config.mixed_precision)
    check_replicated(accelerator.distributed_type)
    warn_emulated_bf16(accelerator.device, config.mixed_precision)
    # Published drafters are stored in bf16 to stay small, but small updates vanish in bf16 weights: training
    # keeps fp32 weights (its checkpoints are fp32) and --mixed-precision chooses the compute type.
    drafter = drafter.float()  # in place: the caller's model is now fp32 too
    dcfg = drafter.config
    validate_records(records, dcfg.vocab_size, dcfg.max_position_embeddings, dcfg.block_size)

    step, log, state = 0, [], {}
    lr_steps = 0  # updates applied: an fp16 step skipped for overflow leaves the schedule where it was, as in Trainer
    ckpt = out / CHECKPOINT
    if accelerator.is_main_process:
        recover_folder(ckpt)  # a save cut between its two renames left the last checkpoint under its old name
    accelerator.wait_for_everyone()
    data_id = data_fingerprint(records)
    if (ckpt / "trainer_state.json").is_file():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        from hf_d3d.targets import load_drafter  # fetches a base the checkpoint left out, as loading the result does

        resumed = load_drafter(str(ckpt), dtype=drafter.dtype)
        want = state.get("base_checksum")
        have = resumed.base_checksum() if want is not None else None
        if want is not None and abs(have - want) > 1e-9 * abs(want):
            raise ValueError(
                f"{ckpt} stores the adapters alone, and the base LM fetched to resume it "
                f"({resumed.config.base_model!r}) has other weights than the run trained over (checksum "
                f"{have:.12g}, expected {want:.12g}): resume where that base is, or train anew"
            )
        check_resume(state, config, data_id, dcfg, resumed.config, ckpt)
        drafter, dcfg = resumed, resumed.config
        step, log = state["step"], state["log"]
        lr_steps = state.get("lr_steps", step)
        before = state.get("config", {}).get("max_steps")
        if accelerator.is_main_process and before not in (None, config.max_steps):  # allowed, and never silent
            lr_then, lr_now = (
                cosine_lr_factor(lr_steps, config.warmup_steps, n) * config.lr for n in (before, config.max_steps)
            )
            print(
                f"resuming at step {step} with --steps {config.max_steps} (the run was started with {before}): the "
                f"cosine schedule is now {config.max_steps} steps long, so the learning rate goes from "
                f"{lr_then:.3g} to {lr_now:.3g}"
            )
    if config.adapters_only:
        if not dcfg.block_adapter_rank:
            raise ValueError("adapters_only needs a drafter with block adapters (block_adapter_rank > 0)")
        for name, p in drafter.named_parameters():
            p.requires_grad_("block_adapters" in name)
    if config.freeze_layers >= dcfg.num_hidden_layers:
        raise ValueError(
            f"freeze_layers={config.freeze_layers} leaves none of {dcfg.num_hidden_layers} layers to train"
        )
    if config.freeze_embeddings or config.freeze_layers:
        drafter.get_input_embeddings().weight.requires_grad_(False)
        drafter.get_output_embeddings().weight.requires_grad_(False)
    if config.freeze_layers:
        if drafter.model.mask_embedding is not None:
            drafter.model.mask_embedding.requires_grad_(False)
        for layer in drafter.model.layers[: config.freeze_layers]:
            layer.requires_grad_(False)
    drafter.train()
    if config.kd_weight and accelerator.is_main_process:  # the other processes may hold the target's config alone
        if target is None:
            raise ValueError("kd_weight needs the target, to check that the soft labels are its own")
        check_teacher(drafter, target, records[0]["prompt_ids"] + records[0]["response_ids"])
    params = [p for p in drafter.parameters() if p.requires_grad]
    # the frozen base's checksum, taken once: checkpoints leave that base out where a resume can fetch it again
    base_sum = drafter.base_checksum() if accelerator.is_main_process and base_refetchable(drafter, config) else None
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    if step:
        _load_optimizer(optimizer, ckpt / "optimizer.safetensors", state["optimizer"])
        if accelerator.scaler is not None and state.get("scaler"):  # absent when the run moved from bf16 or no AMP
            accelerator.scaler.load_state_dict(state["scaler"])
    # Resuming: the schedule starts at the updates applied so far (the loaded param groups carry its initial_lr).
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, config.warmup_steps, config.max_steps, last_epoch=lr_steps - 1
    )
    # The scheduler stays outside prepare(): accelerate would step it once per process, but max_steps counts
    # optimizer steps, so it is stepped here once per applied synced update on every process alike.
    model, optimizer = accelerator.prepare(drafter, optimizer)
    if target is not None and eval_prompts and accelerator.is_main_process:
        # The periodic eval decodes with both models, so they share a device; on a GPU the target goes in bf16, as
        # users run it there, so that it takes half the memory beside the training state (the drafter reads tokens
        # only, so the two need not share a dtype).
        gpu = accelerator.device.type == "cuda" and torch.cuda.is_bf16_supported()
        target.to(accelerator.device, dtype=torch.bfloat16 if gpu else None)

    pad_id = dcfg.pad_token_id if dcfg.pad_token_id is not None else 0
    fill_id = dcfg.mask_token_id if dcfg.mask_token_id is not None else 0
    per_step = config.batch_size * accelerator.num_processes
    if len(records) < per_step:  # a process would get an empty batch and the others would wait for it forever
        raise ValueError(
            f"{len(records)} records are fewer than one step reads: {config.batch_size} per process x "
            f"{accelerator.num_processes} processes"
        )
    steps_per_epoch = max(1, len(records) // per_step)

    # With block adapters alone trained, the context's computation is the frozen LM's: the forward skips autograd
    # there, and next-token labels, a constant of the frozen LM, are not built at all.
    frozen_context = config.adapters_only
    max_ar_positions = 0 if frozen_context else config.max_ar_positions

    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records]

    @functools.lru_cache(maxsize=1)  # an epoch's order is drawn once, not at every step
    def order_of(epoch: int, order_per_step: int) -> list[int]:
        return epoch_order(lengths, order_per_step, config.seed + epoch, config.group_by_length)

    # Where the data stands, saved with each checkpoint: a resume under another process count (the move to GPUs)
    # goes on reading the same epoch order where it stopped. A checkpoint from before it was saved is placed by
    # its step, as it was read.
    cursor = state.get("data_cursor") if step else None
    if cursor is None:
        epoch, micro_steps = divmod(step * config.grad_accum, steps_per_epoch)
        cursor = {"epoch": epoch, "offset": micro_steps * per_step, "order_per_step": per_step}

    def batch_for(step_idx: int, micro: int):
        nonlocal cursor
        at, cursor = take_records(cursor, per_step, len(records))
        order = order_of(at["epoch"], at["order_per_step"])
        start = at["offset"] + accelerator.process_index * config.batch_size
        chosen = [records[int(i)] for i in order[start : start + config.batch_size]]
        gen = torch.Generator().manual_seed(hash((config.seed, step_idx, micro, accelerator.process_index)) % 2**63)
        return make_batch(chosen, dcfg.block_size, config.num_blocks, pad_id, fill_id, gen, max_ar_positions)

    vocab_index = None
    if config.draft_vocab_loss and dcfg.draft_vocab_size is not None:
        vocab_index = torch.full((dcfg.vocab_size,), IGNORE, dtype=torch.long)
        vocab_index[drafter.draft_vocab.cpu()] = torch.arange(dcfg.draft_vocab_size)
        vocab_index = vocab_index.to(accelerator.device)

    bar = tqdm(total=config.max_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    # Wall seconds of the whole run, summed over resumes, so a log says what each step cost on its hardware.
    elapsed, started = (log[-1].get("elapsed_s", 0.0) if log else 0.0), time.perf_counter()
    while step < config.max_steps:
        micro_metrics = []
        for micro in range(config.grad_accum):
            batch = batch_for(step, micro)
            batch.input_ids = batch.input_ids.to(accelerator.device)
            batch.labels = batch.labels.to(accelerator.device)
            batch.slot_index = batch.slot_index.to(accelerator.device)
            for name in ("position_ids", "block_ids", "is_slot", "anchors"):
                setattr(batch.layout, name, getattr(batch.layout, name).to(accelerator.device))
            with accelerator.accumulate(model):
                loss, metrics = d3d_loss(
                    model,
                    batch,
                    config.ar_weight,
                    config.slot_decay,
                    vocab_index,
                    frozen_context=frozen_context,
                    kd_weight=config.kd_weight,
                    kd_temperature=config.kd_temperature,
                    unreached_weight=config.unreached_weight,
                )
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                    lr_steps += 1
                optimizer.zero_grad()
            micro_metrics.append(metrics)
        metrics = step_metrics(micro_metrics, accelerator)
        step += 1
        metrics["step"], metrics["lr"] = step, scheduler.get_last_lr()[0]
        metrics["elapsed_s"] = round(elapsed + time.perf_counter() - started, 2)
        bar.update(1)
        shown = ("loss", "denoise", "ar", "kd", "slot0_acc")
        bar.set_postfix({k: round(v, 3) for k, v in metrics.items() if k in shown})
        if (
            accelerator.is_main_process
            and target is not None
            and eval_prompts
            and (step % config.eval_every == 0 or step == config.max_steps)
        ):
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.eval()
            metrics["eval_tau"] = measure_tau(target, unwrapped, eval_prompts, eval_max_new_tokens)["tau"]
            unwrapped.train()
            tqdm.write(f"step {step}: eval tau {metrics['eval_tau']:.3f}")
        log.append(metrics)
        if accelerator.is_main_process and (step % config.save_every == 0 or step == config.max_steps):
            save_checkpoint(
                out,
                accelerator.unwrap_model(model),
                optimizer,
                step,
                config,
                log,
                data_id,
                accelerator.scaler,
                cursor,
                base_sum,
                lr_steps,
            )
        accelerator.wait_for_everyone()
    bar.close()
    final = out / FINAL
    if accelerator.is_main_process:
        save_final(accelerator.unwrap_model(model), final, config, log)
    return final


def save_final(drafter: PreTrainedModel, folder: Path, config: TrainConfig, log: list) -> None:
    """Write a run's result (atomically): the drafter in ``config.save_dtype`` and the training log beside it."""
    drafter = drafter.eval()
    if config.save_dtype != "float32":
        drafter = copy.deepcopy(drafter).to(getattr(torch, config.save_dtype))
    # Adapters-only training leaves the base LM as it was: the result stores the adapters, the base is fetched.
    # A drafter whose base was changed before (a full fine-tune, grown layers) keeps its whole weights.
    omit = config.adapters_only and bool(drafter.config.base_model) and drafter.base_unchanged()
    with atomic_folder(folder, overwrite=True) as tmp:
        drafter.save_pretrained(tmp, omit_base_weights=omit)
        write_json_atomic(tmp / "training_log.json", {"config": asdict(config), "log": log})


def epoch_order(lengths: list[int], per_step: int, seed: int, group_by_length: bool = False) -> list[int]:
    """The order in which one epoch reads the records, from ``seed`` and ``per_step`` (so a resumed run reads the same).
    ``group_by_length``: every ``per_step`` consecutive records have similar lengths."""
    generator = torch.Generator().manual_seed(seed)
    if group_by_length:
        return get_length_grouped_indices(lengths, per_step, generator=generator)
    return torch.randperm(len(lengths), generator=generator).tolist()


def step_metrics(micro_metrics: list[dict], accelerator: Accelerator) -> dict:
    """A step's logged metrics: the mean over its micro-batches, and ``loss``, ``denoise`` and ``slot0_acc`` also
    over the processes (one reduce per step; ``ar`` and ``kd`` are the main process's), so the log describes the
    whole step rather than one process's last batch."""
    keys = {k for m in micro_metrics for k in m}
    mean = {k: sum(m[k] for m in micro_metrics if k in m) / sum(k in m for m in micro_metrics) for k in sorted(keys)}
    if accelerator.num_processes > 1:
        shared = [k for k in ("loss", "denoise", "slot0_acc") if k in mean]
        values = accelerator.reduce(torch.tensor([mean[k] for k in shared], device=accelerator.device), "mean")
        mean.update(zip(shared, values.tolist()))
    return mean


def cosine_lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """The factor of the peak learning rate at ``step`` under transformers' cosine schedule with warmup."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def take_records(cursor: dict, per_step: int, num_records: int) -> tuple[dict, dict]:
    """Where the next ``per_step`` records are read (``epoch``, ``offset`` into its order, and the ``order_per_step``
    the order was drawn for), and the cursor after them. An epoch's order is read to its end even when a resume
    changes ``per_step`` (another process count); a remainder shorter than a step is left out."""
    if cursor["offset"] + per_step > num_records:
        cursor = {"epoch": cursor["epoch"] + 1, "offset": 0, "order_per_step": per_step}
    return cursor, {**cursor, "offset": cursor["offset"] + per_step}


def epochs_to_steps(num_records: int, epochs: float, batch_size: int, grad_accum: int, num_processes: int = 1) -> int:
    """Optimizer steps for ``epochs`` passes over the data; each process takes ``batch_size`` records a micro-step."""
    if min(batch_size, grad_accum, num_processes) < 1 or epochs <= 0:
        raise ValueError(
            f"epochs must be positive and batch_size, grad_accum, num_processes at least 1; got {epochs}, "
            f"{batch_size}, {grad_accum}, {num_processes}"
        )
    return max(1, math.ceil(num_records * epochs / (batch_size * grad_accum * num_processes)))
