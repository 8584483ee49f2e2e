"""Per-iteration metrics of a run: ``metrics.jsonl`` and ``metrics.png`` in the run directory.

One row per finished ppo iteration: the mean score of its rollout (the policy before that
iteration's update), the means of its per-step metrics, and the validation of the actor it wrote
where the run validates it (docs/pipeline.md, "A long run", names each metric).
"""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict

import fsspec

from llamarl.lib.files import publish
from llamarl.stages.ppo_metrics import json_lines, mean

PLOTTED = ("mean_score", "kl", "policy_loss", "value_loss")
STEP_MEANS = ("kl", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "actor_grad_norm")


def validation_metrics(scores_url: str, pass_threshold: float) -> dict:
    """The validation metrics of a published scores output (of a validation rollout)."""
    from llamarl.stages import contract

    rows = contract.read_rows(scores_url, publish.require_published(scores_url, contract.SCORES))
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_prompt[row[contract.PROMPT_ID]].append(row[contract.SCORE])
    n = min(len(s) for s in by_prompt.values())
    terms = [c.removeprefix(f"{contract.SCORE}_") for c in rows[0] if c.startswith(f"{contract.SCORE}_")]
    out = {"val_score": mean([row[contract.SCORE] for row in rows]), "val_prompts": len(by_prompt), "val_samples": n,
           "val_pass_threshold": pass_threshold}
    for term in terms:
        out[f"val_score_{term}"] = mean([row[contract.term_column(term)] for row in rows])
    out[f"val_best@{n}"] = mean([max(s) for s in by_prompt.values()])
    passes = [sum(x >= pass_threshold for x in s) for s in by_prompt.values()]
    for k in sorted({2 ** j for j in range(n.bit_length()) if 2 ** j <= n} | {n}):
        out[f"val_pass@{k}"] = mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in passes])
    return out


def iteration_metrics(run: str, iterations: int, pass_threshold: float | None = None) -> list[dict]:
    """One row per finished PPO iteration (and its validation, where there is one). A validation
    whose pass@k were counted at another ``pass_threshold`` is counted again at this one from its
    scores; where retention deleted them, its row keeps the threshold it was counted at
    (``val_pass_threshold``)."""
    from .records import read_record

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
        for key in STEP_MEANS:
            row[key] = mean([s.get(key) for s in steps])  # None (null) where no step defines it
        validation = (read_record(run, f"iter-{i:03d}/val-scores") or {})
        if validation.get("status") == "done" and validation.get("metrics"):
            counted = validation["metrics"]
            scores = f"{run}/iter-{i:03d}/val-scores"
            if pass_threshold is not None and counted.get("val_pass_threshold") != pass_threshold \
                    and publish.read_manifest(scores) is not None and publish.retired(scores) is None:
                counted = validation_metrics(scores, pass_threshold)
            row |= counted
        rows.append(row)
    return rows


def update_metrics(run: str, iterations: int, pass_threshold: float | None = None) -> list[dict]:
    rows = iteration_metrics(run, iterations, pass_threshold)
    publish.replace(f"{run}/metrics.jsonl", json_lines(rows))
    if rows:
        publish.replace(f"{run}/metrics.png", plot(rows))
    return rows


def plot(rows: list[dict]) -> bytes:
    """The training score with the validation score beside it, then KL and the losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    xs = [r["iteration"] for r in rows]
    for ax, key in zip(axes, PLOTTED):
        ax.plot(xs, [r[key] for r in rows], marker="o", label="train" if key == "mean_score" else None)
        if key == "mean_score" and any("val_score" in r for r in rows):
            validated = [r for r in rows if "val_score" in r]
            ax.plot([r["iteration"] for r in validated], [r["val_score"] for r in validated], marker="s",
                    label="validation")
            ax.legend()
        ax.set_title(key.replace("_", " "))
        ax.set_xlabel("iteration")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
