"""Per-iteration metrics of a run: ``metrics.jsonl`` and ``metrics.png`` in the run directory."""

from __future__ import annotations

import io
import json

import fsspec

from llamarl.lib import publish
from llamarl.stages.ppo_metrics import json_lines, mean

PLOTTED = ("mean_score", "kl", "policy_loss", "value_loss")


def iteration_metrics(run: str, iterations: int) -> list[dict]:
    """One row per finished PPO iteration: the mean score of its rollout (the policy before that
    iteration's update) and the means of its per-step metrics."""
    rows = []
    for i in range(1, iterations + 1):
        ppo_dir = f"{run}/iter-{i:03d}/ppo"
        manifest = publish.read_manifest(ppo_dir)
        if manifest is None:
            break
        with fsspec.open(f"{ppo_dir}/metrics.jsonl", "r") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        row = {"iteration": i, "mean_score": manifest["summary"]["mean_score"],
               "mean_response_length": manifest["summary"]["mean_response_length"], "steps": len(steps)}
        for key in ("kl", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "actor_grad_norm"):
            row[key] = mean([s.get(key) for s in steps])  # None (null) where no step defines it
        rows.append(row)
    return rows


def update_metrics(run: str, iterations: int) -> list[dict]:
    rows = iteration_metrics(run, iterations)
    publish.write_bytes(f"{run}/metrics.jsonl", json_lines(rows))
    if rows:
        publish.write_bytes(f"{run}/metrics.png", plot(rows))
    return rows


def plot(rows: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    xs = [r["iteration"] for r in rows]
    for ax, key in zip(axes, PLOTTED):
        ax.plot(xs, [r[key] for r in rows], marker="o")
        ax.set_title(key.replace("_", " "))
        ax.set_xlabel("iteration")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
