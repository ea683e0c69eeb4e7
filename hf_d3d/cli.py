"""``hf-d3d`` command line: distill, train, and the rest of the pipeline, each a thin wrapper over the library."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path


def _sliced(source: str, skip: int, count: int) -> str:
    """``source`` as a row or a folder names it: with the prompts' slice when the first ones were skipped."""
    return f"{source}[{skip}:{skip + count}]" if skip else source


def _cmd_distill(args: argparse.Namespace) -> None:
    import torch

    from hf_d3d.prompts import load_prompts, without_heldout_variants
    from hf_d3d.train.distill import DistillConfig, distill

    prompts = load_prompts(args.prompts, args.field, args.num_prompts, skip=args.skip_prompts)
    # The slice is part of the source, so two folders from one prompt set say which prompts each holds.
    source = args.source_name or _sliced(args.prompts, args.skip_prompts, len(prompts))
    if args.prompts in ("sharegpt:train", "sharegpt:code"):
        prompts, near = without_heldout_variants(prompts)
        if near:
            print(f"{near} prompts that differ from a held-aside one only in case, spacing or punctuation left out")
    if args.backend == "vllm" and (args.device not in ("auto", "cuda") or args.device_map):
        raise ValueError("--device and --device-map apply to the transformers backend; vLLM places the model itself")
    if args.backend == "vllm":  # vLLM loads the weights itself; only the tokenizer is needed here
        from transformers import AutoTokenizer

        from hf_d3d.targets import resolve_target

        target = resolve_target(args.target)
        tokenizer = AutoTokenizer.from_pretrained(target)
    else:
        target, tokenizer, _ = _load_placed_target(args, getattr(torch, args.dtype))
    cfg = DistillConfig(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.do_sample,
        temperature=args.temperature,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    out = distill(
        target,
        tokenizer,
        prompts,
        args.out,
        cfg,
        source=source,
        backend=args.backend,
        finish_partial=args.finish_partial,
    )
    meta = json.loads((out / "meta.json").read_text())
    wanted = meta["num_prompts"] - (meta.get("skipped_long") or 0)
    part = f" (partial: {meta['num_records']} of {wanted} prompts)" if meta.get("partial") else ""
    if meta.get("skipped_long"):
        part += f"; {meta['skipped_long']} prompts over --max-prompt-tokens left out"
    print(f"distillation data ready in {out}{part}")


def _cmd_pack_data(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from hf_d3d.targets import resolve_target
    from hf_d3d.train.distill import META, pack_run

    names = [Path(folder).name for folder in args.data]
    if len(set(names)) < len(names):  # one would overwrite the other: a file is named after its run's folder
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"two runs named {', '.join(twice)}: each packs to <out-dir>/<run name>.safetensors")
    there = [n for n in names if (Path(args.out_dir) / f"{n}.safetensors").exists()]
    if there and not args.overwrite:  # a committed token file is training data: replace it only when told to
        raise FileExistsError(
            f"{args.out_dir} already holds {', '.join(there)} (.safetensors); pass --overwrite to replace them"
        )
    unfinished = [f for f in args.data if not (Path(f) / META).is_file()]
    if unfinished:  # before any file is written
        raise FileNotFoundError(f"not finished distillation runs (no {META}): {', '.join(unfinished)}")
    target = resolve_target(args.target)
    # the vocabulary size is the named target's: data another model wrote would be stored against the wrong one
    for folder in args.data:
        wrote = Path(json.loads((Path(folder) / META).read_text(encoding="utf-8")).get("target") or "").name
        if wrote and wrote.lower() != Path(target).name.lower():
            raise ValueError(
                f"{folder} was distilled from {wrote!r}, not from {Path(target).name!r}: pass --target naming the "
                "model that wrote it"
            )
    vocab = AutoConfig.from_pretrained(target).get_text_config().vocab_size
    for folder in args.data:
        path = pack_run(folder, Path(args.out_dir) / f"{Path(folder).name}.safetensors", vocab)
        print(f"{folder} -> {path} ({path.stat().st_size / 1e6:.2f} MB)")


def _cmd_train(args: argparse.Namespace) -> None:
    from accelerate import DistributedType, PartialState
    from accelerate.utils import parse_flag_from_env

    from hf_d3d.checks import check_pair, tokenizer_fingerprint
    from hf_d3d.modeling.modeling_d3d import D3DDrafterModel
    from hf_d3d.prompts import load_prompts
    from hf_d3d.targets import DEFAULT_TARGET, load_drafter, load_target
    from hf_d3d.train.distill import chat_prompt_ids, load_records
    from hf_d3d.train.trainer import (
        TrainConfig,
        check_replicated,
        epochs_to_steps,
        grow_block_adapter_rank,
        train,
        widen_block_adapters,
    )

    if args.widen_block_adapters is not None and not args.init_from:
        raise ValueError("--widen-block-adapters widens the adapters of an --init-from drafter")
    if args.grow_block_adapter_rank is not None and not args.init_from:
        raise ValueError("--grow-block-adapter-rank grows the adapters of an --init-from drafter")
    from transformers import AutoTokenizer

    from hf_d3d.targets import resolve_target

    # the tokenizer alone, so that data of another one fails in seconds, before any model loads
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(resolve_target(args.target)))
    records = load_records(*args.data, target=args.target or DEFAULT_TARGET, tokenizer_fingerprint=fingerprint)
    # The settings are checked (TrainConfig) before the models load, so a bad one fails in seconds.
    # A sharded launch is refused here, before any model loads (accelerate decides FSDP only in the Accelerator).
    for sharding in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        if parse_flag_from_env(f"ACCELERATE_USE_{sharding}"):
            check_replicated(DistributedType[sharding])
    # Under `accelerate launch`, each process takes its own batches. PartialState is the one state that the trainer's
    # Accelerator reuses, so it must honour ACCELERATE_USE_CPU as Accelerator does, or a CPU launch runs unshared.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    processes = state.num_processes
    steps = args.steps
    if steps is None:
        steps = epochs_to_steps(len(records), args.epochs, args.batch_size, args.grad_accum, processes)
    autoregressive = args.objective == "ar"  # the benchmark's AR peer: next-token loss on every response token
    cfg = TrainConfig(
        max_steps=steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        num_blocks=0 if autoregressive else args.num_blocks,
        ar_weight=1.0 if autoregressive else args.ar_weight,
        max_ar_positions=None if autoregressive or not args.max_ar_positions else args.max_ar_positions,
        slot_decay=args.slot_decay,
        freeze_embeddings=not args.train_embeddings,
        freeze_layers=args.freeze_layers,
        adapters_only=args.block_adapter_rank > 0,
        draft_vocab_loss=not args.full_vocab_loss,
        kd_weight=args.kd_weight,
        kd_temperature=args.kd_temperature,
        unreached_weight=args.unreached_weight,
        mixed_precision=args.mixed_precision,
        save_dtype=args.save_dtype,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        group_by_length=args.group_by_length,
    )
    # Only the main process computes with the target (the soft-label check, the periodic eval). The others need its
    # weights only to build the drafter from them; else its config does (a Qwen3-8B target in fp32 is 32 GB a process).
    from_target_weights = not args.init_from and args.whole_lm in (None, "target")
    target, tokenizer = load_target(args.target, weights=state.is_main_process or from_target_weights)
    resuming = any(
        (Path(args.out) / name / "trainer_state.json").is_file() for name in ("checkpoint", ".checkpoint.old")
    )
    if args.init_from:
        drafter = load_drafter(args.init_from, dtype="float32")
        if args.widen_block_adapters is not None:
            added = widen_block_adapters(drafter, args.widen_block_adapters)
            print(f"block adapters added to {len(added)} layers: {added}")
        if args.grow_block_adapter_rank is not None:
            old = grow_block_adapter_rank(drafter, args.grow_block_adapter_rank)
            print(f"block adapter rank grown from {old} to {args.grow_block_adapter_rank}")
    elif args.whole_lm:
        adapters = (args.block_adapter_rank, args.block_adapter_top)
        drafter = _whole_lm_drafter(args.whole_lm, args.target, target, tokenizer, args.block_size, *adapters)
    else:
        layer_ids = [int(i) for i in args.layer_ids.split(",")] if args.layer_ids else None
        drafter = D3DDrafterModel.from_target(
            target,
            num_hidden_layers=args.layers,
            block_size=args.block_size,
            layer_ids=layer_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        )
    check_pair(target, drafter, tokenizer)
    eval_ids = None
    if args.eval_prompts and args.num_eval_prompts > 0 and not autoregressive:  # D3D tau means nothing for AR
        eval_ids = [
            chat_prompt_ids(tokenizer, p) for p in load_prompts(args.eval_prompts, args.field, args.num_eval_prompts)
        ]
    depth, block = drafter.config.num_hidden_layers, drafter.config.block_size
    print(f"training {depth}-layer drafter (block {block}) for {steps} steps" + (" (resuming)" if resuming else ""))
    final = train(
        drafter,
        records,
        args.out,
        cfg,
        target=target,
        eval_prompts=eval_ids,
        eval_max_new_tokens=args.eval_max_new_tokens,
    )
    print(f"trained drafter saved to {final}")


def _whole_lm_drafter(
    lm: str, target_id: str | None, target, tokenizer, block_size: int, adapter_rank: int = 0, adapter_top: int = 0
):
    """A drafter converted from a whole LM: ``target`` (the target itself) or a same-tokenizer LM's id or folder;
    with ``adapter_rank``, block adapters in its top ``adapter_top`` layers (all if 0). Its ``base_model`` is the
    LM's id as given (the Hub id, not the local copy it was read from)."""
    from hf_d3d.checks import tokenizer_fingerprint
    from hf_d3d.modeling.modeling_d3d import D3DDrafterModel
    from hf_d3d.targets import DEFAULT_TARGET, load_target

    if lm == "target":
        source = target
    else:
        source, lm_tokenizer = load_target(lm)
        if tokenizer_fingerprint(lm_tokenizer) != tokenizer_fingerprint(tokenizer):
            # vocab sizes can agree (Llama-2 and Mistral: 32000) while the tokens differ: drafts would be nonsense
            raise ValueError(f"{lm} has another tokenizer than the target (vocabulary fingerprint differs)")
    base = (target_id or DEFAULT_TARGET) if lm == "target" else lm
    n = source.config.get_text_config().num_hidden_layers
    adapters = {}
    if adapter_rank:
        layers = list(range(n - adapter_top, n)) if adapter_top else None
        adapters = {"block_adapter_rank": adapter_rank, "block_adapter_layers": layers}
    return D3DDrafterModel.from_pretrained_lm(
        source,
        block_size=block_size,
        target=target,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        base_model=base,
        **adapters,
    )


def _cmd_convert(args: argparse.Namespace) -> None:
    from hf_d3d.atomic import atomic_folder
    from hf_d3d.checks import check_pair
    from hf_d3d.targets import load_target

    target, tokenizer = load_target(args.target)
    drafter = _whole_lm_drafter(args.lm, args.target, target, tokenizer, args.block_size)
    check_pair(target, drafter, tokenizer)
    with atomic_folder(args.out, overwrite=True) as tmp:  # an interrupted convert leaves no half-written folder
        drafter.save_pretrained(tmp)
    n = drafter.config.num_hidden_layers
    print(f"{n}-layer drafter converted from {args.lm} (shifted slots, block {args.block_size}) saved to {args.out}")


def _shown(path: str) -> str:
    """``path`` as a command to publish should show it: the home folder as ``~``, not this machine's own."""
    home = str(Path.home())
    return "~" + path[len(home) :] if path == home or path.startswith(home + "/") else path


def _cmd_bench(args: argparse.Namespace) -> None:
    from hf_d3d.bench import ALL_METHODS, output_paths, run_bench, write_outputs
    from hf_d3d.checks import check_pair
    from hf_d3d.cpu.fp16_weights import fp16_weights, fp16_weights_supported
    from hf_d3d.prompts import load_prompts
    from hf_d3d.targets import DEFAULT_TARGET, load_drafter
    from hf_d3d.train.distill import chat_prompt_ids

    output_paths(args.out)  # a bad --out fails now, not after the run
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {ALL_METHODS}")
    if args.write_metrics:  # refuse before the run, not after it
        if "d3d_hub" not in methods:  # the card's usage code is that path: its number is the card's
            raise ValueError(
                "--write-metrics records d3d_hub's speedup (the card's usage): include d3d_hub in --methods"
            )
        if args.drafter and not Path(args.drafter).is_dir():
            raise ValueError(f"--write-metrics needs a local drafter folder, not {args.drafter!r}")
        if args.dtype != "float32" or args.exact:
            raise ValueError("--write-metrics records the card's fp32 speedup; leave out --dtype and --exact")
    measured = _weights_before(args) if args.write_metrics else None
    # a mixed set: --num-prompts from each comma-separated source
    prompts = [p for source in args.prompts.split(",") for p in load_prompts(source, args.field, args.num_prompts)]
    import torch

    target, tokenizer, device = _load_placed_target(args, getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, dtype=getattr(torch, args.drafter_dtype, "auto"), device=device)
    check_pair(target, drafter, tokenizer)
    fp16w = fp16_weights_supported(drafter) and not args.no_fp16_weights
    ar = None
    if "assisted_ar" in methods:
        if not args.ar_drafter:
            raise ValueError("assisted_ar needs --ar-drafter (an autoregressive drafter trained on the same data)")
        from transformers import AutoModelForCausalLM

        # the peer gets the D3D drafter's compute type and weight storage: only the drafting method differs
        ar = AutoModelForCausalLM.from_pretrained(args.ar_drafter, dtype=drafter.dtype).to(device).eval()
        if fp16w:
            fp16_weights(ar)
    if fp16w:
        fp16_weights(drafter)
    hub = None
    if "d3d_hub" in methods:
        from transformers import AutoModelForCausalLM

        from hf_d3d.targets import DEFAULT_DRAFTER, resolve_target

        # as a user's code loads it: remote code, its own dtype choice; the base LM (if the drafter stores none)
        # from the same local copy the target came from, where the Hub would serve it to a user
        path = args.drafter or DEFAULT_DRAFTER
        base = drafter.config.base_model
        local = {"base_model": resolve_target(base)} if base and resolve_target(base) != base else {}
        hub = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **local).to(device).eval()
    ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    if args.exact:
        from hf_d3d.exact import rows_match_decode

        if not rows_match_decode(target):
            raise ValueError(
                "--exact: on this machine and dtype a verify forward does not give each row a decode step's bits "
                "(hf_d3d.exact.rows_match_decode), so exact verification cannot hold here"
            )
    result = run_bench(
        target,
        drafter,
        ids,
        methods,
        args.max_new_tokens,
        ar_drafter=ar,
        exact=args.exact,
        skinny=False if args.no_skinny else None,
        hub_drafter=hub,
    )
    result["command"] = (
        "hf-d3d bench"
        + (f" --drafter {_shown(args.drafter)}" if args.drafter else "")
        + (f" --target {_shown(args.target)}" if args.target else "")
        + (f" --ar-drafter {_shown(args.ar_drafter)}" if args.ar_drafter else "")
        + f" --prompts {args.prompts}"
        + (f" --field {args.field}" if args.field != "question" else "")
        + f" --num-prompts {args.num_prompts} --max-new-tokens {args.max_new_tokens}"
        + f" --methods {','.join(methods)} --out {args.out}"
        + (" --no-skinny" if args.no_skinny else "")
        + (" --no-fp16-weights" if args.no_fp16_weights else "")
        + (f" --drafter-dtype {args.drafter_dtype}" if args.drafter_dtype != "auto" else "")
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
        + (" --exact" if args.exact else "")
        + _device_flag(device, args.device_map)
    )
    result["drafter_dtype"] = str(drafter.dtype).removeprefix("torch.")
    result["drafter_fp16_weights"] = fp16w
    result["target_dtype"], result["exact"] = args.dtype, args.exact
    result["prompts"] = args.prompts
    paths = write_outputs(result, args.out)
    print(Path(paths[1]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    if not result["all_identical"]:
        raise SystemExit("FAILED: a method's greedy output differs from plain generate")
    if args.write_metrics and "d3d_hub" in result["methods"]:
        # The card's speedup is what its usage code runs: the drafter as from_pretrained(trust_remote_code=True)
        # loads it, in target.generate(assistant_model=drafter), no library call (not d3d_sync's library settings).
        hub = result["methods"]["d3d_hub"]
        row = {"dataset": args.prompts, "num_prompts": len(ids), "max_new_tokens": args.max_new_tokens}
        row |= {"tau": hub["tau"], "command": result["command"]}
        on_cpu = device.type == "cpu"
        where = cpu_setting() if on_cpu else str(device)
        where += f", the target spread by device_map {args.device_map}" if args.device_map else ""
        where += ", `target.generate(assistant_model=drafter)` as the card loads it"
        speed = {"speedup": hub["speedup"], "speedup_command": result["command"], "speedup_setting": where}
        path = _update_metrics(args.drafter, row, speed, target=args.target or DEFAULT_TARGET, measured=measured)
        print(f"updated {path}")


def cpu_setting() -> str:
    """The CPU a speedup was measured on, as a card names it. Whether it multiplies bf16 in hardware is said apart
    from the kernels' instruction set: "AVX512" covers both kinds of x86, and a bf16 drafter's speed differs most
    between them."""
    import torch

    from hf_d3d.modeling.modeling_d3d import cpu_computes_bf16

    bf16 = "bf16 in hardware" if cpu_computes_bf16() else "bf16 emulated"
    return f"CPU with {torch.backends.cpu.get_cpu_capability()} kernels ({bf16}), {torch.get_num_threads()} threads"


def _weights_before(args: argparse.Namespace) -> str | None:
    """The SHA-256 of the drafter's weights as a measurement starts, which its rows record."""
    from hf_d3d.publish import weights_sha256
    from hf_d3d.targets import DEFAULT_DRAFTER

    return weights_sha256(args.drafter or DEFAULT_DRAFTER)


def _update_metrics(
    drafter: str | None,
    row: dict,
    always: dict | None = None,
    target: str | None = None,
    measured: str | None = None,
) -> Path:
    """Merge ``row`` into DRAFTER/d3d_metrics.json by dataset. Every row records the SHA-256 of the weights it
    measured (``measured``, taken as the measurement started; refused if the file changed since). A known dataset
    measured on the same weights keeps its tau and takes ``always`` (the bench's speedup), or, with no ``always``,
    takes ``row`` and keeps its speedup; measured on other weights, it is replaced whole. ``target``: the model the
    rows were measured on, which the card names as the drafter's ``base_model`` (a drafter converted from a sibling
    LM names that LM in its config)."""
    from filelock import FileLock

    from hf_d3d.atomic import write_json_atomic
    from hf_d3d.publish import weights_sha256
    from hf_d3d.targets import DEFAULT_DRAFTER

    folder = Path(drafter or DEFAULT_DRAFTER)
    path = folder / "d3d_metrics.json"
    # two measurements of one drafter (the docs run two at once) must not drop each other's rows
    with FileLock(str(path.with_name(f".{path.name}.lock"))):
        sha = weights_sha256(folder)
        if measured is not None and sha != measured:
            raise ValueError(
                f"{folder}/model.safetensors changed while it was measured (a save into the folder): "
                "the rows are not written; measure it again"
            )
        row = {**row, **(always or {}), "weights_sha256": sha}
        old = json.loads(path.read_text()) if path.is_file() else {}
        if target is not None:
            old["base_model"] = target
        rows = old.get("rows", [])
        known = next((r for r in rows if r["dataset"] == row["dataset"]), None)
        same = known is not None and sha is not None and known.get("weights_sha256") == sha
        if same and always is not None:
            known.update(always)
        else:
            speed = {k: v for k, v in known.items() if k.startswith("speedup")} if same else {}
            rows = [r for r in rows if r["dataset"] != row["dataset"]] + [{**row, **speed}]
        write_json_atomic(path, {**old, "rows": rows})
    return path


def _cmd_demo(args: argparse.Namespace) -> None:
    from hf_d3d.checks import check_pair
    from hf_d3d.demo import no_outside_requests, report, run_demo
    from hf_d3d.targets import load_drafter, load_target

    no_outside_requests()

    print(f"loading target {args.target or 'HuggingFaceTB/SmolLM2-135M-Instruct (embedded)'} ...", flush=True)
    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, fp16_weights=True)
    check_pair(target, drafter, tokenizer)
    print(f"prompt: {args.prompt}\n--- D3D answer (streamed) ---", flush=True)
    result = run_demo(target, drafter, tokenizer, args.prompt, args.max_new_tokens)
    print("--- comparison ---")
    print(report(result))
    if not result.identical:
        raise SystemExit("FAILED: D3D output differs from plain generate")


def _cmd_eval_tau(args: argparse.Namespace) -> None:
    import torch

    from hf_d3d.checks import check_pair
    from hf_d3d.evaluate import measure_tau
    from hf_d3d.prompts import load_prompts
    from hf_d3d.targets import DEFAULT_TARGET, load_drafter
    from hf_d3d.train.distill import chat_prompt_ids

    if args.write_metrics and args.drafter and not Path(args.drafter).is_dir():  # before the run, not after it
        raise ValueError(f"--write-metrics needs a local drafter folder, not {args.drafter!r}")
    measured = _weights_before(args) if args.write_metrics else None
    target, tokenizer, device = _load_placed_target(args, torch.float32)
    drafter = load_drafter(args.drafter, dtype=getattr(torch, args.drafter_dtype, "auto"), device=device)
    check_pair(target, drafter, tokenizer)
    if args.async_drafting:  # otherwise the drafter's own setting (sync unless its config asks for async)
        drafter.config.async_drafting = True
    if args.num_hypotheses:
        drafter.config.num_hypotheses = args.num_hypotheses
    mode = f" --async --num-hypotheses {drafter.config.num_hypotheses}" if args.async_drafting else ""
    mode += _device_flag(device, args.device_map)
    if args.drafter_dtype != "auto":  # tau moves by a few hundredths between bf16 and fp32 drafters
        mode += f" --drafter-dtype {args.drafter_dtype}"
    if args.fixed_length:  # the drafter's quality at num_assistant_tokens per round, whatever a round costs here
        drafter.config.round_cost = None
        mode += " --fixed-length"
    label = f" (async, {drafter.config.num_hypotheses} hypotheses)" if args.async_drafting else ""
    if args.drafter_dtype != "auto":  # a row of its own: the card's rows are the drafter as it loads
        label += f" ({args.drafter_dtype})"
    if args.fixed_length:
        label += f" ({drafter.generation_config.num_assistant_tokens} tokens every round)"
    rows = []
    for source in args.prompts.split(","):
        prompts = load_prompts(source, args.field, args.num_prompts, skip=args.skip_prompts)
        ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
        res = measure_tau(target, drafter, ids, args.max_new_tokens, progress=True)
        skip = f" --skip-prompts {args.skip_prompts}" if args.skip_prompts else ""
        # a bf16 drafter's tau on a CPU moves with the thread count (other sums, other near-ties)
        threads = f"OMP_NUM_THREADS={torch.get_num_threads()} " if device.type == "cpu" else ""
        named = f" --target {_shown(args.target)}" if args.target else ""
        command = (
            f"{threads}hf-d3d eval-tau{named} --drafter {_shown(args.drafter)} --prompts {source} "
            f"--num-prompts {args.num_prompts}{skip} --max-new-tokens {args.max_new_tokens}{mode}"
        )
        rows.append(
            {
                "dataset": _sliced(source, args.skip_prompts, len(ids)) + label,
                "num_prompts": len(ids),
                "max_new_tokens": args.max_new_tokens,
                **res,
                "drafter_dtype": str(drafter.dtype).removeprefix("torch."),
                "command": command,
            }
        )
        hit = f", hit rate {res['hit_rate']:.1%}" if res["hit_rate"] is not None else ""
        print(f"{rows[-1]['dataset']}: tau {res['tau']:.3f} over {len(ids)} prompts ({res['new_tokens']} tokens){hit}")
    if args.write_metrics:
        for row in rows:
            path = _update_metrics(args.drafter, row, target=args.target or DEFAULT_TARGET, measured=measured)
        print(f"updated {path}")


def _cmd_prune(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from hf_d3d.checks import check_pair, tokenizer_fingerprint
    from hf_d3d.prompts import load_prompts
    from hf_d3d.prune import judge_answers, make_healer, prune, teacher_forced_judge
    from hf_d3d.targets import DEFAULT_TARGET, load_drafter, load_target, resolve_target
    from hf_d3d.train.distill import chat_prompt_ids, load_records
    from hf_d3d.train.trainer import TrainConfig

    if bool(args.heal_data) != bool(args.heal_steps):
        raise SystemExit("--heal-steps and --heal-data go together (the fine-tune needs both its length and its data)")
    data_for = args.target or DEFAULT_TARGET  # the model any distilled data given must come from
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(resolve_target(args.target)))
    heal, heal_records = None, None
    if args.heal_steps:
        heal_config = TrainConfig(
            max_steps=args.heal_steps,
            batch_size=args.heal_batch_size,
            lr=args.heal_lr,
            warmup_steps=min(20, args.heal_steps // 10),
            mixed_precision=args.mixed_precision,
            save_every=100,
        )
        heal_records = load_records(*args.heal_data, target=data_for, tokenizer_fingerprint=fingerprint)
        heal = make_healer(heal_records, Path(args.out), heal_config)
    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter)
    check_pair(target, drafter, tokenizer)
    judge, ids = None, []
    if args.judge_data:  # rank layers by teacher-forced tau on the target's answers (no target forwards)
        records = load_records(*args.judge_data, target=data_for, tokenizer_fingerprint=fingerprint)
        judge = teacher_forced_judge(judge_answers(records, args.judge_records))
    else:
        ids = [chat_prompt_ids(tokenizer, p) for p in load_prompts(args.prompts, args.field, args.num_prompts)]
    holdout = None
    if args.holdout_prompts:
        holdout = [
            chat_prompt_ids(tokenizer, p)
            for source in args.holdout_prompts.split(",")
            for p in load_prompts(source, args.field, args.num_holdout_prompts)
        ]
        # the judge's and the heal's data are calibration too: their prompts would flatter the held-out tau
        seen = {tuple(r["prompt_ids"]) for r in (records if args.judge_data else []) + (heal_records or [])}
        if any(tuple(h) in seen for h in holdout):
            raise ValueError(
                "some --holdout-prompts are prompts of --judge-data or --heal-data: hold out prompts the pruning "
                "never sees (e.g. gsm8k:test, humaneval, sharegpt:heldout)"
            )
    report = prune(
        target, drafter, ids, args.out, args.retention, args.target_depth, args.max_new_tokens, heal, judge, holdout
    )
    held = report.get("holdout")
    print(
        f"{report['final_layers']} layers kept (removed {report['removed_layers']}): "
        f"tau {report['base_tau']:.3f} -> {report['final_tau']:.3f} on the data that chose them"
        + (
            f", {held['tau_before']:.3f} -> {held['tau_after']:.3f} on {held['prompts']} held-out prompts"
            if held
            else " (no --holdout-prompts: nothing measured on prompts the pruning did not see)"
        )
        + f"; checkpoint in {Path(args.out) / 'model'}"
    )


def _cmd_grow(args: argparse.Namespace) -> None:
    from hf_d3d.atomic import atomic_folder
    from hf_d3d.checks import check_pair
    from hf_d3d.prune import insert_layers
    from hf_d3d.targets import load_drafter, load_target

    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter)
    check_pair(target, drafter, tokenizer)
    grown = insert_layers(drafter, target, [int(i) for i in args.insert_target_layers.split(",")])
    with atomic_folder(Path(args.out)) as tmp:
        grown.save_pretrained(tmp)
    layers = grown.config.target_layer_ids
    print(f"{len(layers)}-layer drafter (target layers {layers}) written to {args.out}")


def _cmd_draft_vocab(args: argparse.Namespace) -> None:
    from hf_d3d.draft_vocab import write_with_draft_vocab
    from hf_d3d.train.distill import load_records

    coverage = write_with_draft_vocab(args.drafter, load_records(*args.data), args.size, args.out)
    print(f"drafter with a {args.size}-token draft vocabulary written to {args.out}")
    print(f"it covers {coverage:.2%} of the response tokens in {', '.join(args.data)}")


def _cmd_export_ar(args: argparse.Namespace) -> None:
    from hf_d3d.export_ar import write_autoregressive

    print(f"autoregressive drafter written to {write_autoregressive(args.drafter, args.out)}")


def _cmd_calibrate(args: argparse.Namespace) -> None:
    import torch

    from hf_d3d.calibrate import measure_round_cost, write_round_cost
    from hf_d3d.checks import check_pair
    from hf_d3d.cpu.fp16_weights import fp16_weights, fp16_weights_supported
    from hf_d3d.cpu.skinny import skinny_by_default
    from hf_d3d.exact import exact_verification
    from hf_d3d.modeling.generation_d3d import cpu_kind, round_cost_key
    from hf_d3d.targets import DEFAULT_DRAFTER, load_drafter

    if args.write and not (Path(args.drafter or DEFAULT_DRAFTER) / "config.json").is_file():  # before measuring
        raise FileNotFoundError(f"--write records in a drafter folder's config.json; {args.drafter!r} is not one")
    if args.write and args.device_map:  # its costs would be read back by every run on one device of that kind
        raise ValueError("--write records a round cost per device kind; a target spread by --device-map has its own")
    target, _, device = _load_placed_target(args, getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, device=device)
    check_pair(target, drafter)
    skinny = skinny_by_default(target) and not args.exact and not args.no_skinny
    fp16w = fp16_weights_supported(drafter) and not args.no_fp16_weights
    if fp16w:
        fp16_weights(drafter)
    with exact_verification(target) if args.exact else contextlib.nullcontext():
        costs = measure_round_cost(
            target, drafter, context_length=args.context_length, repeats=args.repeats, skinny=skinny
        )
    machine = cpu_kind() if device.type == "cpu" else None
    key = round_cost_key(device.type, target.dtype, machine, skinny, fp16w)
    print(f"round cost for {key}, in target decode steps, for k = 1..{len(costs)} draft tokens:")
    print("  " + "  ".join(f"{k}: {c:.2f}" for k, c in enumerate(costs, 1)))
    if args.write:
        print(f"recorded in {write_round_cost(args.drafter or DEFAULT_DRAFTER, key, costs)}")


def _cmd_publish(args: argparse.Namespace) -> None:
    from hf_d3d.publish import assemble, publish

    folder = assemble(
        args.checkpoint,
        args.folder or Path(args.checkpoint).with_name(Path(args.checkpoint).name + "-hub"),
        args.repo_id,
    )
    print(f"Hub folder written to {folder}: {sorted(p.name for p in folder.iterdir())}")
    if args.dry_run:
        return
    print(f"uploaded: {publish(folder, args.repo_id, private=args.private, force=args.force)}")


def _add_dtype(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help=help)


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="auto", help="where the models run: auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )
    p.add_argument(
        "--device-map",
        choices=["auto", "balanced", "balanced_low_0", "sequential"],
        default=None,
        help="spread a target too large for one GPU over the GPUs and CPU memory, as from_pretrained(device_map=...) "
        "does with accelerate; the drafter runs where the target's embeddings do (instead of --device)",
    )


def _device(name: str):
    """``--device``: "auto" is the GPU where there is one, as a user with one expects; a missing GPU is an error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device torch knows (cpu, cuda, cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def _device_flag(device, device_map: str | None = None) -> str:
    """The ``--device`` (or ``--device-map``) a recorded command needs to run where this one ran (none on a CPU)."""
    if device_map:
        return f" --device-map {device_map}"
    return "" if device.type == "cpu" else f" --device {device}"


def _load_placed_target(args: argparse.Namespace, dtype):
    """The target where ``--device`` or ``--device-map`` puts it, its tokenizer, and the device its embeddings run
    on, where its inputs and the drafter go."""
    import torch

    from hf_d3d.targets import load_target

    if not args.device_map:
        device = _device(args.device)
        return (*load_target(args.target, dtype=dtype, device=device), device)
    if args.device != "auto":
        raise ValueError("--device-map places the target (and the drafter beside its embeddings); leave out --device")
    target, tokenizer = load_target(args.target, dtype=dtype, device_map=args.device_map)
    embed = target.get_input_embeddings()
    # an offloaded module's weights are on "meta"; accelerate's hook says where it computes
    device = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
    device = torch.device(embed.weight.device if device is None else device)
    return target, tokenizer, torch.device("cpu") if device.type == "meta" else device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-d3d", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("distill", help="the target's own responses to prompts, as token ids (resumable)")
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--prompts",
        required=True,
        help="gsm8k:train, gsm8k:test, humaneval, sharegpt (or its splits sharegpt:train, sharegpt:code, "
        "sharegpt:heldout) or a JSONL path; answers to gsm8k:test, humaneval, sharegpt and sharegpt:heldout are "
        "evaluation data that train refuses, and sharegpt:train/code slices leave out variants of held-aside prompts",
    )
    p.add_argument("--field", default="question", help="JSONL field holding the prompt")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--skip-prompts", type=int, default=0, help="start after this many prompts (to extend a dataset)")
    p.add_argument(
        "--source-name",
        default=None,
        help="what the records name as their prompts' source (default: --prompts, with its slice); for a JSONL "
        "extract of a named set, e.g. sharegpt:train[5200:11200], so that its provenance and licence are kept",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="leave out prompts longer than this (chat-templated tokens); they are counted in meta.json",
    )
    p.add_argument(
        "--backend",
        default="transformers",
        choices=["transformers", "vllm"],
        help="vllm: its offline engine for large targets on GPUs (when installed); use a large --batch-size",
    )
    _add_dtype(
        p,
        "the target's compute type (transformers backend); bfloat16 halved the time on this project's CPU, and "
        "its greedy answers are then the bf16 target's own, recorded in request.json and meta.json",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--finish-partial",
        action="store_true",
        help="generate nothing more: finish an interrupted run (same arguments) with the prompts answered so far "
        "(its meta.json says partial), so that it can be trained on",
    )
    _add_device(p)
    p.set_defaults(func=_cmd_distill)

    p = sub.add_parser(
        "train", help="train a D3D drafter on distillation data (resumable; works under accelerate launch)"
    )
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="finished `hf-d3d distill` folders or token files from `hf-d3d pack-data` (repeats dropped; data "
        "distilled from an evaluation set is refused)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--init-from", default=None, help="start from this drafter instead of copying target layers")
    p.add_argument(
        "--whole-lm",
        default=None,
        help="start from a whole pretrained LM converted to a drafter: 'target' (the target itself) or a "
        "same-tokenizer LM's Hub id or folder (e.g. Qwen/Qwen3-1.7B for a Qwen3-8B target)",
    )
    p.add_argument(
        "--block-adapter-rank",
        type=int,
        default=0,
        help="with --whole-lm: give block tokens low-rank adapters of this rank and train those alone (the LM's own "
        "computation, and so its next-token predictions, stay exact); with --init-from, any value > 0 trains the "
        "drafter's own adapters alone, at their own rank",
    )
    p.add_argument("--block-adapter-top", type=int, default=0, help="adapters in the top N layers only (0: all)")
    p.add_argument(
        "--widen-block-adapters",
        type=int,
        default=None,
        metavar="TOP",
        help="with --init-from: give the top TOP layers (0: all) zero-initialised block adapters where they have "
        "none, so training continues with more of them",
    )
    p.add_argument(
        "--grow-block-adapter-rank",
        type=int,
        default=None,
        metavar="RANK",
        help="with --init-from: raise every block adapter to this rank, the added part starting at zero effect, so "
        "training continues with more capacity (a resume passes it again)",
    )
    p.add_argument(
        "--freeze-layers",
        type=int,
        default=0,
        help="freeze the lowest N drafter layers, the embeddings and the mask vector (backward stops at layer N)",
    )
    p.add_argument("--layers", type=int, default=4, help="drafter depth when copying target layers")
    p.add_argument("--layer-ids", default=None, help="comma-separated target layers to copy (overrides --layers)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=4, help="mask blocks per sequence per step")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--ar-weight", type=float, default=0.5)
    p.add_argument(
        "--objective",
        default="d3d",
        choices=["d3d", "ar"],
        help="d3d: denoising + auxiliary next-token loss; ar: next-token loss only (then `hf-d3d export-ar`)",
    )
    p.add_argument(
        "--max-ar-positions",
        type=int,
        default=64,
        help="response positions per sequence that carry the auxiliary next-token loss (0: all of them; a whole-LM "
        "drafter keeps its next-token predictions, which its first slot reads, with more). Unused with "
        "--block-adapter-rank: the context is then the frozen LM's, whose next-token loss has no gradient",
    )
    p.add_argument("--slot-decay", type=float, default=0.8)
    p.add_argument(
        "--unreached-weight",
        type=float,
        default=1.0,
        help="weight of a slot behind a wrongly drafted one in its block, which greedy verification never reads "
        "(1: every slot by --slot-decay alone; 0: only the slots verification would read)",
    )
    p.add_argument(
        "--train-embeddings", action="store_true", help="also train embeddings / LM head (frozen by default)"
    )
    p.add_argument(
        "--full-vocab-loss",
        action="store_true",
        help="train over the full vocabulary even when the drafter has a draft vocabulary (the default trains the "
        "softmax it proposes from)",
    )
    p.add_argument(
        "--kd-weight",
        type=float,
        default=0.0,
        help="with --block-adapter-rank on a drafter built on the target itself: each slot also learns the target's "
        "next-token distribution (KL, this weight), read off the frozen context rows of the same forward",
    )
    p.add_argument("--kd-temperature", type=float, default=1.0, help="softmax temperature of --kd-weight's KL")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument(
        "--save-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the final weights (bfloat16 halves a drafter to publish; checkpoints stay fp32)",
    )
    p.add_argument("--eval-prompts", default="gsm8k:test")
    p.add_argument("--field", default="question")
    p.add_argument("--num-eval-prompts", type=int, default=8)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--group-by-length",
        action="store_true",
        help="batch records of similar length (less padding per step; transformers' length-grouped order)",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("bench", help="tau and speedup of every method side by side (one run, alternating, medians)")
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="Hub id or folder (default: the committed SmolLM2 drafter)")
    p.add_argument("--ar-drafter", default=None, help="autoregressive drafter for the assisted_ar peer")
    p.add_argument(
        "--drafter-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="compute type of both drafters (auto: as stored, bf16 for ours; fp32 on a CPU without bf16 units)",
    )
    _add_dtype(p, "the target's compute type (plain generate runs in it too)")
    _add_device(p)
    p.add_argument(
        "--exact",
        action="store_true",
        help="run every method but plain and d3d_hub under hf_d3d.exact_verification (bit-exact verification in "
        "bf16/fp16); d3d_fused is refused with it",
    )
    p.add_argument(
        "--no-skinny",
        action="store_true",
        help="keep F.linear for few-row forwards (default on fp32 CPU targets: every method but plain computes "
        "them as hf_d3d.skinny_linears does)",
    )
    p.add_argument(
        "--no-fp16-weights",
        action="store_true",
        help="keep both drafters' linear weights in fp32 (default for fp32 drafters on x86 CPUs: stored in fp16 "
        "and multiplied in fp32, hf_d3d.fp16_weights)",
    )
    p.add_argument(
        "--prompts", default="gsm8k:test", help="comma-separated sources (a mixed set: --num-prompts from each)"
    )
    p.add_argument("--field", default="question")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--methods",
        default="plain,prompt_lookup,d3d_sync,d3d_async,d3d_fast",
        help="comma-separated, from plain, assisted_ar, prompt_lookup, d3d_hub (the Hub user's path), d3d_sync, "
        "d3d_async, d3d_fast (the fast loop, draft trees when greedy), d3d_fast_chain (the fast loop, chains only), "
        "d3d_fused (one target forward per round; a drafter that is its target plus block adapters; not with --exact)",
    )
    p.add_argument("--out", required=True, help="RESULT.json (a .md table and a .png plot are written beside it)")
    p.add_argument(
        "--write-metrics",
        action="store_true",
        help="record d3d_hub's speedup (the card's usage code) in DRAFTER/d3d_metrics.json (card)",
    )
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("eval-tau", help="measure a drafter's tau (greedy) on prompt sets")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default="gsm8k:test,humaneval", help="comma-separated prompt sources")
    p.add_argument("--field", default="question")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--skip-prompts", type=int, default=0, help="start after this many prompts of each set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--write-metrics", action="store_true", help="record the rows in DRAFTER/d3d_metrics.json")
    p.add_argument(
        "--drafter-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the drafter's compute type (auto: as stored, bf16 for ours; fp32 on a CPU without bf16 units)",
    )
    _add_device(p)
    p.add_argument(
        "--async", dest="async_drafting", action="store_true", help="async packed drafting (reports the hit rate)"
    )
    p.add_argument("--num-hypotheses", type=int, default=None, help="outcomes per packed pass (async)")
    p.add_argument(
        "--fixed-length",
        action="store_true",
        help="propose num_assistant_tokens every round, ignoring the measured round cost (the drafter's own quality)",
    )
    p.set_defaults(func=_cmd_eval_tau)

    p = sub.add_parser("prune", help="progressive layer pruning by acceptance length (resumable)")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default="gsm8k:train")
    p.add_argument("--field", default="question")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--judge-data",
        nargs="+",
        default=None,
        help="judge layers by teacher-forced tau on these distillation folders / token files instead of running "
        "generate on --prompts (no target forwards: affordable for a whole-LM drafter on a CPU)",
    )
    p.add_argument("--judge-records", type=int, default=16, help="answers (evenly spread) the offline judge uses")
    p.add_argument(
        "--holdout-prompts",
        default=None,
        help="comma-separated prompt sources the pruning never sees; the report measures tau on them before/after",
    )
    p.add_argument("--num-holdout-prompts", type=int, default=8, help="prompts per holdout source")
    p.add_argument("--retention", type=float, default=0.99)
    p.add_argument(
        "--target-depth", type=int, default=None, help="prune to this many layers, whatever tau (overrides --retention)"
    )
    p.add_argument("--heal-steps", type=int, default=0, help="fine-tune steps after each removal (0: no healing)")
    p.add_argument(
        "--heal-data", nargs="+", default=None, help="finished `hf-d3d distill` folders or token files to heal on"
    )
    p.add_argument("--heal-lr", type=float, default=1e-4)
    p.add_argument("--heal-batch-size", type=int, default=8)
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="compute type of the heal")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_prune)

    p = sub.add_parser("grow", help="add target layers to a trained drafter as identities (then train, then prune)")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", required=True)
    p.add_argument("--insert-target-layers", required=True, help="comma-separated target layers to add, e.g. 5,14,24")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_grow)

    p = sub.add_parser(
        "draft-vocab", help="copy a drafter so it proposes only the most frequent tokens (cheaper LM head; lossless)"
    )
    p.add_argument("--drafter", required=True)
    p.add_argument(
        "--data", required=True, nargs="+", help="finished `hf-d3d distill` folders or token files to count tokens in"
    )
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_draft_vocab)

    p = sub.add_parser(
        "pack-data", help="store finished distillation folders as compact token files (uint16 ids, provenance)"
    )
    p.add_argument(
        "--target",
        default=None,
        help="the target they were distilled from, for its vocabulary size (default: the embedded "
        "SmolLM2-135M-Instruct); a folder whose meta.json names another target is refused",
    )
    p.add_argument("--data", required=True, nargs="+", help="finished `hf-d3d distill` folders")
    p.add_argument("--out-dir", required=True, help="one FOLDER_NAME.safetensors per folder is written here")
    p.add_argument("--overwrite", action="store_true", help="replace token files of the same names")
    p.set_defaults(func=_cmd_pack_data)

    p = sub.add_parser(
        "convert", help="convert a whole pretrained LM (the target, or a same-tokenizer sibling) into a D3D drafter"
    )
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--lm", default="target", help="'target' or a same-tokenizer LM's Hub id or folder (tokenizers compared)"
    )
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "export-ar", help="save a drafter as a plain causal LM of the target family (the benchmark's AR peer)"
    )
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_export_ar)

    p = sub.add_parser(
        "calibrate", help="measure the cost of a round per draft length on this machine (sets the draft length)"
    )
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the committed SmolLM2 drafter)")
    _add_device(p)
    _add_dtype(p, "the target's compute type; costs are recorded per device and dtype")
    p.add_argument(
        "--exact",
        action="store_true",
        help="time verification as hf_d3d.exact_verification runs it (the costs are kept under the same key, so "
        "calibrate the way you decode)",
    )
    p.add_argument(
        "--no-skinny",
        action="store_true",
        help="time F.linear's few-row forwards, as transformers' assisted loop runs them outside "
        "hf_d3d.skinny_linears (default on fp32 CPU targets: with the few-row linears, kept under a '+skinny' key)",
    )
    p.add_argument(
        "--no-fp16-weights",
        action="store_true",
        help="time the drafter with fp32 weights (default for fp32 drafters on x86 CPUs: fp16-stored weights, "
        "hf_d3d.fp16_weights, kept under a '+fp16w' key)",
    )
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--write", action="store_true", help="record the costs in the drafter folder's config.json")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("publish", help="assemble a Hub folder (card included) and upload it with huggingface_hub")
    p.add_argument("checkpoint")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--folder", default=None, help="where to assemble the Hub folder (default: CHECKPOINT-hub)")
    p.add_argument("--private", action="store_true", help="create the repo private (an existing repo keeps its own)")
    p.add_argument(
        "--force", action="store_true", help="upload over an existing repo (files the folder lacks are deleted there)"
    )
    p.add_argument("--dry-run", action="store_true", help="write the folder only")
    p.set_defaults(func=_cmd_publish)

    from hf_d3d.demo import DEFAULT_PROMPT

    p = sub.add_parser("demo", help="stream an answer with D3D and compare it with plain decoding")
    p.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="Hub id or folder (default: the committed SmolLM2 drafter)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (FileNotFoundError, KeyError, ValueError, OSError, ModuleNotFoundError, RuntimeError) as err:
        print(f"hf-d3d {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
