"""The D3D training objective: blockwise denoising with slot-decayed weights plus an auxiliary next-token loss.

A batch holds whole sequences (prompt + response) as clean context followed by mask blocks anchored at random
response positions, all in one forward with the D3D attention pattern. Loss is taken on response tokens only.
A drafter built on the target itself can also learn from the target's soft labels, read off the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_d3d.modeling.attention_d3d import D3DLayout, pack_blocks

IGNORE = -100


@dataclass
class D3DBatch:
    input_ids: torch.LongTensor  # [b, T]: padded context, then blocks
    layout: D3DLayout
    labels: torch.LongTensor  # [b, T]: the token each position must predict, IGNORE where no loss
    slot_index: torch.LongTensor  # [b, T]: slot number j inside its block, -1 for context tokens


def teacher_rows(batch: D3DBatch) -> torch.LongTensor:
    """``[b, T]``: for each slot with a label, the context row that predicts the same token (``anchor + j``, the
    row before the token slot ``j`` stands for), else -1."""
    layout = batch.layout
    rows = layout.anchors - layout.past_length + batch.slot_index
    return torch.where(layout.is_slot & (batch.labels != IGNORE), rows, -1)


def slots_reached(correct: torch.Tensor, slot_index: torch.Tensor) -> torch.Tensor:
    """Whether every earlier slot of each slot's block is ``correct``: the slots greedy verification reads.

    ``correct`` and ``slot_index`` run over the slot rows of a batch, each block's slots in order from 0 (a block may
    stop early where its sequence ends)."""
    wrong = (~correct).long()
    wrong_before = wrong.cumsum(0) - wrong  # wrong slots before this row, over the whole batch
    rows = torch.arange(len(slot_index), device=slot_index.device)
    start = torch.where(slot_index == 0, rows, 0).cummax(0).values  # each row's block start (no host sync)
    return wrong_before == wrong_before[start]


def make_batch(
    records: list[dict],
    block_size: int,
    num_blocks: int,
    pad_id: int,
    fill_id: int,
    generator: torch.Generator,
    max_ar_positions: int | None = None,
) -> D3DBatch:
    """Build one training batch from distillation records (``prompt_ids`` + ``response_ids`` each)."""
    seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in records]
    width = max(len(s) for s in seqs)
    all_ids, all_labels, layouts, all_slots = [], [], [], []
    for rec, seq in zip(records, seqs):
        n_prompt, n = len(rec["prompt_ids"]), len(seq)
        if len(rec["response_ids"]) == 0:
            raise ValueError(f"record {rec.get('idx', '?')} has an empty response; nothing to learn from it")
        ctx = torch.full((1, width), pad_id, dtype=torch.long)
        ctx[0, :n] = torch.tensor(seq)
        # Anchors: after the last prompt token up to before the last token, so each block predicts >= 1 response token.
        # (The packed pass's hypothesis blocks, which start with a guessed token, need no training of their own:
        # under the D3D mask a block-private clean token is seen exactly as the same token in the context would be.)
        choices = torch.arange(n_prompt - 1, n - 1)
        pick = torch.randint(len(choices), (num_blocks,), generator=generator)
        anchors = choices[pick].tolist()
        ids, layout = pack_blocks(ctx, 0, anchors, block_size, fill_id)

        seq_t = torch.tensor(seq)
        labels = torch.full((ids.shape[1],), IGNORE, dtype=torch.long)
        # Auxiliary AR loss: context position i predicts token i + 1, on response tokens only.
        ar_pos = torch.arange(n_prompt - 1, n - 1)
        if max_ar_positions == 0:  # no draw: the anchors stay those of a run with no limit
            ar_pos = ar_pos[:0]
        elif max_ar_positions is not None and len(ar_pos) > max_ar_positions:
            ar_pos = ar_pos[torch.randperm(len(ar_pos), generator=generator)[:max_ar_positions]]
        labels[ar_pos] = seq_t[ar_pos + 1]
        slot_index = torch.full((ids.shape[1],), -1, dtype=torch.long)
        for b, anchor in enumerate(anchors):
            start = width + b * block_size
            for j in range(block_size):
                target_pos = anchor + 1 + j
                slot_index[start + j] = j
                if target_pos < n:  # slots past the end of the sequence carry no loss
                    labels[start + j] = seq[target_pos]
        all_ids.append(ids)
        all_labels.append(labels)
        layouts.append(layout)
        all_slots.append(slot_index)
    layout = D3DLayout(
        position_ids=torch.cat([lay.position_ids for lay in layouts]),
        block_ids=torch.cat([lay.block_ids for lay in layouts]),
        is_slot=torch.cat([lay.is_slot for lay in layouts]),
        anchors=torch.cat([lay.anchors for lay in layouts]),
        past_length=0,
        num_context=width,
    )
    return D3DBatch(torch.cat(all_ids), layout, torch.stack(all_labels), torch.stack(all_slots))


def d3d_loss(
    drafter: torch.nn.Module,
    batch: D3DBatch,
    ar_weight: float = 0.5,
    slot_decay: float = 0.8,
    vocab_index: torch.Tensor | None = None,
    frozen_context: bool = False,
    kd_weight: float = 0.0,
    kd_temperature: float = 1.0,
    unreached_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss = slot-weighted denoising CE + ``ar_weight`` * next-token CE (+ ``kd_weight`` * slot-weighted KD).
    Logits only where they are needed.

    ``vocab_index`` (token id -> position in the drafter's draft vocabulary, ``IGNORE`` outside it) trains the
    softmax over the draft vocabulary, which is exactly what the drafter proposes from; tokens outside it, which
    it can never propose, carry no loss.
    ``frozen_context``: block adapters are the only trainable weights, so the context needs no autograd (see the
    drafter's ``forward``); the batch should then carry no next-token labels, which could have no gradient.
    ``kd_weight``: soft labels from the same forward. With ``frozen_context`` the context rows are the frozen LM's
    next-token distributions; when that LM is the target itself (the trainer checks), context row ``anchor + j``
    is the target's distribution over the very token slot ``j`` predicts. Each slot then also learns
    ``KL(teacher || slot)`` at ``kd_temperature`` (scaled by its square), weighted as its cross-entropy.
    ``unreached_weight``: a slot's weight where an earlier slot of its block drafts a wrong token (argmax of this
    forward), so that greedy verification would never reach it; 1 weighs every slot alike, 0 trains only the
    slots verification would read.
    """
    if kd_weight and not frozen_context:
        raise ValueError("kd_weight needs frozen_context: only then are the context rows the frozen LM's own")
    has_label = batch.labels != IGNORE
    keep = has_label
    if kd_weight:
        teacher_row = teacher_rows(batch)
        has_teacher = teacher_row >= 0
        rows = torch.zeros_like(teacher_row).scatter_add_(1, teacher_row.clamp_min(0), has_teacher.long())
        keep = has_label | (rows > 0)
    restrict = {"draft_logits": True} if vocab_index is not None else {}
    # Going through forward (not the submodules) keeps the DDP wrapper in charge of gradient sync.
    if frozen_context:
        thawed = [n for n, p in drafter.named_parameters() if p.requires_grad and "block_adapters" not in n]
        if thawed:  # their gradient from the context rows would be lost
            raise ValueError(f"frozen_context needs block adapters alone trainable; also trainable: {thawed[:3]}")
        restrict["frozen_context"] = True
    out = drafter(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=keep, **restrict)
    kept = out.logits.float()
    if kd_weight:
        row_of = keep.flatten().cumsum(0).view_as(keep) - 1  # (sequence, position) -> row of the kept logits
    logits = kept[row_of[has_label]] if kd_weight else kept
    labels, is_slot, slot_index = batch.labels[has_label], batch.layout.is_slot[has_label], batch.slot_index[has_label]
    if vocab_index is not None:
        labels = vocab_index[labels]

    slot_logits, slot_labels = logits[is_slot], labels[is_slot]
    slot_logp = F.log_softmax(slot_logits, -1)  # shared by the cross-entropy and, at temperature 1, the KD term
    slot_ce = F.nll_loss(slot_logp, slot_labels, reduction="none", ignore_index=IGNORE)
    # Early slots decide how many tokens are accepted, so they weigh more.
    weights = slot_decay ** slot_index[is_slot].float() * (slot_labels != IGNORE)
    if unreached_weight != 1.0:
        reached = slots_reached(slot_logits.detach().argmax(-1) == slot_labels, slot_index[is_slot])
        weights = weights * (unreached_weight + (1.0 - unreached_weight) * reached.float())
    denoise = (slot_ce * weights).sum() / weights.sum().clamp_min(1e-6)
    # A sum over a count, not a Python branch on whether labels exist: a branch would wait on the device.
    ar_labels = labels[~is_slot]
    ar_count = (ar_labels != IGNORE).sum()
    ar = F.cross_entropy(logits[~is_slot], ar_labels, ignore_index=IGNORE, reduction="sum") / ar_count.clamp_min(1)
    total = denoise + ar_weight * ar
    if kd_weight:
        seq = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[has_label][is_slot]
        teacher = kept[row_of[seq, teacher_row[has_label][is_slot]]].detach()
        temp = kd_temperature
        student = slot_logp if temp == 1 else F.log_softmax(slot_logits / temp, -1)
        kl = F.kl_div(student, F.log_softmax(teacher / temp, -1), reduction="none", log_target=True).sum(-1)
        kd = (kl * weights).sum() / weights.sum().clamp_min(1e-6) * temp**2
        total = total + kd_weight * kd
    with torch.no_grad():
        slot0 = (slot_index[is_slot] == 0) & (slot_labels != IGNORE)
        hits0 = ((slot_logits.argmax(-1) == slot_labels) & slot0).sum()
        acc0 = hits0 / slot0.sum().clamp_min(1)
        # One transfer for every metric: a host sync per step, not one per number.
        named = {"loss": total, "denoise": denoise, "slot0_acc": acc0, "ar": ar, "ar_count": ar_count}
        if kd_weight:
            named["kd"] = kd
        values = dict(zip(named, torch.stack([v.detach().float() for v in named.values()]).tolist()))
    if not values.pop("ar_count"):  # no next-token label in this batch: no next-token loss to report
        del values["ar"]
    return total, values
