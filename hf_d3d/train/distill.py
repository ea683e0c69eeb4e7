"""Self-distillation: the target answers chat-templated prompts; its own token ids become the drafter's data.

Output folder layout: ``records.jsonl`` (one ``{"idx", "prompt_ids", "response_ids"}`` per line, appended and
flushed batch by batch, so an interrupted run resumes where it stopped) and ``meta.json``, written atomically only
when every prompt is done. A folder without ``meta.json`` is an unfinished run, never mistaken for a dataset.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_d3d.atomic import write_json_atomic

RECORDS = "records.jsonl"
META = "meta.json"


@dataclass
class DistillConfig:
    max_new_tokens: int = 256
    batch_size: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    seed: int = 0


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a single user turn with the generation prompt, or raw if there is no template."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt)["input_ids"]


def _read_done(records: Path) -> set[int]:
    """Indices already distilled; a torn last line (killed mid-write) is cut off so appends stay valid JSONL."""
    if not records.exists():
        return set()
    done: set[int] = set()
    good_bytes = 0
    with open(records, "rb") as f:
        for line in f:
            try:
                done.add(json.loads(line)["idx"])
            except (json.JSONDecodeError, KeyError):
                break
            good_bytes += len(line)
    with open(records, "r+b") as f:
        f.truncate(good_bytes)
    return done


def load_records(*folders: str | Path) -> list[dict]:
    """Read finished distillation folders in order; an unfinished one is a clear error.

    A prompt already read from an earlier folder is dropped, so overlapping runs never count one answer twice.
    Folders distilled from differently named targets are refused: they would teach the drafter two models.
    """
    if not folders:
        raise ValueError("No distillation folder given.")
    records: list[dict] = []
    seen: set[tuple[int, ...]] = set()
    targets: dict[str, Path] = {}
    for folder in map(Path, folders):
        if not (folder / META).is_file():
            raise FileNotFoundError(f"{folder} is not a finished distillation run (no {META}); resume it with distill.")
        with open(folder / META, encoding="utf-8") as f:
            target = Path(json.load(f).get("target", "")).name
        targets.setdefault(target, folder)
        if len(targets) > 1:
            raise ValueError(f"{folder} was distilled from {target!r} but {targets[next(iter(targets))]} was not.")
        with open(folder / RECORDS, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                key = tuple(record["prompt_ids"])
                if key not in seen:
                    seen.add(key)
                    records.append(record)
    return records


@torch.no_grad()
def distill(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    out_dir: str | Path,
    config: DistillConfig | None = None,
    source: str = "",
) -> Path:
    """Generate the target's responses to ``prompts`` into ``out_dir``; resumes a partial run of the same prompts."""
    config = config or DistillConfig()
    if not prompts:
        raise ValueError("No prompts to distill.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / META).exists():
        return out
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = target.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])
    limit = getattr(target.config, "max_position_embeddings", None)

    encoded = [chat_prompt_ids(tokenizer, p) for p in prompts]
    if limit is not None:
        too_long = [i for i, ids in enumerate(encoded) if len(ids) + config.max_new_tokens > limit]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompts (first: #{too_long[0]}) plus max_new_tokens={config.max_new_tokens} exceed "
                f"the target's context of {limit} tokens; shorten them or lower max_new_tokens."
            )
    done = _read_done(out / RECORDS)
    # Similar lengths in a batch waste less compute on padding; the order is deterministic so resume is exact.
    todo = sorted((i for i in range(len(encoded)) if i not in done), key=lambda i: (len(encoded[i]), i))
    empty = 0
    torch.manual_seed(config.seed)
    with open(out / RECORDS, "a", encoding="utf-8") as f, tqdm(total=len(encoded), initial=len(done)) as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):  # left padding keeps every prompt's last token at the same column
                ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]) :] = 1
            gen = target.generate(
                input_ids=ids.to(target.device),
                attention_mask=mask.to(target.device),
                max_new_tokens=config.max_new_tokens,
                do_sample=config.do_sample,
                temperature=config.temperature if config.do_sample else None,
                top_p=None,
                top_k=None,
                pad_token_id=pad_id,
            )[:, width:].tolist()
            for row, i in enumerate(batch):
                response = []
                for tok in gen[row]:
                    response.append(tok)
                    if tok in eos_ids:
                        break
                if not response or response[0] in eos_ids:
                    empty += 1
                    continue
                f.write(json.dumps({"idx": i, "prompt_ids": encoded[i], "response_ids": response}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
            bar.set_postfix(empty=empty)
    n, tokens, covered = 0, 0, set()
    with open(out / RECORDS, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            n += 1
            tokens += len(record["response_ids"])
            covered.add(record["idx"])
    write_json_atomic(
        out / META,
        {
            "target": getattr(target.config, "name_or_path", ""),
            "source": source,
            "num_prompts": len(prompts),
            "num_records": n,
            "num_response_tokens": tokens,
            "skipped_empty": sum(i not in covered for i in range(len(prompts))),
            **asdict(config),
        },
    )
    return out
