"""How much of the target's greedy output on held-out prompts a draft vocabulary can propose at all.

Usage: python scripts/draft_vocab_coverage.py [--drafter DIR] [--sizes 8192,16384] [--num-prompts 10]

A drafter with a draft vocabulary can never propose a token outside it, so the share of the target's output tokens
inside it bounds every slot's acceptance. Prints that share for the drafter's own vocabulary and for the ``--sizes``
most frequent tokens counted over the committed token files (as ``hf-d3d draft-vocab`` counts them), on the target's
answers (chat template, greedy, ``--max-new-tokens``) to GSM8K test, HumanEval and held-aside ShareGPT prompts.
"""

import argparse
import glob

import torch

from hf_d3d.draft_vocab import frequent_tokens
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids, load_records

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", default="checkpoints/SmolLM2-135M-Instruct-D3D")
parser.add_argument("--data", default="data/distill/SmolLM2-135M-Instruct/*.safetensors")
parser.add_argument("--sizes", default="8192,12288,16384,24576,32768")
parser.add_argument("--prompts", default="gsm8k:test,humaneval,sharegpt:heldout")
parser.add_argument("--num-prompts", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()

target, tokenizer = load_target()
drafter = load_drafter(args.drafter)
if drafter.config.draft_vocab_size is None:
    raise SystemExit(f"{args.drafter} proposes from the whole vocabulary: nothing to measure")
outputs = {}
for source in args.prompts.split(","):
    outputs[source] = []
    for prompt in load_prompts(source, None, args.num_prompts):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        outputs[source] += out[0, ids.shape[1] :].tolist()


def shares(vocab: set[int]) -> str:
    return " / ".join(f"{sum(t in vocab for t in out) / len(out):.1%}" for out in outputs.values())


print(f"held-out shares: {' / '.join(outputs)}")
print(f"the drafter's own {drafter.config.draft_vocab_size} tokens: {shares(set(drafter.draft_vocab.tolist()))}")
records = load_records(*sorted(glob.glob(args.data)))
for size in [int(s) for s in args.sizes.split(",")]:
    vocab, covered = frequent_tokens(records, size, (tokenizer.eos_token_id,))
    print(f"{size} most frequent in the token files (they cover {covered:.1%} of them): {shares(set(vocab))}")
