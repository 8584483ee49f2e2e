"""Stage score: reward-model scores and rule-based rewards for each rollout row (tp × pp × dp
processes: ``llamarl stage score ROLLOUT OUT --rm RM``). Here, the reward model: its inputs and its
forward; the parts, their checks and the manifest are stages/scoring.py's, which the rollout stage
runs itself when every term is a rule. Formats: docs/formats.md, "Scores".
"""

from __future__ import annotations

import json

import torch
from torch.nn.utils.rnn import pad_sequence

from llamarl.lib.files import checkpoint, outputs
from llamarl.lib.runtime import job
from llamarl.lib.distributed import parallel
from llamarl.lib.model import schedule
from llamarl.lib.engine import tokenizer as toklib
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype
from llamarl.lib.model.offload import ParamOffload
from llamarl.stages import contract
from llamarl.stages.config import ScoreConfig
from llamarl.stages.scoring import RewardModel, Scoring


# ---- re-tokenization ---------------------------------------------------------------------------


def rm_inputs(rows: list[dict], actor_tok, rm_tok, max_length: int, chat_template: str = "auto") -> tuple[list[list[int]], int]:
    """RM token ids for each rollout row, and how many rows had their prompt cut (from the left, to
    ``max_length``). With the actor's tokenizer (by content: ``toklib.fingerprint``) the rollout's
    token ids are reused; else the response is decoded from the actor's tokens and the conversation
    encoded again with the RM's tokenizer and chat template."""
    same = toklib.fingerprint(actor_tok) == toklib.fingerprint(rm_tok)
    use_template = bool(getattr(rm_tok, "chat_template", None)) and chat_template != "never"
    out, truncated = [], 0
    for row in rows:
        if same:
            prompt, response = list(row[contract.PROMPT_TOKEN_IDS]), list(row[contract.RESPONSE_TOKEN_IDS])
        else:
            text = actor_tok.decode(row[contract.RESPONSE_TOKEN_IDS], skip_special_tokens=True)
            prompt, response = _encode_conversation(rm_tok, row[contract.PROMPT], text, use_template)
        if len(prompt) + len(response) > max_length:
            truncated += 1
            keep = max(max_length - len(response), 0)
            prompt = prompt[len(prompt) - keep:] if keep else []
            response = response[-max_length:]
        out.append(prompt + response)
    return out, truncated


def _encode_conversation(tok, prompt: str, response: str, use_template: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) as the RM's tokenizer makes them of the decoded conversation."""
    messages = _messages(prompt)
    if use_template:
        full = tok.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        head = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        n = len(tok(head, add_special_tokens=False)["input_ids"]) if full.startswith(head) else 0
        return ids[:n], ids[n:]
    text = "\n".join(m["content"] for m in messages)
    p = tok(text, add_special_tokens=True)["input_ids"]
    return p, tok(response, add_special_tokens=False)["input_ids"]


def _messages(prompt: str) -> list[dict]:
    if prompt.startswith("["):
        try:
            value = json.loads(prompt)
            if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
                return value
        except json.JSONDecodeError:
            pass
    return [{"role": "user", "content": prompt}]


# ---- the reward model --------------------------------------------------------------------------


def score_sequences(model, seqs: list[list[int]], micro_batch: int, padding_side: str = "right") -> list[float] | None:
    """The RM's score for each sequence; None on ranks that are not the last pipeline stage."""
    dev = next(model.parameters()).device
    batches = []
    for i in range(0, len(seqs), micro_batch):
        group = [torch.tensor(s, dtype=torch.long) for s in seqs[i : i + micro_batch]]
        ids = pad_sequence(group, batch_first=True, padding_side=padding_side)
        mask = pad_sequence([torch.ones_like(s) for s in group], batch_first=True, padding_side=padding_side)
        batches.append(model.make_batch(ids.to(dev), mask.to(dev)))
    outs = schedule.forward(model, batches)
    if not model.topology.is_last_stage:
        return None
    return [float(x) for o in outs for x in o.float().cpu()]


# ---- the stage ---------------------------------------------------------------------------------


def _reward_model(cfg: ScoreConfig, manifest: dict, actor: str, dtype) -> RewardModel:
    """Collective: the reward model's files verified and its weights loaded, as the function that
    scores rows (a ``scoring.RewardModel``); ``actor``: the rollout's actor, whose tokenizer made
    the responses."""
    from llamarl.lib.model.llama import ParallelLlamaForScore

    outputs.verify_input(cfg.reward_model, manifest, f"{contract.MODEL}/")
    rm_cfg = LlamaConfig.from_dict(manifest["model_config"])
    with torch.device(parallel.device()):
        model = ParallelLlamaForScore(rm_cfg, ParallelLayout(tp=cfg.tp, pp=cfg.pp, remove_padding=True), dtype=dtype)
    checkpoint.load_model(model, f"{cfg.reward_model}/{contract.MODEL}")
    model.eval()
    offload = ParamOffload(model, parallel.device())
    actor_tok, rm_tok = toklib.load(actor), toklib.load(cfg.reward_model)
    max_length = cfg.max_length or rm_cfg.max_position_embeddings

    def score(rows: list[dict]) -> tuple[list[float] | None, int]:
        seqs, truncated = rm_inputs(rows, actor_tok, rm_tok, max_length, cfg.chat_template)
        offload.to_device()
        scores = score_sequences(model, seqs, cfg.micro_batch)
        if cfg.offload:
            offload.to_host()
        return scores, truncated

    return score


def run(cfg: ScoreConfig) -> None:
    scoring = Scoring.open(cfg)
    rm_manifest = None
    if cfg.uses_rm():
        rm_manifest = contract.require_checkpoint(cfg.reward_model, "score", "a reward model")
        ParallelLayout(tp=cfg.tp, pp=cfg.pp).check(LlamaConfig.from_dict(rm_manifest["model_config"]))

    topo = parallel.init(cfg.tp, cfg.pp, dp=cfg.dp, timeout_s=cfg.collective_timeout_s, stage="score")

    def load_rm() -> RewardModel:
        actor = contract.RolloutFacts.read(scoring.rollout, scoring.manifest).actor
        return _reward_model(cfg, rm_manifest, actor, compute_dtype(cfg.dtype, parallel.device()))

    scoring.run(topo.dp, topo.dp_rank, writer=topo.tp_rank == 0 and topo.is_last_stage,
                load_rm=load_rm if rm_manifest is not None else None)


if __name__ == "__main__":
    job.main(ScoreConfig, run)
