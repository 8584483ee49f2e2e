"""What a ppo leaves in its process for the next ppo of the run, in a resident worker
(docs/cluster.md): each role's model and optimizer as it published them, which the next ppo starts
from instead of reading back its inputs; and the reference model it read, parked in host memory
(the update's GPU memory is what it would be without it), which the next ppo runs instead of
reading it again. Files stay the contract: it is taken only when the next ppo's inputs are exactly
what was published from it (each role's weights and training state, the reference checkpoint: the
same files, ``_published``), at the same step, layout, rank, dtypes and optimizer settings, by every rank, and only
where reading the files back gives the same numbers (fp32 parameters are their own masters: then
only when the weights are stored in fp32 too).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from llamarl.lib.distributed import collectives
from llamarl.lib.distributed.parallel import Topology
from llamarl.lib.errors import UserError
from llamarl.lib.files import publish
from llamarl.lib.model.offload import ParamOffload
from llamarl.lib.runtime import job
from llamarl.stages import contract

MAX_SHARE_OF_DEVICE = 1 / 3
"""The most of its GPU's memory that what is kept may hold between stages (the rollout beside
needs the rest); beyond it, the next ppo reads its files."""
MAX_SHARE_OF_HOST = 1 / 4
"""The most of the host's available memory that the reference models parked there by a node's
workers may take (the page cache of the run's writes needs the rest); beyond it, each ppo reads
its reference."""


@dataclass
class Kept:
    """A role's model and optimizer (``optim.ShardedAdamW``) as published under ``weights`` and
    ``train_state`` (each ``(url, what it holds)``: ``_published``)."""

    model: torch.nn.Module
    opt: object
    weights: tuple[str, str]
    train_state: tuple[str, str]


_kept: tuple[tuple, dict[str, Kept]] | None = None  # (where it was made, each role's)
_reference: tuple[tuple, tuple[str, str | None], ParamOffload] | None = None  # (where, its checkpoint, the model)
reference_from: str | None = None  # where the last ``take_reference``'s stage got its reference model: for its summary


def can_keep(trainers: dict, store_dtype: torch.dtype) -> bool:
    """Whether ``keep`` may keep ``trainers``, published as ``store_dtype``: not fp32 parameters from
    lower-precision weights (a reread rounds them, memory would not), nor what would crowd the
    device."""
    if not all(t.opt.separate_masters for t in trainers.values()) and store_dtype != torch.float32:
        return False
    return _fits([t.opt for t in trainers.values()])


def will_keep(trainers: dict, store_dtype: torch.dtype) -> bool:
    """Collective: whether every rank, a resident worker, ``can_keep`` ``trainers`` — else the next
    ppo reads their training state, which must then be written."""
    return all(collectives.all_gather_object(job.resident() and can_keep(trainers, store_dtype)))


def refuse_unwritten(states: list[str], kept: dict | None) -> None:
    """A one-line refusal when one of the training states a ppo starts from was published as not
    written (``publish.unwritten``) and nothing was ``kept``: it was in a worker that is gone."""
    unwritten = next((url for url in states if publish.unwritten(url)), None)
    if kept is None and unwritten is not None:
        raise UserError(contract.unwritten_train_state(unwritten))


def keep(out: str, trainers: dict, where: tuple) -> None:
    """After the ppo's outputs are published: keep each role's model and optimizer for the next
    ppo, made ``where`` (``place``'s) — only where ``can_keep``, which the caller asks first."""
    global _kept
    _kept = where, {name: Kept(t.model, t.opt, _published(f"{out}/{name}"),
                               _published(f"{out}/{contract.TRAIN_STATE}/{name}"))
                    for name, t in trainers.items()}


def take(wanted: dict[str, tuple[str, str | None]], where: tuple, topo: Topology) -> dict[str, Kept] | None:
    """Collective: each role's kept model and optimizer when every rank holds them for exactly
    ``wanted`` (per role: its weights' URL and its training state's, None without one), made
    ``where``; bound to this stage's process groups ``topo``. None otherwise (all ranks read files);
    what was kept is let go either way."""
    global _kept
    kept, _kept = _kept, None
    mine = kept is not None and kept[0] == where and set(kept[1]) == set(wanted) and all(
        k.weights == _published(wanted[name][0]) and wanted[name][1] is not None
        and k.train_state == _published(wanted[name][1]) for name, k in kept[1].items())
    if not all(collectives.all_gather_object(mine)):
        return None
    for k in kept[1].values():
        _bind(k, topo)
    return kept[1]


def keep_reference(url: str, model: torch.nn.Module, where: tuple) -> None:
    """After its forward pass: the reference model read from ``url``, made ``where``
    (``model_place``'s), parked in host memory for the next ppo — in a resident worker only (a
    stage process's memory ends with it), and only while the worker's ranks' copies take at most
    ``MAX_SHARE_OF_HOST`` of the host's available memory."""
    global _reference
    _reference = None
    if job.resident() and _fits_host(model):
        parked = ParamOffload(model, next(model.parameters()).device)
        parked.to_host()
        _reference = (where, _published(url), parked)


def take_reference(url: str, where: tuple, topo: Topology) -> torch.nn.Module | None:
    """Collective: the kept reference model, back on its device, when every rank holds it for
    ``url`` as published now, made ``where``, bound to this stage's groups ``topo``; None
    otherwise (all ranks read it)."""
    global _reference, reference_from
    kept, _reference, reference_from = _reference, None, "files"
    mine = kept is not None and kept[0] == where and kept[1] == _published(url)
    if not all(collectives.all_gather_object(mine)):
        return None
    kept[2].to_device()
    _bind_model(kept[2].model, topo)
    reference_from = "memory"
    return kept[2].model


def _fits_host(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters, once for each rank on this host, take at most
    ``MAX_SHARE_OF_HOST`` of its available memory (``MemAvailable``: free, or page cache the kernel
    can drop; where /proc/meminfo does not say: yes)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return ranks * sum(p.numel() * p.element_size() for p in model.parameters()) <= MAX_SHARE_OF_HOST * available


def model_place(layout, model_cfg, dtype, topo: Topology) -> tuple:
    """Everything a kept model depends on besides its checkpoint: rank, layout, model, dtype, device."""
    return (topo.tp, topo.pp, topo.dp, topo.tp_rank, topo.pp_rank, topo.dp_rank, layout, model_cfg, str(dtype),
            str(torch.cuda.current_device() if torch.cuda.is_available() else "cpu"))


def place(cfg, layout, model_cfg, dtype, topo: Topology, step: int) -> tuple:
    """Everything the kept state depends on besides its inputs: ``model_place``'s, the
    optimizer's settings and the step it reached."""
    return (*model_place(layout, model_cfg, dtype, topo), tuple(cfg.betas), cfg.weight_decay, step)


def _published(url: str) -> tuple[str, str | None]:
    """``url`` and what it holds: its files (each one's bytes and checksum), kind and step; not its
    output id, which a remake that comes out as it was takes back (pipeline/remakes.py) while it
    holds the same files, which the state kept made."""
    manifest = publish.read_manifest(url)
    if manifest is None:
        return url.rstrip("/"), None
    held = {k: manifest.get(k) for k in ("kind", "role", "step", "files", "train_state")}
    return url.rstrip("/"), hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()


def _fits(opts: list) -> bool:
    """On a GPU, whether the models and optimizer states take at most ``MAX_SHARE_OF_DEVICE`` of it."""
    device = opts[0].device
    if device.type != "cuda":
        return True
    held = 0
    for opt in opts:
        held += sum(p.numel() * p.element_size() for p in opt.params.values())
        held += sum(t.numel() * t.element_size() for st in opt.inner.state.values() for t in st.values()
                    if torch.is_tensor(t))
        if opt.separate_masters:
            held += sum(m.numel() * m.element_size() for m in opt.master.values())
    return held <= MAX_SHARE_OF_DEVICE * torch.cuda.get_device_properties(device).total_memory


def _bind(k: Kept, topo: Topology) -> None:
    """The model and optimizer on this stage's process groups: the last stage's are gone."""
    _bind_model(k.model, topo)
    k.opt.topo = topo
    k.opt.dp_group = topo.groups.dp if topo.dp > 1 else None


def _bind_model(model: torch.nn.Module, topo: Topology) -> None:
    for module in model.modules():
        if hasattr(module, "tp_group"):
            module.tp_group = topo.groups.tp
        if hasattr(module, "topology"):
            module.topology = topo
