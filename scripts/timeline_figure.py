"""Draw the README figure: serial draft/verify (target-conditioned drafters) vs D3D's overlapped timeline."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def draw(path: Path) -> None:
    draft, verify, rounds = 0.35, 1.0, 4
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.2), sharex=True)
    serial, overlapped = axes
    t = 0.0
    for _ in range(rounds):
        serial.broken_barh([(t, draft)], (10, 8), color="tab:orange")
        t += draft
        serial.broken_barh([(t, verify)], (0, 8), color="tab:blue")
        t += verify
    serial_end = t
    t = 0.0
    overlapped.broken_barh([(t, draft)], (10, 8), color="tab:orange")  # only the first draft is exposed
    t += draft
    for _ in range(rounds):
        overlapped.broken_barh([(t, verify - 0.04)], (0, 8), color="tab:blue")  # gaps mark rounds
        overlapped.broken_barh([(t + 0.05, draft * 1.6)], (10, 8), color="tab:green")  # packed pass, side stream
        t += verify
    for ax, title, end in (
        (serial, "serial: draft, verify, draft, verify (drafter waits for target)", serial_end),
        (overlapped, "D3D: packed pass drafts the next block while the target verifies", t),
    ):
        ax.set_yticks([4, 14], ["target", "drafter"])
        ax.set_title(title, fontsize=9, loc="left")
        ax.axvline(end, color="gray", ls=":", lw=1)
    overlapped.set_xlabel("time (illustrative units)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:orange", "tab:blue", "tab:green")]
    fig.legend(handles, ["sync draft", "verify", "packed draft (hidden)"], loc="lower right", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/timeline.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(out)
    print(f"wrote {out}")
