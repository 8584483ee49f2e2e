"""Stage rollout: sample responses from the actor for a prompts dataset; write Parquet parts.

Run with tp × dp processes (``llamarl stage rollout ACTOR PROMPTS OUT --tp T --dp D``): chunk c of
``chunk_size`` rows goes to data-parallel group c mod dp and becomes one part, published whole, so a
rerun skips the parts already there. How and why: docs/generation.md, "The rollout stage: one
stream per rank" and "Sampling"; the files: docs/formats.md. With ``scores`` (every reward term a
rule) the rollout then publishes the score stage's output too (stages/scoring.py).
"""

from __future__ import annotations

if __name__ == "__main__":
    # Start-up is Python-bound, so before the stage's own imports the tokenizer starts in a child
    # process and, on a GPU machine, a thread hashes Triton's sources (the sampler kernel's cache
    # key): docs/generation.md, "Start-up, beside the weights".
    import importlib
    import os
    import sys
    import threading

    from llamarl.lib.engine import tokenizer_process

    _TOKENIZER_PROC = tokenizer_process.spawn(tokenizer_process.config_json_value(sys.argv, "actor"))

    def _triton_key() -> None:
        try:
            importlib.import_module("triton.compiler.compiler").triton_key()
        except (ImportError, AttributeError):
            pass

    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/nvidia0")):
        threading.Thread(target=_triton_key, name="rollout-triton-key", daemon=True).start()

import itertools  # noqa: E402 - after the tokenizer process has started
import json  # noqa: E402
import os  # noqa: E402, F811
import time  # noqa: E402

import pyarrow as pa
import torch
import torch.distributed as dist

from llamarl.lib.model import attention
from llamarl.lib.runtime import background, job
from llamarl.lib.files import checkpoint, outputs, publish
from llamarl.lib import dtypes
from llamarl.lib.distributed import collectives, parallel
from llamarl.lib.engine import sampling
from llamarl.lib.engine import tokenizer as toklib
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype, pad_vocab
from llamarl.lib.errors import UserError
from llamarl.lib.engine.generate import Batch, Engine, SamplingParams
from llamarl.stages import contract, identity, prompts, space
from llamarl.stages.config import RolloutConfig, beyond_vocab
from llamarl.stages.scoring import Scoring

_IMPORTED = time.time()


def run(cfg: RolloutConfig, overlap: bool = True) -> None:
    """``overlap=False`` (for tests and measurements): chunk after chunk, each drained, with its
    tokenizing and writing in between — the same parts, byte for byte."""
    space.check(cfg)
    spans = _Spans()
    actor, out = cfg.actor.rstrip("/"), cfg.out.rstrip("/")
    manifest, model_cfg, layout, room = _check_actor(cfg, actor)
    # What does not wait for the process group starts now, in threads: the tokenizer and, on a GPU,
    # the kernels' first calls (_warm_up_kernels), while the prompts are opened, the process group
    # joined and the weights loaded.
    tokenizer = background.Soon(_load_tokenizer, actor, name="rollout-tokenizer")
    device = _local_device()
    dtype = compute_dtype(cfg.dtype, device)
    compiling = None
    if device.type == "cuda":
        compiling = background.Soon(_warm_up_kernels, cfg, model_cfg, layout, dtype, device, name="rollout-compile")
    spans.mark("manifest")
    # Every row this rollout reads is checked before anything is written (stages/prompts.py): a
    # bad one is refused in one line naming its file and line, not found parts later.
    reading = prompts.for_rollout(cfg.prompts, prompts.Columns.of(cfg), cfg.select, cfg.index_cache)
    spans.mark("prompts")

    topo = parallel.init(cfg.tp, 1, dp=cfg.dp, timeout_s=cfg.collective_timeout_s, stage="rollout")
    spans.mark("process_group")
    # The sampler's version is part of what the rows are: a new draw algorithm redoes old rollouts.
    # The actor's location is for the stages after (score's tokenizer: contract.RolloutFacts).
    request = identity.declare(cfg).request(actor=actor, prompts=cfg.prompts, sampler=sampling.SAMPLER)
    if identity.skip_if_current(out, request, "already rolled out with this actor and config"):
        _score(cfg, topo)  # a run stopped between the two publishes: the scores are still to do
        return
    # The weights are verified while they load: nothing is made from them before every rank's
    # share of the files checked out.
    verifying = outputs.start_verify(actor, manifest, f"{contract.MODEL}/")
    done = set(contract.published_parts(out))
    spans.mark("prepare_and_verify")
    model = _load_actor(actor, model_cfg, layout, dtype, verifying, spans)
    tok = tokenizer.result()
    s = cfg.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            stop_token_ids=tuple(sorted(set(toklib.stop_token_ids(actor, tok)) | set(s.stop_token_ids))))
    spans.mark("tokenizer_wait")
    if compiling is not None:
        compiling.result()
    spans.mark("compile_wait")
    meta = {"actor": actor, "actor_id": request["actor_id"], "sampling": json.dumps(s.model_dump()), "seed": str(s.seed),
            "sampler": sampling.SAMPLER, "tp": str(cfg.tp), "dtype": dtypes.name(dtype)}
    stats = {"chunks": 0, "rows": 0, "truncated_prompts": 0, "new_tokens": 0, "skipped_chunks": 0, "engine_s": 0.0}
    chunks = _chunks(reading, cfg, lambda i: i % topo.dp == topo.dp_rank, done, tok, room, stats)
    engine = Engine(model, params, max_batch=cfg.max_batch, batch_invariant=True)
    elapsed = _generate(cfg, out, engine, chunks, tok, reading.checked.kept, meta, topo.tp_rank == 0, overlap, spans,
                        stats)
    # job's collectives: none in a world of one (on NCCL the first would build a communicator).
    all_stats = collectives.all_gather_object(stats if topo.tp_rank == 0 else None)
    collectives.barrier()
    spans.mark("gathered")
    if dist.get_rank() == 0:
        background_s = {"tokenizer": tokenizer.seconds, "kernel_warm_up": compiling.seconds if compiling else None,
                        "tokenizer_process": {k: round(v - spans.t0, 3) for k, v in getattr(tok, "times", {}).items()}}
        _publish(cfg, out, reading, request, [s_ for s_ in all_stats if s_], stats["new_tokens"] / elapsed
                 if elapsed else None, spans, background_s)
    collectives.barrier()
    _score(cfg, topo)


def _score(cfg: RolloutConfig, topo) -> None:
    """Collective: with ``cfg.scores`` (the pipeline's, when every reward term is a rule), the
    published rollout scored into the score stage's output, as that stage would (stages/scoring.py),
    without a score process; a rule that fails stops the stage in the score stage's words, the
    rollout published and the scores not."""
    if cfg.scores is None:
        return
    scoring, error = None, None
    try:
        scoring = Scoring.open(cfg.scores)
    except UserError as e:
        error = str(e)
    collectives.check(error)
    scoring.run(topo.dp, topo.dp_rank, writer=topo.tp_rank == 0, guest=True)


def _check_actor(cfg: RolloutConfig, actor: str):
    """The actor's manifest, model config and layout, checked, and the most prompt tokens that
    leave ``max_new_tokens`` within its positions."""
    manifest = contract.require_checkpoint(actor, "lm", "rollout's actor")
    model_cfg = LlamaConfig.from_dict(manifest["model_config"])
    layout = ParallelLayout(tp=cfg.tp, pp=1, remove_padding=True)
    layout.check(model_cfg)
    new = cfg.sampling.max_new_tokens
    room = model_cfg.max_position_embeddings - new
    if room < 1:
        raise UserError(f"sampling.max_new_tokens={new} leaves no room for a prompt within {actor}'s "
                        f"max_position_embeddings={model_cfg.max_position_embeddings}; lower max_new_tokens")
    vocab = model_cfg.vocab_size
    if (beyond := beyond_vocab(cfg.sampling.stop_token_ids, vocab)) is not None:
        raise UserError(f"sampling.stop_token_ids.{beyond[0]}={beyond[1]} is no token of {actor}, whose vocabulary "
                        f"has {vocab}; give ids below {vocab}")
    return manifest, model_cfg, layout, room


def _load_actor(actor: str, model_cfg, layout, dtype, verifying, spans: _Spans):
    """Collective: the weights loaded while their files are verified; a damaged file is its one
    line on every rank, never what loading it raised."""
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    with torch.device(parallel.device()):
        model = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    spans.mark("build")
    try:
        checkpoint.load_model(model, f"{actor}/{contract.MODEL}")
    except RuntimeError:
        collectives.check(verifying.result())
        raise
    model.eval()
    spans.mark("load")
    collectives.check(verifying.result())
    spans.mark("verify_wait")
    return model


def _generate(cfg: RolloutConfig, out: str, engine: Engine, chunks, tok, kept, meta: dict, writer: bool,
              overlap: bool, spans: _Spans, stats: dict) -> float:
    """This rank's chunks through one engine (batch invariant: a chunk's rows are the same bits
    whatever ran beside it, so a rerun that skips the published ones writes what an uninterrupted
    run would have), read ahead and written behind (docs/generation.md) or, without ``overlap``, one
    after another; the ``writer`` publishes the parts (the decoder is its own: a tokenizer object
    is not shared across threads). Counts into ``stats``; returns the seconds it took."""
    s = cfg.sampling
    progress = _Progress(dist.get_rank() == 0, spans)
    t0 = time.perf_counter()
    source = background.Ahead(chunks, depth=2, name="rollout-ahead") if overlap else chunks
    decoder = tok.for_thread() if overlap else tok
    publisher = background.Behind(lambda item: _write_part(out, decoder, cfg, kept, meta, *item), depth=2,
                                  background=overlap, name="rollout-behind")
    try:
        streams = [source] if overlap else ([batch] for batch in source)
        for batches in streams:
            for batch, completions in engine.stream(batches, seed=s.seed, samples_per_prompt=s.samples_per_prompt,
                                                    on_tokens=progress.tokens):
                stats["chunks"] += 1
                progress.chunks(stats["chunks"])
                stats["rows"] += len(completions)
                stats["new_tokens"] += sum(len(c.tokens) for c in completions)
                if writer:
                    publisher.put((batch, completions))
            stats["engine_s"] += engine.stats["busy_s"]
        spans.mark("engine")
        publisher.close()
        spans.mark("last_part_written")
    finally:
        publisher.stop()
        if overlap:
            source.stop()
    elapsed = time.perf_counter() - t0
    progress.bar.stop()
    return elapsed


def _publish(cfg: RolloutConfig, out: str, reading, request: dict, all_stats: list[dict], rate: float | None,
             spans: _Spans, background_s: dict) -> None:
    """Rank 0: the manifest, once every part is published."""
    parts = contract.published_parts(out)
    totals = {k: sum(s_[k] for s_ in all_stats) for k in all_stats[0] if k != "engine_s"}
    # The engine's own time (the slowest writer's): the rest of the stage's work is loading,
    # tokenizing and writing, which the manifest's timing shows against it.
    totals["engine_s"] = round(max(s_["engine_s"] for s_ in all_stats), 3)
    expected = -(-reading.count // cfg.chunk_size)
    if len(parts) != expected:
        raise RuntimeError(f"{out}: {len(parts)} parts published, {expected} expected")
    files = contract.part_entries(out, parts)
    rows = sum(contract.part_metadata(out, p).num_rows for p in parts)
    spans.mark("manifest_entries")
    selection = {"selection": reading.selection} if reading.selection else {}
    publish.publish(out, {"kind": contract.ROLLOUT, "timing": outputs.timing(), "request": request, "files": files,
                          "rows": rows, "schema": list(contract.ROLLOUT_COLUMNS) + list(cfg.keep_columns),
                          "stats": totals, **selection, "new_tokens_per_s_rank0": rate, "spans_s": spans.seconds(),
                          "background_s": background_s})
    print(f"{out}: {rows} responses in {len(parts)} parts ({totals['skipped_chunks']} chunks were already done, "
          f"{totals['truncated_prompts']} prompts truncated)", flush=True)


def _load_tokenizer(actor: str):
    """The actor's tokenizer: in the stage process's tokenizer process when it has one (started
    first thing, lib/engine/tokenizer_process.py), else here."""
    proc = globals().get("_TOKENIZER_PROC")
    if proc is not None:
        return tokenizer_process.TokenizerProcess(proc).load(actor)
    return toklib.Local(toklib.load(actor))


def _warm_up_kernels(cfg: RolloutConfig, model_cfg: LlamaConfig, layout: ParallelLayout, dtype, device) -> None:
    """The sampler's kernel compiled (or loaded from Triton's cache) for this rank's slice, the
    prefill's attention run once (its kernel's first launch) and the layers' compiled regions
    compiled for forwards without gradients (≈ 4.5 s on a fresh machine at the 1B shape), off the
    path to the first token."""
    from llamarl.lib.model.llama import warm_regions

    shard = pad_vocab(model_cfg.vocab_size, cfg.tp) // cfg.tp  # this rank's vocabulary slice, as the model has it
    sampling.warm_up(SamplingParams(temperature=cfg.sampling.temperature), shard,
                     int(os.environ.get("RANK", "0")) % cfg.tp * shard, dtype, device)
    attention.warm_up(device, dtype, max(model_cfg.num_heads // cfg.tp, 1), max(model_cfg.num_kv_heads // cfg.tp, 1),
                      model_cfg.head_dim)
    warm_regions(model_cfg, layout, dtype, device, backward=False)


def _local_device() -> torch.device:
    """The device this rank will compute on, before the process group is joined (which sets it)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class _Spans:
    """Rank 0's start-up and tear-down profile for the manifest (``spans_s``): seconds from the
    process's start to the stage's first step (``imports``: interpreter, imports, config), then
    between steps, in order; ``first_tokens``: the engine's first progress report."""

    def __init__(self):
        self.t0 = outputs.process_start_time() or _IMPORTED
        self.steps = [("imports", time.time())]

    def mark(self, step: str) -> None:
        self.steps.append((step, time.time()))

    def seconds(self) -> dict[str, float]:
        times = [self.t0] + [t for _, t in self.steps]
        steps = {name: round(t - before, 3) for (name, t), before in zip(self.steps, times)}
        return steps | {"total": round(times[-1] - self.t0, 3)}


def _chunks(reading: prompts.RolloutRows, cfg: RolloutConfig, mine, done: set[str], tok, room: int, stats: dict):
    """The engine's batches: each chunk ``mine`` accepts and ``done`` lacks, tokenized; ``room``:
    the most prompt tokens that leave max_new_tokens within the actor's positions."""
    s = cfg.sampling
    keep = min(cfg.max_prompt_tokens or room, room)
    rows_left = iter(reading)  # read once, in order, with bounded memory
    for chunk in itertools.count():
        rows = list(itertools.islice(rows_left, cfg.chunk_size))
        if not rows:
            return
        if not mine(chunk):
            continue
        if contract.part_name(chunk) in done:
            stats["skipped_chunks"] += 1
            continue
        ids_of = []
        for (number, place, _), ids in zip(rows, _encode(tok, reading, rows, cfg)):
            if len(ids) > room and cfg.overlong_prompts == "error":
                raise UserError(f"{reading.ds.where(number, place)}: {len(ids)} prompt tokens, and with "
                                f"max_new_tokens={s.max_new_tokens} the actor's {s.max_new_tokens + room} positions "
                                f"allow {room}; shorten it, or set overlong_prompts: truncate")
            if len(ids) > keep:
                ids = ids[-keep:]
                stats["truncated_prompts"] += 1
            if not ids:
                raise UserError(f"{reading.ds.where(number, place)}: the prompt has no tokens; remove it")
            ids_of.append(ids)
        # Row numbers key the random streams: the same prompt row draws the same responses wherever
        # and with whatever it runs. The tag: the chunk's index and its rows' values, for its part.
        yield Batch(ids_of, [number for number, _, _ in rows], (chunk, [values for _, _, values in rows]))


def _encode(tok, reading: prompts.RolloutRows, rows: list, cfg: RolloutConfig) -> list[list[int]]:
    """The token ids of ``rows``' prompts; a prompt the tokenizer refuses (its chat template) named
    by its row."""
    try:
        return tok.encode_prompts([values[cfg.prompt_column] for _, _, values in rows], cfg.chat_template)
    except UserError:
        for number, place, values in rows:
            try:
                tok.encode_prompts([values[cfg.prompt_column]], cfg.chat_template)
            except UserError as e:
                raise UserError(f"{reading.ds.where(number, place)}: {e}") from None
        raise


def _write_part(out: str, tok, cfg: RolloutConfig, kept, meta: dict, batch: Batch, completions) -> None:
    """Publish the part of a chunk (``batch``): its rows' responses, decoded, as a Parquet file.
    ``kept``: the kept columns' schema (each column's one type over the prompts, so every part agrees)."""
    index, rows = batch.tag
    n = cfg.sampling.samples_per_prompt
    of = [i // n for i in range(len(completions))]  # each response's row in the chunk
    ids = [str(row[cfg.id_column]) for row in rows] if cfg.id_column else list(map(str, batch.keys))
    stored = [toklib.render_prompt(row[cfg.prompt_column]) for row in rows]
    cols = {contract.PROMPT_ID: [ids[r] for r in of], contract.SAMPLE_INDEX: [i % n for i in range(len(of))],
            contract.PROMPT: [stored[r] for r in of], contract.PROMPT_TOKEN_IDS: [batch.prompts[r] for r in of],
            contract.RESPONSE: tok.decode([c.tokens for c in completions]),
            contract.RESPONSE_TOKEN_IDS: [c.tokens for c in completions],
            contract.RESPONSE_LOGPROBS: [c.logprobs for c in completions],
            contract.FINISH_REASON: [c.finish_reason for c in completions]}
    typed = {k: pa.array([rows[r][k] for r in of], type=kept.field(k).type) for k in cfg.keep_columns}
    contract.write_part(out, contract.part_name(index), contract.rollout_table(cols, typed, meta))


class _Progress:
    """A progress line on rank 0 (``enabled``): chunks done and new tokens per second; the first
    tokens marked in ``spans``."""

    def __init__(self, enabled: bool, spans: _Spans):
        from rich.progress import Progress, TextColumn, TimeElapsedColumn

        self.spans, self.count, self.t0 = spans, 0, time.perf_counter()
        self.bar = Progress(TextColumn("rollout"), TextColumn("{task.fields[chunks]} chunks"),
                            TextColumn("{task.completed} new tokens"), TextColumn("{task.fields[rate]} tok/s"),
                            TimeElapsedColumn(), transient=False, disable=not enabled)
        self.task = self.bar.add_task("rollout", total=None, chunks=0, rate="-")
        self.bar.start()

    def tokens(self, n: int) -> None:
        if n and not self.count:
            self.spans.mark("first_tokens")
        self.count += n
        rate = self.count / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, completed=self.count, rate=f"{rate:,.0f}")

    def chunks(self, done: int) -> None:
        self.bar.update(self.task, chunks=done)


if __name__ == "__main__":
    job.main(RolloutConfig, run)
