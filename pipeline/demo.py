"""``make demo``: the whole pipeline on CPU at TP=2, on tiny models it makes itself.

A tiny random Llama actor with its tokenizer, a tiny reward model with a *different* tokenizer (so
scoring re-tokenizes) and a prompts file, then a run spec of shard → 3 × (rollout → score → ppo) →
export with the local executor (2 processes per stage, gloo). The reward is the RM's score plus a
rule the tiny actor learns quickly (the share of vowels in its response), so the mean score
visibly rises. Rerunning resumes: finished stages are skipped. ``--help`` lists the variants.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing

import yaml

DEMO_DIR = os.environ.get("LLAMARL_DEMO_DIR", "demo-run")
# The overlap placement on a small machine: one process (one core) a stage, two stages at once, so that
# with max_staleness 1 a rollout runs on one core while the ppo before it trains on the other.
OVERLAP_LAYOUT = {"shard": {"tp": 1}, "rollout": {"tp": 1}, "score": {"tp": 1}, "ppo": {"tp": 1}, "export": {"procs": 1}}
OVERLAP_EXECUTOR = {"kind": "local", "options": {"threads_per_process": 1, "max_concurrent_stages": 2}}


def vowel_ratio(response: str, row: dict) -> float:
    """The share of letters in the response that are vowels (a dense, learnable reward)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def make_inputs(root: str, staleness: int | None = None, policy_loss: str = "ppo") -> str:
    """Models, prompts and the run spec under ``root``; returns the spec's path. ``staleness``
    None: the demo of ``make demo`` (``demo.yaml``, run ``demo``); 0 or 1: the overlap placement
    with that ``max_staleness`` (``demo-s0.yaml``, run ``demo-s0``; ``demo-s1`` …). Another
    ``policy_loss`` than ppo's own is a run of its own, its name suffixed (``demo-gspo``)."""
    from llamarl.pipeline import toy

    inputs = os.path.join(root, "inputs")
    if not os.path.exists(os.path.join(inputs, "actor", "config.json")):
        toy.make_llama(os.path.join(inputs, "actor"), tokenizer_corpus=toy.CORPUS_A)
        toy.make_llama(os.path.join(inputs, "rm"), kind="score", seed=1, tokenizer_corpus=toy.CORPUS_B)
        toy.make_prompts(os.path.join(inputs, "prompts.jsonl"), n=32)
    if not os.path.exists(os.path.join(inputs, "validation.jsonl")):
        toy.make_prompts(os.path.join(inputs, "validation.jsonl"), n=8, first=1000, id_prefix="v")
    name = ("demo" if staleness is None else f"demo-s{staleness}") + ("" if policy_loss == "ppo" else f"-{policy_loss}")
    spec = {
        "name": name,
        "storage": os.path.abspath(root),
        "actor": os.path.abspath(os.path.join(inputs, "actor")),
        "reward_model": os.path.abspath(os.path.join(inputs, "rm")),
        "prompts": os.path.abspath(os.path.join(inputs, "prompts.jsonl")),
        "seed": 0,
        "iterations": 3,
        # The held-out prompts, validated after every iteration: metrics.png draws them beside the training score.
        "validation": {"prompts": os.path.abspath(os.path.join(inputs, "validation.jsonl")), "every": 1,
                       "pass_threshold": 0.5},
        "layout": {"shard": {"tp": 2}, "rollout": {"tp": 2}, "score": {"tp": 2}, "ppo": {"tp": 2}, "export": {"procs": 2}},
        "rollout": {"id_column": "id", "chunk_size": 32, "max_batch": 64,
                    "sampling": {"samples_per_prompt": 4, "max_new_tokens": 12, "temperature": 1.0}},
        "score": {"rewards": [{"name": "rm", "weight": 0.1},
                              {"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0}]},
        "ppo": {"mini_batch_size": 32, "ppo_epochs": 2, "actor_lr": 0.01, "critic_lr": 0.01, "kl_coef": 0.01,
                "micro_batch_tokens": 4096, "seed": 0},
        "export": {},
    }
    if staleness is not None:
        spec.update(max_staleness=staleness, layout=OVERLAP_LAYOUT, executor=OVERLAP_EXECUTOR)
    if policy_loss != "ppo":
        spec["ppo"]["policy_loss"] = policy_loss
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path


def main(argv: list[str] | None = None) -> None:
    from llamarl.stages.config import PPOConfig

    ap = argparse.ArgumentParser(prog="python -m llamarl.pipeline.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--overlap", action="store_true", help="run the demo overlapped: max_staleness 1, every stage "
                                                           "on 1 process, 2 stages at once (run demo-s1; "
                                                           "bench/overlap.py times it against max_staleness 0)")
    ap.add_argument("--policy-loss", choices=typing.get_args(PPOConfig.model_fields["policy_loss"].annotation),
                    default="ppo", help="ppo's policy_loss (docs/rl.md); another than ppo is a run of its own, "
                                        "demo-MODE")
    args = ap.parse_args(argv)
    os.makedirs(DEMO_DIR, exist_ok=True)
    from llamarl.pipeline.cli import app

    spec = make_inputs(DEMO_DIR, 1 if args.overlap else None, args.policy_loss)
    print(f"run spec: {spec}", flush=True)
    sys.argv = ["llamarl", "run", spec]
    app()


if __name__ == "__main__":
    main()
