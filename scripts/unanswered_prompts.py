"""Write the prompts of a slice that given distillation data does not answer greedily (or, with `--sampled`, with a
sampled answer), as JSONL for `hf-d3d distill`.

A distillation run works shortest prompt first, so a run cut short leaves its slice's longest prompts unanswered;
this extract lets a new run answer exactly those (pass `--source-name` naming the slice, so the licence is kept):

    python scripts/unanswered_prompts.py --prompts gsm8k:train --skip-prompts 1000 --num-prompts 2000 \
        --data data/distill/SmolLM2-135M-Instruct/gsm8k_train_1000.safetensors --out rest.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from hf_d3d.atomic import write_text_atomic
from hf_d3d.checks import tokenizer_fingerprint
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import resolve_target
from hf_d3d.train.distill import META, chat_prompt_ids, load_records
from hf_d3d.train.token_file import read_token_file


def _sampled(source: str) -> bool:
    if Path(source).is_file():
        return bool(read_token_file(source)[1].get("do_sample"))
    return bool(json.loads((Path(source) / META).read_text(encoding="utf-8")).get("do_sample"))


def unanswered(prompts: list[str], tokenizer, target: str, *data: str, sampled: bool = False) -> list[str]:
    """The prompts (in order) with no greedy answer in ``data`` (with ``sampled``, no sampled one), which must be
    ``target``'s: a sampled answer is another draw beside a greedy one, not in place of it."""
    answered = set()
    for source in data:
        records = load_records(source, target=target, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
        if _sampled(source) == sampled:
            answered.update(tuple(r["prompt_ids"]) for r in records)
    return [p for p in prompts if tuple(chat_prompt_ids(tokenizer, p)) not in answered]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--field", default="question")
    parser.add_argument("--skip-prompts", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--data", nargs="+", required=True, help="token files or finished distill folders")
    parser.add_argument("--target", default=None, help="the target whose chat template the data used")
    parser.add_argument(
        "--sampled", action="store_true", help="the prompts with no sampled answer (a cut-short --do-sample run)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(args.prompts, args.field, args.num_prompts, args.skip_prompts)
    rest = unanswered(prompts, tokenizer, target, *args.data, sampled=args.sampled)
    write_text_atomic(args.out, "".join(json.dumps({args.field: p}) + "\n" for p in rest))
    print(f"{len(rest)} of {len(prompts)} prompts have no answer in the data -> {args.out}")


if __name__ == "__main__":
    main()
