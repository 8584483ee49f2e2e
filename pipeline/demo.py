"""``make demo``: the whole pipeline on CPU at TP=2, on tiny models it makes itself.

Builds a tiny random Llama actor with its tokenizer, a tiny reward model with a *different*
tokenizer (so scoring re-tokenizes) and a prompts file, writes a run spec, and runs
shard → 3 × (rollout → score → ppo) → export with the local executor (2 processes per stage,
gloo). The reward is the RM's score plus a rule the tiny actor can learn quickly (the share of
vowels in its response), so the mean score visibly rises. Rerunning resumes: finished stages are
skipped.
"""

from __future__ import annotations

import os
import sys

import yaml

DEMO_DIR = os.environ.get("LLAMARL_DEMO_DIR", "demo-run")


def vowel_ratio(response: str, row: dict) -> float:
    """The share of letters in the response that are vowels (a dense, learnable reward)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def make_inputs(root: str) -> str:
    """Models, prompts and the run spec under ``root``; returns the spec's path."""
    from llamarl.pipeline import toy

    inputs = os.path.join(root, "inputs")
    if not os.path.exists(os.path.join(inputs, "actor", "config.json")):
        toy.make_llama(os.path.join(inputs, "actor"), tokenizer_corpus=toy.CORPUS_A)
        toy.make_llama(os.path.join(inputs, "rm"), kind="score", seed=1, tokenizer_corpus=toy.CORPUS_B)
        toy.make_prompts(os.path.join(inputs, "prompts.jsonl"), n=32)
    spec = {
        "name": "demo",
        "storage": os.path.abspath(root),
        "actor": os.path.abspath(os.path.join(inputs, "actor")),
        "reward_model": os.path.abspath(os.path.join(inputs, "rm")),
        "prompts": os.path.abspath(os.path.join(inputs, "prompts.jsonl")),
        "iterations": 3,
        "layout": {"shard": {"tp": 2}, "rollout": {"tp": 2}, "score": {"tp": 2}, "ppo": {"tp": 2}, "export": {"procs": 2}},
        "rollout": {"id_column": "id", "chunk_size": 32, "max_batch": 64,
                    "sampling": {"samples_per_prompt": 4, "max_new_tokens": 12, "temperature": 1.0, "seed": 0}},
        "score": {"rewards": [{"name": "rm", "weight": 0.1},
                              {"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0}]},
        "ppo": {"mini_batch_size": 32, "ppo_epochs": 2, "actor_lr": 0.01, "critic_lr": 0.01, "kl_coef": 0.01,
                "micro_batch_tokens": 4096, "seed": 0},
        "export": {},
    }
    path = os.path.join(root, "demo.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path


def main() -> None:
    from llamarl.pipeline.cli import app

    os.makedirs(DEMO_DIR, exist_ok=True)
    spec = make_inputs(DEMO_DIR)
    print(f"run spec: {spec}", flush=True)
    sys.argv = ["llamarl", "run", spec]
    app()


if __name__ == "__main__":
    main()
