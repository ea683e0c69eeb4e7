"""Per-slot draft accuracy on seen vs unseen distillation records: is the drafter short of data or of capacity?

Usage: python scripts/slot_accuracy.py DRAFTER SEEN_FOLDER UNSEEN_FOLDER [NUM_RECORDS]

Every record gets blocks anchored at fixed response positions (teacher-forced context, the target's own text),
as in training. For each slot j it prints the share of blocks whose slots 0..j are all right (argmax), which
is the chance that a draft of j + 1 tokens is accepted that far, and the teacher-forced tau that implies for
4 and 8 draft tokens. A large gap between seen and unseen records means more data would help; none means the
drafter's capacity (or training time) is the bound.
"""

import json
import sys
from pathlib import Path

import torch

from hf_d3d.modeling.attention_d3d import pack_blocks
from hf_d3d.targets import load_drafter


def prefix_accuracy(drafter, records: list[dict], num_blocks: int = 8) -> torch.Tensor:
    """[block_size] share of blocks whose first j + 1 slots all match the record's tokens."""
    cfg = drafter.config
    bsz = cfg.block_size
    hits = torch.zeros(bsz)
    total = 0
    for rec in records:
        seq = list(rec["prompt_ids"]) + list(rec["response_ids"])
        n_prompt, n = len(rec["prompt_ids"]), len(seq)
        if n - n_prompt < bsz + 1:
            continue
        # Evenly spaced anchors whose whole block lies inside the response.
        anchors = torch.linspace(n_prompt - 1, n - 1 - bsz, num_blocks).long().tolist()
        fill = cfg.mask_token_id if cfg.mask_token_id is not None else 0  # as in training
        ids, layout = pack_blocks(torch.tensor([seq]), 0, anchors, bsz, fill)
        with torch.no_grad():
            logits = drafter(ids, layout=layout, use_cache=False).logits[0, n:]
        guess = logits.argmax(-1).view(num_blocks, bsz)
        truth = torch.tensor([[seq[a + 1 + j] for j in range(bsz)] for a in anchors])
        hits += (guess == truth).long().cumprod(-1).sum(0).float()
        total += num_blocks
    return hits / max(total, 1)


def main() -> None:
    drafter = load_drafter(sys.argv[1]).float().eval()
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    for name, folder in (("seen", sys.argv[2]), ("unseen", sys.argv[3])):
        # Read records.jsonl directly: the unseen folder may be a distillation still running.
        with open(Path(folder) / "records.jsonl", encoding="utf-8") as f:
            records = [json.loads(line) for _, line in zip(range(count), f)]
        acc = prefix_accuracy(drafter, records)
        taus = {k: 1 + acc[:k].sum().item() for k in (4, 8)}
        row = " ".join(f"{a:.3f}" for a in acc.tolist())
        print(f"{name:7s} prefix accuracy by slot: {row} | tau(4) {taus[4]:.2f} tau(8) {taus[8]:.2f}")


if __name__ == "__main__":
    main()
