"""Gradio Space: plain decoding vs D3D side by side, with live tokens/s and draft tokens coloured by outcome.

Environment: D3D_TARGET (Hub id or folder; default the embedded SmolLM2-135M-Instruct) and D3D_DRAFTER (Hub id or
folder; default the drafter committed in this repo). On a Space, set both to Hub ids. Gradio analytics and Hub
telemetry are off: the app makes no outside request beyond loading those two models.
"""

from __future__ import annotations

import html
import os
import threading
import time

import gradio as gr
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from hf_d3d import check_pair, speculative_generate
from hf_d3d.demo import DEFAULT_PROMPT, MAX_NEW_TOKENS_LIMIT, DraftView, no_outside_requests, validate_request
from hf_d3d.targets import load_drafter, load_target

no_outside_requests()

TARGET, TOKENIZER = load_target(os.environ.get("D3D_TARGET"))
DRAFTER = load_drafter(os.environ.get("D3D_DRAFTER"), fp16_weights=True)  # fp16-stored weights on x86 CPUs
check_pair(TARGET, DRAFTER, TOKENIZER)
CONTEXT = getattr(TARGET.config, "max_position_embeddings", 1 << 30)
GREEDY = dict(do_sample=False, pad_token_id=TOKENIZER.pad_token_id)  # both sides greedy, whatever the config says
with torch.no_grad():  # warm both paths once, so that neither side of the first request is timed cold
    _x = torch.tensor([TOKENIZER(DEFAULT_PROMPT)["input_ids"][:16]])
    TARGET.generate(_x, attention_mask=torch.ones_like(_x), max_new_tokens=4, **GREEDY)
    speculative_generate(TARGET, DRAFTER, _x, max_new_tokens=4, **GREEDY)


STYLES = {  # inline, because Gradio's HTML output does not see page CSS classes
    "acc": "background:#c8f7c5",
    "tgt": "background:#d6e4ff",
    "rej": "color:#c0392b;text-decoration:line-through;opacity:0.7",
}


def _span(text: str, cls: str) -> str:
    return f'<span class="{cls}" style="{STYLES[cls]}">{html.escape(text)}</span>'


def _stats(plain_tps: float, d3d_tps: float, tau: float, identical: bool) -> str:
    return (
        f"**plain** {plain_tps:.1f} tok/s &nbsp; **D3D** {d3d_tps:.1f} tok/s &nbsp; "
        f"**speedup** {d3d_tps / plain_tps:.2f}x &nbsp; **tau** {tau:.2f} &nbsp; "
        f"**identical**: {'yes' if identical else 'NO'}"
    )


UPDATE_EVERY = 0.05  # seconds between page updates while either side decodes: the same for both


def _start(job, on_error=None) -> tuple[threading.Thread, dict]:
    """Run ``job()`` in a worker thread, timing the call there (the page is updated beside it); the dict gets
    ``out`` and ``seconds``, or ``error``."""
    result: dict = {}

    def work():
        try:
            start = time.perf_counter()
            result["out"] = job()
            result["seconds"] = time.perf_counter() - start
        except Exception as err:  # reported by the page; a streamer must still end, or the page waits forever
            result["error"] = err
            if on_error is not None:
                on_error()

    worker = threading.Thread(target=work)
    worker.start()
    return worker, result


class _Cancelled(Exception):
    """The page went away mid-answer: its decoding stops, so the next request is not timed beside it."""


class _StopWhenSet(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _failed(side: str, err: Exception) -> str:
    return f"**{side} decoding failed:** {html.escape(f'{type(err).__name__}: {err}')}"


def _d3d_html(pieces: list[str]) -> str:
    body = "".join(pieces)
    return f'<div style="white-space:pre-wrap;word-break:break-word;font-family:monospace">{body}</div>'


def run(prompt: str, max_new_tokens: float):
    """Stream plain decoding, then D3D decoding of the same prompt; yields (plain, d3d_html, stats).

    Both sides decode in a worker thread, timed there, while the page shows their text at most every
    ``UPDATE_EVERY`` seconds: each side pays the same for being watched."""
    try:
        ids = validate_request(prompt, int(max_new_tokens or 0), TOKENIZER, CONTEXT)
    except (ValueError, TypeError) as err:
        yield "", "", f"**Input error:** {html.escape(str(err))}"
        return
    x = torch.tensor([ids])
    max_new = int(max_new_tokens)

    # Gradio stops this generator at a yield when the page goes away; the finally block then stops the decoding
    # under way, so it does not run on beside (and slow down, or hold patched layers of the target for) the next
    # request.
    stop = threading.Event()
    workers: list[threading.Thread] = []
    try:
        yield from _decode_both(x, max_new, stop, workers)
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def _decode_both(x: torch.Tensor, max_new: int, stop: threading.Event, workers: list[threading.Thread]):
    # plain greedy generate, streamed token by token
    streamer = TextIteratorStreamer(TOKENIZER, skip_prompt=True, skip_special_tokens=True)
    worker, plain = _start(
        lambda: TARGET.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([_StopWhenSet(stop)]),
            **GREEDY,
        ),
        on_error=streamer.end,
    )
    workers.append(worker)
    text, shown = "", 0.0
    for piece in streamer:
        text += piece
        if time.perf_counter() - shown >= UPDATE_EVERY:
            shown = time.perf_counter()
            yield text, "", "*plain decoding ...*"
    worker.join()
    if "error" in plain:
        yield text, "", _failed("Plain", plain["error"])
        return
    yield text, "", "*D3D decoding ...*"

    # D3D fast loop, streamed round by round: each round reports its draft, how much was accepted and what the
    # target committed
    pieces: list[str] = []
    rounds = {"n": 0}
    view = DraftView(TOKENIZER)

    def on_round(draft, accepted, committed):
        if stop.is_set():
            raise _Cancelled
        rounds["n"] += 1
        pieces.extend(_span(text, kind) for text, kind in view.round(draft, accepted, committed))

    worker, d3d = _start(
        lambda: speculative_generate(TARGET, DRAFTER, x, max_new_tokens=max_new, on_round=on_round, **GREEDY)
    )
    workers.append(worker)
    while worker.is_alive():
        worker.join(UPDATE_EVERY)
        if worker.is_alive():
            yield text, _d3d_html(list(pieces)), "*D3D decoding ...*"
    if "error" in d3d:
        yield text, _d3d_html(pieces), _failed("D3D", d3d["error"])
        return
    plain_new = plain["out"].shape[1] - x.shape[1]
    d3d_new = d3d["out"].shape[1] - x.shape[1]
    identical = bool(torch.equal(d3d["out"], plain["out"]))
    tau = d3d_new / max(rounds["n"], 1)
    stats = _stats(plain_new / plain["seconds"], d3d_new / d3d["seconds"], tau, identical)
    yield text, _d3d_html(pieces), stats


def build() -> gr.Blocks:
    with gr.Blocks(title="D3D speculative decoding") as demo:
        gr.Markdown(
            "# D3D: lossless speculative decoding\nThe same greedy answer, decoded plainly and with a D3D drafter. "
            "Green: draft tokens the target accepted; blue: the target's own token each round; "
            "red, struck through: rejected drafts (never part of the output)."
        )
        with gr.Row():
            prompt = gr.Textbox(value=DEFAULT_PROMPT, label="Prompt", lines=3, elem_id="prompt")
            max_new = gr.Number(
                value=96, label=f"max_new_tokens (1-{MAX_NEW_TOKENS_LIMIT})", precision=0, elem_id="max_new"
            )
        button = gr.Button("Generate", variant="primary", elem_id="go")
        stats = gr.Markdown(elem_id="stats")
        with gr.Row():
            plain = gr.Textbox(label="plain generate", lines=12, elem_id="plain")
            d3d = gr.HTML(label="D3D", elem_id="d3d")
        button.click(run, [prompt, max_new], [plain, d3d, stats])
    return demo


if __name__ == "__main__":
    # Unset, both fall through to Gradio's own GRADIO_SERVER_NAME / GRADIO_SERVER_PORT, which a Space sets.
    port = os.environ.get("PORT")
    build().queue().launch(server_name=os.environ.get("HOST"), server_port=int(port) if port else None)
