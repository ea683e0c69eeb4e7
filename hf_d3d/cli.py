"""``hf-d3d`` command line: distill, train, and the rest of the pipeline, each a thin wrapper over the library."""

from __future__ import annotations

import argparse
import sys


def _cmd_distill(args: argparse.Namespace) -> None:
    from hf_d3d.prompts import load_prompts
    from hf_d3d.targets import load_target
    from hf_d3d.train.distill import DistillConfig, distill

    prompts = load_prompts(args.prompts, args.field, args.num_prompts)
    target, tokenizer = load_target(args.target)
    cfg = DistillConfig(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, do_sample=args.do_sample,
        temperature=args.temperature, seed=args.seed,
    )
    out = distill(target, tokenizer, prompts, args.out, cfg, source=args.prompts)
    print(f"distillation data ready in {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-d3d", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("distill", help="the target's own responses to prompts, as token ids (resumable)")
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", required=True, help="gsm8k:train, gsm8k:test, humaneval, sharegpt or a JSONL path")
    p.add_argument("--field", default="question", help="JSONL field holding the prompt")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_distill)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (FileNotFoundError, KeyError, ValueError, OSError, ModuleNotFoundError) as err:
        print(f"hf-d3d {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
