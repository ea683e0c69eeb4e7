"""Can a distillation heal of the LM path give back what one removed layer takes from a whole-LM drafter?

Removes ``--layer`` from the drafter, then trains the base weights of the layers from the removal up (adapters,
embeddings and lower layers frozen) to match the unpruned drafter's next-token distributions (KL on response
positions). Prints teacher-forced tau (:func:`hf_d3d.evaluate.teacher_forced_tau`) on the pruning judge's answers
and on answers neither the judge nor the heal sees, before and every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hf_d3d.evaluate import teacher_forced_tau
from hf_d3d.prune import drop_layers, judge_answers
from hf_d3d.targets import load_drafter
from hf_d3d.train.distill import load_records
from hf_d3d.train.objective import IGNORE, make_batch

DATA = "data/distill/SmolLM2-135M-Instruct/"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", default="checkpoints/SmolLM2-135M-Instruct-D3D-whole")
    parser.add_argument("--layer", type=int, default=4)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=25)
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher = load_drafter(args.drafter).float().eval()
    # the answers `hf-d3d prune --judge-data <sharegpt_train_0, gsm8k_train_0> --judge-records 16` judges on
    judge_src = load_records(DATA + "sharegpt_train_0.safetensors", DATA + "gsm8k_train_0.safetensors")
    judge = judge_answers(judge_src, 16)
    gsm8k = load_records(DATA + "gsm8k_train_1000.safetensors")
    held_src = load_records(DATA + "sharegpt_train_11200.safetensors")[-16:] + gsm8k[-16:]
    held = judge_answers(held_src, len(held_src))
    pool = load_records(DATA + "sharegpt_train_3200.safetensors", DATA + "sharegpt_code_400.safetensors") + gsm8k[:-16]
    heal = [r for r in pool if len(r["prompt_ids"]) + len(r["response_ids"]) <= 384]

    def report(model: torch.nn.Module, label: str) -> None:
        print(f"{label}: judged tau {teacher_forced_tau(model, judge):.3f}, held {teacher_forced_tau(model, held):.3f}")

    report(teacher, "unpruned")
    student = drop_layers(teacher, [args.layer]).float().eval()
    report(student, f"layer {args.layer} removed")
    for name, p in student.named_parameters():
        p.requires_grad_(
            name.startswith("model.layers.") and "block_adapters" not in name and int(name.split(".")[2]) >= args.layer
        )
    params = [p for p in student.parameters() if p.requires_grad]
    print(f"{len(heal)} heal answers, {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    cfg = teacher.config
    pad, fill = cfg.pad_token_id or 0, cfg.mask_token_id or 0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        chosen = [heal[i] for i in torch.randint(len(heal), (args.batch_size,), generator=gen).tolist()]
        batch = make_batch(chosen, cfg.block_size, 0, pad, fill, gen, None)  # context only: next-token positions
        keep = batch.labels != IGNORE
        with torch.no_grad():
            want = teacher(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=keep).logits.float()
        student.train()
        got = student(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=keep).logits.float()
        loss = F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 10)  # 10 warm-up steps
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        student.eval()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"step {step}: kl {loss.item():.4f}, argmax agreement {agree:.3f}, {time.perf_counter() - start:.1f} s")
        if step % args.eval_every == 0:
            report(student, f"healed {step} steps")


if __name__ == "__main__":
    main()
