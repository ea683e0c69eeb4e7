"""Self-distillation: the target answers chat-templated prompts; its own token ids become the drafter's data.

Output folder layout: ``records.jsonl`` (one ``{"idx", "prompt_ids", "response_ids"}`` per line, appended and
flushed batch by batch, so an interrupted run resumes where it stopped) and ``meta.json``, written atomically only
when every prompt is done, or when asked to finish a run early (``finish_partial``; the meta then says
``"partial": true``, and calling again without it goes on from there). A folder without ``meta.json`` is an
unfinished run, never mistaken for a dataset.
Generation runs through ``target.generate`` (batched) or, for large targets on GPUs, vLLM's offline engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_d3d.atomic import write_json_atomic
from hf_d3d.checks import tokenizer_fingerprint as fingerprint_of
from hf_d3d.prompts import EVALUATION_SOURCES

RECORDS = "records.jsonl"
META = "meta.json"
REQUEST = "request.json"  # how a run generates, so a resume with other settings is refused


@dataclass
class DistillConfig:
    max_new_tokens: int = 256
    batch_size: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    seed: int = 0
    # Longer prompts are left out (counted in meta.json): chat sets such as ShareGPT hold a few prompts of many
    # thousand tokens that would cost more than hundreds of short ones, or exceed the target's context.
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be at least 1, got {self.max_prompt_tokens}")


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a single user turn with the generation prompt, or raw if there is no template."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt)["input_ids"]


def _generation_config(path: str) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the tokenizer's EOS is used
        return None


def _read_done(records: Path, encoded: list[list[int]]) -> set[int]:
    """Indices already distilled; a torn last line (killed mid-write) is cut off so appends stay valid JSONL.

    Every record names the prompt it answered, so a resume with other prompts (another slice, another source) is
    refused instead of mixing two datasets under one index.
    """
    if not records.exists():
        return set()
    done: set[int] = set()
    good_bytes = 0
    with open(records, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):  # whole JSON but no newline: the next append would join it to its record
                break
            try:
                record = json.loads(line)
                idx, prompt = record["idx"], record["prompt_ids"]
            except (json.JSONDecodeError, KeyError):
                break
            if idx >= len(encoded) or encoded[idx] != prompt:
                raise ValueError(f"{records} answers other prompts than these (record #{idx}); use a new folder")
            done.add(idx)
            good_bytes += len(line)
    with open(records, "r+b") as f:
        f.truncate(good_bytes)
    return done


def load_records(
    *sources: str | Path, target: str | None = None, tokenizer_fingerprint: str | None = None
) -> list[dict]:
    """Read finished distillation folders or token files (``hf-d3d pack-data``) in order; an unfinished folder or
    a corrupt file is a clear error. ``target`` (a Hub id or folder): the model the data is for; data distilled
    from a differently named model is refused (their tokenizers may map the same ids to other text).
    ``tokenizer_fingerprint`` (:func:`hf_d3d.checks.tokenizer_fingerprint` of the target's tokenizer): data whose
    provenance records another tokenizer is refused, whatever the model's name (data from before it was recorded
    is checked by name alone).

    One answer never counts twice: a greedy answer to a prompt that already has one is dropped (it is the same
    answer, up to batch numerics), and so is any answer read before. A sampled source (``do_sample`` in its
    provenance) adds new answers to prompts a greedy source answered: the target's distribution, not a repeat.
    Sources distilled from differently named targets are refused: they would teach the drafter two models, and so
    are sources whose provenance names an evaluation set (``hf_d3d.prompts.EVALUATION_SOURCES``).
    """
    from hf_d3d.train.token_file import read_token_file

    if not sources:
        raise ValueError("No distillation data given.")
    records: list[dict] = []
    greedy_prompts: set[tuple[int, ...]] = set()
    answers: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    targets: dict[str, Path] = {}
    for source in map(Path, sources):
        if source.is_file():
            batch, provenance = read_token_file(source)
        else:
            if not (source / META).is_file():
                raise FileNotFoundError(
                    f"{source} is not a finished distillation run (no {META}) nor a token file; resume it with distill."
                )
            with open(source / META, encoding="utf-8") as f:
                provenance = json.load(f)
            with open(source / RECORDS, encoding="utf-8") as f:
                batch = [json.loads(line) for line in f]
        # every part of a mixed source ("gsm8k:train,humaneval"), each without its slice
        parts = [part.split("[", 1)[0].strip() for part in str(provenance.get("source", "")).split(",")]
        asked = next((part for part in parts if part in EVALUATION_SOURCES), None)
        if asked is not None:
            raise ValueError(
                f"{source} answers {asked!r}, an evaluation set: a drafter trained on it would be measured on "
                "prompts it has seen; distil gsm8k:train, sharegpt:train or sharegpt:code"
            )
        name = Path(provenance.get("target", "")).name
        sampled = bool(provenance.get("do_sample", False))
        targets.setdefault(name, source)
        if len(targets) > 1:
            first, first_source = next(iter(targets.items()))
            raise ValueError(f"{source} was distilled from {name!r}, {first_source} from {first!r}: one target only")
        if target and name and name.lower() != Path(target).name.lower():
            raise ValueError(
                f"{source} was distilled from {name!r}, but the drafter is for {target!r}: pass --target naming the "
                "model that wrote the data, or distil this target's own answers"
            )
        written_with = provenance.get("tokenizer_fingerprint")
        if tokenizer_fingerprint and written_with and written_with != tokenizer_fingerprint:
            raise ValueError(
                f"{source} was written with another tokenizer (fingerprint {written_with}) than the target's "
                f"({tokenizer_fingerprint}): its token ids would mean other text to this drafter"
            )
        for record in batch:
            prompt, answer = tuple(record["prompt_ids"]), tuple(record["response_ids"])
            if (prompt, answer) in answers or (not sampled and prompt in greedy_prompts):
                continue
            answers.add((prompt, answer))
            if not sampled:
                greedy_prompts.add(prompt)
            records.append(record)
    return records


def pack_run(folder: str | Path, out: str | Path, vocab_size: int) -> Path:
    """Store a finished distillation folder as a token file with its provenance and licences."""
    from hf_d3d.train.token_file import LICENCES, write_token_file

    folder = Path(folder)
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{folder} is not a finished distillation run (no {META})")
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    with open(folder / RECORDS, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    family = meta.get("source", "").split(":", 1)[0].split("[", 1)[0]
    provenance = {
        **meta,
        "target": Path(meta.get("target", "")).name,  # the name, not a path of the machine it ran on
        "prompt_licence": LICENCES.get(family, "see the prompt source"),
        "response_licence": "the target's own outputs, under the target's licence",
    }
    return write_token_file(records, out, vocab_size, provenance)


# A backend turns a batch of prompt ids into continuations (which may run on past an EOS; the caller cuts them).
Backend = Callable[[list[list[int]]], list[list[int]]]


def transformers_backend(target: PreTrainedModel, pad_id: int, config: DistillConfig) -> Backend:
    """Batched ``target.generate`` with left padding (the default backend)."""

    @torch.no_grad()
    def run(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):  # left padding keeps every prompt's last token at the same column
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return target.generate(
            input_ids=ids.to(target.device),
            attention_mask=mask.to(target.device),
            max_new_tokens=config.max_new_tokens,
            do_sample=config.do_sample,
            temperature=config.temperature if config.do_sample else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
        )[:, width:].tolist()

    return run


def vllm_backend(
    model: str, config: DistillConfig, stop_ids: set[int], max_model_len: int, repetition_penalty: float = 1.0
) -> Backend:
    """vLLM's offline ``LLM`` engine for large targets on GPUs (greedy, or plain temperature sampling).

    It stops on exactly ``stop_ids`` (the ids the transformers backend stops on) and is built on the first batch,
    so resuming a finished-but-unmarked run loads no model.
    """
    try:
        from vllm import LLM, SamplingParams
    except ImportError as err:
        raise ModuleNotFoundError(
            "--backend vllm needs vLLM (`pip install vllm` on a CUDA machine); use --backend transformers here."
        ) from err
    params = SamplingParams(
        max_tokens=config.max_new_tokens,
        temperature=config.temperature if config.do_sample else 0.0,
        top_p=1.0,
        top_k=-1,
        seed=config.seed if config.do_sample else None,
        repetition_penalty=repetition_penalty,
        stop_token_ids=sorted(stop_ids),
        ignore_eos=True,  # the tokenizer's EOS only stops generation when it is one of stop_ids
        detokenize=False,
    )
    engine = []

    def run(batch: list[list[int]]) -> list[list[int]]:
        if not engine:
            engine.append(LLM(model=model, max_model_len=max_model_len))
        outs = engine[0].generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]

    return run


def _check_request(out: Path, request: dict) -> None:
    """Refuse to resume a folder with other generation settings: its records would mix two datasets."""
    path = out / REQUEST
    if path.is_file():
        old = json.loads(path.read_text())
        if "dtype" in request:  # requests written before the dtype was recorded all ran in float32
            old.setdefault("dtype", "float32")
        old.setdefault("max_prompt_tokens", None)  # nor did they leave prompts out
        old.setdefault("target", request.get("target"))  # nor name the target (its meta does, once finished)
        if old != request:
            changed = sorted(k for k in request.keys() | old.keys() if old.get(k) != request.get(k))
            raise ValueError(f"{out} holds a run with other {', '.join(changed)}; distill into a new folder")
    else:
        write_json_atomic(path, request)


def distill(
    target: PreTrainedModel | str,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    out_dir: str | Path,
    config: DistillConfig | None = None,
    source: str = "",
    backend: str = "transformers",
    finish_partial: bool = False,
) -> Path:
    """Generate the target's responses to ``prompts`` into ``out_dir``; resumes a partial run of the same prompts.

    ``target`` is a loaded model for the ``transformers`` backend, or a Hub id / folder for ``vllm``.
    ``finish_partial`` generates nothing more: it finishes an interrupted run (same arguments) with the prompts
    answered so far, so a long run can be cut short and trained on; its meta says ``"partial": true``.
    """
    config = config or DistillConfig()
    if not prompts:
        raise ValueError("No prompts to distill.")
    if backend not in ("transformers", "vllm"):
        raise ValueError(f"unknown backend {backend!r}; choose transformers or vllm")
    out = Path(out_dir)
    # Which model answers, by name (a Hub id and a local copy of it are one target), and in which dtype: a bf16
    # target's greedy answers part from the fp32 target's after a few dozen tokens, so they are another dataset.
    name = Path(target if isinstance(target, str) else getattr(target.config, "name_or_path", "") or "").name
    settings = {k: v for k, v in asdict(config).items() if k != "batch_size"}  # batching may change on resume
    if not isinstance(target, str):
        settings["dtype"] = str(target.dtype).removeprefix("torch.")
    # A run finished early (``finish_partial``) goes on when called again without it; any other finished run is done.
    finished = (out / META).exists()
    resume_partial = finished and not finish_partial and json.loads((out / META).read_text()).get("partial")
    if finished and not resume_partial:
        asked = {**settings, "target": name, "backend": backend, "source": source, "num_prompts": len(prompts)}
        meta = json.loads((out / META).read_text())
        meta["target"] = Path(meta.get("target") or "").name
        changed = sorted(k for k in asked if k in meta and meta[k] != asked[k])
        if changed:
            raise ValueError(
                f"{out} holds a finished run with other {', '.join(changed)}; distill into a new folder (or delete "
                f"its {META} to extend that run)"
            )
        return out
    if finish_partial and not (out / RECORDS).is_file():
        raise FileNotFoundError(f"{out} holds no started distillation run: nothing to finish")
    if isinstance(target, str):
        if backend != "vllm":
            raise TypeError("the transformers backend needs a loaded model, not a name")
        model_config, generation_config = AutoConfig.from_pretrained(target), _generation_config(target)
    else:
        if backend != "transformers":
            raise TypeError("the vllm backend loads the target itself: pass its Hub id or folder")
        model_config, generation_config = target.config, target.generation_config
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = generation_config.eos_token_id if generation_config is not None else tokenizer.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])
    limit = getattr(model_config, "max_position_embeddings", None)

    encoded = [chat_prompt_ids(tokenizer, p) for p in prompts]
    cap = config.max_prompt_tokens
    wanted = [i for i, ids in enumerate(encoded) if cap is None or len(ids) <= cap]
    if not wanted:
        raise ValueError(f"all {len(prompts)} prompts are longer than max_prompt_tokens={cap}")
    if limit is not None:
        too_long = [i for i in wanted if len(encoded[i]) + config.max_new_tokens > limit]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompts (first: #{too_long[0]}) plus max_new_tokens={config.max_new_tokens} exceed "
                f"the target's context of {limit} tokens; shorten them or lower max_new_tokens."
            )
    if finish_partial:
        generate = None
    elif backend == "vllm":
        longest = max(len(encoded[i]) for i in wanted) + config.max_new_tokens
        penalty = getattr(generation_config, "repetition_penalty", None) or 1.0
        generate = vllm_backend(target, config, eos_ids, longest, penalty)
    else:
        generate = transformers_backend(target, pad_id, config)
    out.mkdir(parents=True, exist_ok=True)
    _check_request(out, {"backend": backend, "target": name, **settings})
    done = _read_done(out / RECORDS, encoded)
    if finish_partial and not done:
        raise ValueError(f"{out} holds no answered prompt of this run: nothing to finish")
    if resume_partial:
        (out / META).unlink()  # an unfinished run again until every prompt is done, so nothing trains on it meanwhile
    # Similar lengths in a batch waste less compute on padding; the order is deterministic so resume is exact.
    todo = [] if finish_partial else sorted((i for i in wanted if i not in done), key=lambda i: (len(encoded[i]), i))
    empty = 0
    with open(out / RECORDS, "a", encoding="utf-8") as f, tqdm(total=len(wanted), initial=len(done)) as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            # Seeded by the batch's first prompt, not once per run: a resumed run draws what the uninterrupted one
            # would have, instead of replaying the first batch's random stream for other prompts.
            torch.manual_seed(config.seed * 1_000_003 + batch[0])
            gen = generate([encoded[i] for i in batch])
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
            "target": target if isinstance(target, str) else getattr(model_config, "name_or_path", ""),
            "tokenizer_fingerprint": fingerprint_of(tokenizer) if hasattr(tokenizer, "get_vocab") else None,
            "backend": backend,
            "source": source,
            "num_prompts": len(prompts),
            "num_records": n,
            "num_response_tokens": tokens,
            "partial": len(done) < len(wanted) and finish_partial,
            # a partial run cannot tell a prompt whose answer was empty from one it never reached
            "skipped_empty": None if finish_partial else sum(i not in covered for i in wanted),
            "skipped_long": len(prompts) - len(wanted),
            **asdict(config),
            **({"dtype": settings["dtype"]} if "dtype" in settings else {}),
            # provenance only: kernels differ by device, so a resumed run's answers may come from two of them
            **({} if isinstance(target, str) else {"device": str(target.device)}),
        },
    )
    return out
