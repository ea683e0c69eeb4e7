"""How often each draft slot agrees with the target, on the target's own greedy and sampled answers.

Usage: python scripts/agreement.py DRAFTER [DRAFTER ...]

The target (SmolLM2-135M-Instruct, fp32) answers GSM8K test prompts 200-219, which neither the benchmark nor
``hf-d3d eval-tau`` uses, twice: greedily and by sampling at temperature 1 (128 new tokens, seeded). Teacher-forced
on those answers, a block is anchored after every response position and, for the first three slots, it prints:

* on the greedy answers, the share of slots whose argmax is the target's token (what greedy verification accepts,
  slot by slot, given the earlier slots right);
* on the sampled answers, the mean of sum_x min(p(x), q(x)) between the target's distribution p and the slot's q:
  the chance that speculative sampling accepts that slot's token.
"""

import sys

import torch

from hf_d3d.modeling.attention_d3d import pack_blocks
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

SLOTS = 3

target, tok = load_target()
questions = load_prompts("gsm8k:test", "question", 220)[200:220]
answers: dict[str, list[tuple[int, list[int]]]] = {"greedy": [], "sampled": []}
with torch.no_grad():
    for i, question in enumerate(questions):
        x = torch.tensor([chat_prompt_ids(tok, question)])
        for mode in answers:
            torch.manual_seed(i)
            # plain greedy / plain sampling from the target's raw distribution, which is what p below is
            sample = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if mode == "sampled" else {}
            out = target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=128, repetition_penalty=1.0, **sample
            )
            answers[mode].append((x.shape[1], out[0].tolist()))
    # the target's distribution at the positions that predict response tokens (n_prompt - 1 onwards)
    target_probs = {
        m: [target(torch.tensor([s])).logits[0, n - 1 :].float().softmax(-1) for n, s in answers[m]] for m in answers
    }

for name in sys.argv[1:]:
    drafter = load_drafter(name).float().eval()
    block = drafter.config.block_size
    slots = min(SLOTS, block)
    fill = drafter.config.mask_token_id or 0
    scores = {}
    for mode in answers:
        top1, overlap, count = torch.zeros(slots), torch.zeros(slots), torch.zeros(slots)
        for (n_prompt, seq), p in zip(answers[mode], target_probs[mode]):
            anchors = list(range(n_prompt - 1, len(seq) - 1))
            ids, layout = pack_blocks(torch.tensor([seq]), 0, anchors, block, fill)
            with torch.no_grad():
                logits = drafter(ids, layout=layout, use_cache=False).logits[0, len(seq) :]
            q = logits.float().view(len(anchors), block, -1)[:, :slots].softmax(-1)
            for j in range(slots):
                rows = [(b, a + j) for b, a in enumerate(anchors) if a + 1 + j < len(seq)]
                if not rows:
                    continue
                blocks = torch.tensor([r[0] for r in rows])
                positions = torch.tensor([r[1] for r in rows]) - (n_prompt - 1)  # rows of p
                truth = torch.tensor([seq[pos + 1] for _, pos in rows])
                top1[j] += (q[blocks, j].argmax(-1) == truth).sum()
                overlap[j] += torch.minimum(q[blocks, j], p[positions]).sum()
                count[j] += len(rows)
        scores[mode] = (top1 / count, overlap / count)
    greedy = " ".join(f"{v:.3f}" for v in scores["greedy"][0].tolist())
    sampled = " ".join(f"{v:.3f}" for v in scores["sampled"][1].tolist())
    print(
        f"{name}: greedy answers, argmax = target by slot: {greedy} | sampled answers, sum min(p, q) by slot: {sampled}"
    )
