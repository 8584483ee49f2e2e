"""The ppo update's micro-batches: each one's packed tokens (a ``TokenBatch``) and what its loss
reads per token, built on the host and put on the device, a step ahead (``StepBatches``).

The host that builds them also launches the GPU's work, and at a few thousand tokens a
micro-batch it is the host, not the GPU, that sets the update's pace (docs/training.md, "Where
the ppo update stands"). So on a remove-padding model (the default) a micro-batch is built from
its samples' lengths with numpy, crosses to the device in one copy, and each per-token input
from the stage's ``[samples, width]`` tensors is one gather there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from llamarl.lib.model.batch import TokenBatch
from llamarl.lib.rl import core as rl
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_data import Sample, micro_batches, padded

DATA_KEYS = ("old_logp", "ref_logp", "adv", "values", "returns")
"""What a loss reads of ``ppo_data.advantages``' tensors, where they exist (and ``tis`` with TIS)."""

_ALIGN = 16  # bytes: every tensor in a one-copy buffer starts at a boundary any dtype can view


def _on(dev, x):
    """``x``, built on the host — a tensor, or a dataclass of them such as a ``TokenBatch`` — on
    ``dev``. To a GPU from pinned memory, without waiting: a copy from pageable memory would wait
    for everything queued on the device before it, once per tensor."""
    if torch.is_tensor(x):
        return x.pin_memory().to(dev, non_blocking=True) if torch.device(dev).type == "cuda" else x.to(dev)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _on(dev, getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
    return x


def _one_copy(dev, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host ``tensors`` on ``dev`` through one buffer and one copy (pinned, not waited for, to a
    GPU): each at an aligned offset, viewed back with its dtype and shape."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes]).tolist()
    cuda = torch.device(dev).type == "cuda"
    host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=cuda)
    staged = host.numpy()
    for t, o, n in zip(tensors, offsets, sizes):
        staged[o : o + n] = t.contiguous().view(-1).view(torch.uint8).numpy()
    buf = host.to(dev, non_blocking=True) if cuda else host
    return [buf[o : o + n].view(t.dtype).view(t.shape) for t, o, n in zip(tensors, offsets, sizes)]


def per_token_masks(batch: TokenBatch, resp: torch.Tensor) -> dict:
    """What a micro-batch's loss share reads (``Aggregation``), in ``batch``'s token order: the
    response mask ``resp [B, S]``, each token's sequence, and the number of sequences (the rows,
    known here on the host)."""
    return {"resp": batch.flat(resp), "seq": batch.flat(rl.sequence_index(resp)), "sequences": resp.shape[0]}


def padded_micro_batch(model, samples: list[Sample], dev) -> tuple[TokenBatch, dict, int]:
    """``samples`` as one micro-batch for ``model`` through its padded form, for any layout: its
    ``TokenBatch``; in its token order each token's label and ``per_token_masks``; and its padded
    width. Built on the host, where the lengths are known, then copied."""
    ids, mask, labels, resp = padded(samples, "cpu")
    batch = model.make_batch(ids, mask)
    per_token = {"labels": batch.flat(labels), **per_token_masks(batch, resp)}
    return _on(dev, batch), {k: _on(dev, v) for k, v in per_token.items()}, ids.shape[1]


def packed_micro_batch(model, samples: list[Sample], rows: list[int], widths: set[int],
                       dev) -> tuple[TokenBatch, dict, dict[int, torch.Tensor]]:
    """What ``padded_micro_batch`` gives (its ``TokenBatch`` and per-token inputs, equal to the
    tensor), for a remove-padding model, from the lengths; and for each width in ``widths`` each
    real token's index into a flattened ``[samples, width]`` tensor (its sample ``rows[b]``, its
    position), on ``dev``."""
    ids = [np.asarray(s.ids, dtype=np.int64) for s in samples]
    batch = model.make_batch_of_rows(ids)
    n, pad = batch.num_real, batch.num_tokens - batch.num_real
    lens = np.array([len(x) for x in ids], dtype=np.int64)
    width = int(lens.max())
    row = np.repeat(np.arange(len(ids)), lens)
    pos = batch.positions.numpy()[:n]
    flat_ids = batch.input_ids.numpy()[:n]
    # A token's label is the next one of its row, as torch.roll over the padded row gives it: after
    # a row's last token comes padding (0), or, in a row as wide as the batch, its first token.
    ends = np.cumsum(lens) - 1
    starts = ends + 1 - lens
    labels = np.zeros(n + pad, dtype=np.int64)
    labels[: n - 1] = flat_ids[1:]
    labels[ends] = np.where(lens == width, flat_ids[starts], 0)
    # Responses at positions prompt_len - 1 … len - 2 (ppo_data.response_mask's slice).
    first = np.array([s.prompt_len - 1 if s.prompt_len >= 1 else width - 1 for s in samples], dtype=np.int64)
    in_response = (pos >= first[row]) & (pos < lens[row] - 1)
    resp = np.zeros(n + pad, dtype=np.float32)
    resp[:n] = in_response
    seq = np.zeros(n + pad, dtype=np.int64)
    seq[:n] = np.where(in_response, row, -1)
    sample = np.asarray(rows, dtype=np.int64)[row]
    index = {w: sample * w + pos for w in sorted(widths)}
    host = [batch.input_ids, batch.positions, batch.meta.cu_seqlens, batch.mask, batch.valid_index,
            *(torch.from_numpy(a) for a in (labels, resp, seq, *index.values()))]
    ids_d, pos_d, cu_d, mask_d, valid_d, labels_d, resp_d, seq_d, *index_d = _one_copy(dev, host)
    on_dev = dataclasses.replace(batch, input_ids=ids_d, positions=pos_d, mask=mask_d, valid_index=valid_d,
                                 meta=dataclasses.replace(batch.meta, cu_seqlens=cu_d))
    per_token = {"labels": labels_d, "resp": resp_d, "seq": seq_d, "sequences": len(samples)}
    return on_dev, per_token, dict(zip(index, index_d))


def step_batches(model, samples: list[Sample], groups: list[list[int]], data: dict[str, torch.Tensor] | None,
                 dev) -> tuple[list[TokenBatch], list[dict]]:
    """The micro-batches of ``groups`` and what each one's loss (or per-token output) reads: the
    per-token tensors above and, with ``data`` (``[samples, width]`` tensors by name; None off the
    last pipeline stage, and for a frozen pass), its samples' values of each in its token order."""
    data = data or {}
    widths = {t.shape[1] for t in data.values()}
    flat = {k: t.reshape(-1) for k, t in data.items()}
    batches, extras = [], []
    for g in groups:
        chosen = [samples[i] for i in g]
        if model.layout.remove_padding:
            batch, per_token, index = packed_micro_batch(model, chosen, g, widths, dev)
            pad = batch.num_tokens - batch.num_real
            for k, t in data.items():
                x = flat[k][index[t.shape[1]]]
                per_token[k] = torch.cat([x, x.new_zeros(pad)]) if pad else x
        else:
            batch, per_token, width = padded_micro_batch(model, chosen, dev)
            rows = _on(dev, torch.tensor(g))
            per_token.update({k: batch.flat(t[rows, :width]) for k, t in data.items()})
        batches.append(batch)
        extras.append(per_token)
    return batches, extras


class StepBatches:
    """Each optimizer step's micro-batches, built one step ahead: ``ahead`` builds the next step's
    on the host (and queues their copies) while the device still runs this one, so the device does
    not wait for the host between steps."""

    def __init__(self, cfg: PPOConfig, actor, samples: list[Sample], data: dict | None, dev):
        self.cfg, self.actor, self.samples, self.dev = cfg, actor, samples, dev
        keys = [k for k in DATA_KEYS if data and k in data] + (["tis"] if cfg.uses_tis() else [])
        # Contiguous once, so that each micro-batch's gathers read them in place.
        self.data = {k: data[k].contiguous() for k in keys} if data is not None else None
        self._held: tuple[list[int], tuple] | None = None

    def ahead(self, batch_idx: list[int]) -> None:
        self._held = (batch_idx, self._build(batch_idx))

    def get(self, batch_idx: list[int]) -> tuple[list[list[int]], list[TokenBatch], list[dict]]:
        """This rank's sample groups of the mini-batch ``batch_idx``, their micro-batches and extras."""
        held, self._held = self._held, None
        return held[1] if held is not None and held[0] == batch_idx else self._build(batch_idx)

    def _build(self, batch_idx: list[int]) -> tuple:
        topo = self.actor.topology
        groups = micro_batches(batch_idx[topo.dp_rank :: topo.dp], self.samples, self.cfg.micro_batch_tokens)
        return (groups, *step_batches(self.actor, self.samples, groups, self.data, self.dev))
