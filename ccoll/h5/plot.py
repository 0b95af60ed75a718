"""Rate-distortion plot of an ``ccoll eval`` report: bits per value against PSNR, per codec."""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["rd_plot"]


def rd_plot(report: dict[str, Any], path: str) -> None:
    """Write a PNG with one line per codec through its totals at each bound."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe when a GUI backend is configured
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    markers = {"ccoll": "o", "ccoll v2": "D", "sz3": "s", "zfp": "^"}
    for codec in report["codecs"]:
        pts = [
            (t["bits_per_value"], t["psnr_db"], t["bound"], t["max_err_over_eb"])
            for t in report["totals"]
            if t["codec"] == codec
            and math.isfinite(t["bits_per_value"])
            and math.isfinite(t["psnr_db"])
        ]
        if not pts:
            continue
        pts.sort()
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker=markers.get(codec, "x"), label=codec
        )
        if codec == "ccoll":
            for bpv, psnr, bound, _ in pts:
                ax.annotate(
                    bound, (bpv, psnr), textcoords="offset points", xytext=(4, -10), fontsize=7
                )
    ax.set_xlabel("bit rate (bits per value, all datasets)")
    ax.set_ylabel("PSNR (dB, over all datasets)")
    ax.set_title(f"rate-distortion: {os.path.basename(report['file'])}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
