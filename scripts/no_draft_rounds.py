"""The Hub path (the drafter as `from_pretrained(..., trust_remote_code=True)` loads it, `generate(assistant_model=)`)
under three draft-length rules, side by side with plain greedy in one run (`hf_d3d.bench.run_methods`: alternating,
warm-up, medians, outputs checked): every round drafts at least one token (the rule before no-draft rounds); k = 0
allowed (a round verifies the target's own token alone where no draft beats a plain decode step); k = 0 and the
drafter resting after such rounds (the shipped rule).

Usage: python scripts/no_draft_rounds.py [DRAFTER] [--num-prompts N] [--out RESULT.json]
(N prompts each of GSM8K test, HumanEval and held-aside ShareGPT; 128 new tokens)
"""

import argparse
import importlib
import json

import torch
from transformers import AutoModelForCausalLM

from hf_d3d.bench import markdown_table, run_methods
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("drafter", nargs="?", default="checkpoints/SmolLM2-135M-Instruct-D3D")
parser.add_argument("--num-prompts", type=int, default=4)
parser.add_argument("--out", default=None)
args = parser.parse_args()

target, tokenizer = load_target(None)
hub = AutoModelForCausalLM.from_pretrained(args.drafter, trust_remote_code=True).eval()
# the remote generator module, as transformers loaded it for this drafter
remote = importlib.import_module(type(hub).__module__.rsplit(".", 1)[0] + ".generation_d3d")
shipped_rule, shipped_rest = remote.draft_length, remote.MAX_IDLE_ROUNDS
prompts = [
    chat_prompt_ids(tokenizer, p)
    for source in ("gsm8k:test", "humaneval", "sharegpt:heldout")
    for p in load_prompts(source, "question", args.num_prompts)
]
common = dict(do_sample=False, max_new_tokens=128, pad_token_id=target.generation_config.pad_token_id)


def hub_path(at_least_one: bool, rest: int):
    def run(x):
        remote.draft_length = (lambda c, r: max(shipped_rule(c, r), 1)) if at_least_one else shipped_rule
        remote.MAX_IDLE_ROUNDS = rest
        try:
            return target.generate(x, attention_mask=torch.ones_like(x), assistant_model=hub, **common)
        finally:
            remote.draft_length, remote.MAX_IDLE_ROUNDS = shipped_rule, shipped_rest

    return run


runners = {
    "plain": (lambda x: target.generate(x, attention_mask=torch.ones_like(x), **common), None),
    "hub_draft_always": (hub_path(True, 0), hub),
    "hub_no_draft_rounds": (hub_path(False, 0), hub),
    "hub_no_draft_rounds_rest": (hub_path(False, shipped_rest), hub),
}
result = run_methods(target, runners, prompts, 128)
print(markdown_table(result))
if args.out:
    with open(args.out, "w") as f:
        json.dump({k: v for k, v in result.items() if k != "records"}, f, indent=1)
