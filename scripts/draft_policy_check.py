"""Is the per-round draft length well chosen? Teacher-forced drafting on the target's own greedy answers.

Usage: python scripts/draft_policy_check.py [DRAFTER] [--skip 200] [--num-prompts 10]

At every position of the target's greedy answer (GSM8K test prompts ``skip`` .. ``skip + num_prompts``; the bench
uses the first 20) the drafter drafts a whole block as a sync round would. Printed: per slot, the drafter's mean
confidence against how often the slot is right given that the earlier ones were (calibration), then the tokens
committed per unit of round cost (the drafter's measured ``round_cost``) that each way of choosing the draft length
would give over those positions: every fixed length, the shipped rule (``draft_length``), and the rule applied to
rescaled confidences ``min(1, scale * p ** power)``.
"""

import argparse
import statistics

import torch

from hf_d3d.modeling.generation_d3d import D3DCandidateGenerator, draft_length
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("drafter", nargs="?", default=None)
parser.add_argument("--skip", type=int, default=200)
parser.add_argument("--num-prompts", type=int, default=10)
args = parser.parse_args()

torch.manual_seed(0)
target, tokenizer = load_target()
drafter = load_drafter(args.drafter)
cost = (drafter.config.round_cost or {}).get("cpu")
if cost is None:
    raise SystemExit("the drafter has no measured round_cost for cpu: run `hf-d3d calibrate --write` first")
rows = []  # per position: slot confidences, accepted draft tokens, draft tokens the answer can check
with torch.no_grad():
    for prompt in load_prompts("gsm8k:test", limit=args.num_prompts, skip=args.skip):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        answer = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)[0]
        gen = D3DCandidateGenerator(drafter, async_drafting=False)
        gen.round_cost = None  # draft the whole block
        for t in range(ids.shape[1], answer.shape[0] - 1):
            cand, logits = gen.get_candidates(answer[None, :t])
            draft = cand[0, t:]
            probs = logits[0].softmax(-1)
            truth = answer[t : t + len(draft)]
            n = min(len(truth), len(draft))
            accepted = int((draft[:n] == truth[:n]).int().cumprod(0).sum())
            rows.append((probs.amax(-1).tolist(), accepted, n))

print(f"{len(rows)} positions, round cost {cost}")
for i in range(len(cost)):
    reached = [r for r in rows if r[1] >= i and r[2] > i]
    if reached:
        right = sum(r[1] > i for r in reached) / len(reached)
        conf = statistics.mean(r[0][i] for r in reached)
        print(f"slot {i + 1}: {len(reached)} reached, right {right:.3f}, mean confidence {conf:.3f}")


def throughput(choose) -> tuple[float, float]:
    """Committed tokens per unit of round cost, and the mean draft length, when ``choose(confidences)`` drafts."""
    tokens = spent = 0.0
    lengths = []
    for conf, accepted, n in rows:
        k = max(1, min(choose(conf), n))
        tokens += min(accepted, k) + 1
        spent += cost[k - 1]
        lengths.append(k)
    return tokens / spent, statistics.mean(lengths)


for k in range(1, len(cost) + 1):
    print(f"fixed {k}: {throughput(lambda c, k=k: k)[0]:.3f} tokens per step")
shipped = throughput(lambda c: draft_length(c, cost))
print(f"shipped rule: {shipped[0]:.3f} tokens per step, mean draft length {shipped[1]:.2f}")
best = max(
    (throughput(lambda c, s=s, p=p: draft_length([min(1.0, s * x**p) for x in c], cost)), s, p)
    for s in (0.8, 0.9, 1.0, 1.1, 1.2)
    for p in (0.5, 0.75, 1.0, 1.5, 2.0)
)
print(f"best rescaling (scale {best[1]}, power {best[2]}): {best[0][0]:.3f} tokens per step")
