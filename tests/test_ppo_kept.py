"""stages/ppo_kept.py: what a ppo leaves for the next one is taken only for exactly what it published
(output ids), where it was made, once; a state a reread would round is never kept. The whole path,
byte for byte against a process per stage: tests/test_resident.py."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import torch

from llamarl.lib.distributed import parallel
from llamarl.lib.files import publish
from llamarl.lib.runtime import job
from llamarl.stages import contract, ppo_kept


def _publish(url: str, files: dict | None = None) -> None:
    shutil.rmtree(url, ignore_errors=True)
    publish.prepare(url, lambda m: False)
    publish.publish(url, {"kind": "checkpoint", "files": files or {}, "at": time.time()})


def _trainer(separate_masters: bool = True):
    model = torch.nn.Linear(2, 2)
    opt = SimpleNamespace(separate_masters=separate_masters, device=torch.device("cpu"), params={}, inner=None,
                          master={}, topo=None, dp_group="old")
    return SimpleNamespace(model=model, opt=opt)


def _kept_ppo(tmp_path, trainer, where=("here",), store=torch.bfloat16) -> dict:
    out = str(tmp_path / "iter-001" / "ppo")
    _publish(f"{out}/{contract.ACTOR}")
    _publish(f"{out}/{contract.TRAIN_STATE}/{contract.ACTOR}")
    if ppo_kept.can_keep({contract.ACTOR: trainer}, store):
        ppo_kept.keep(out, {contract.ACTOR: trainer}, where)
    return {contract.ACTOR: (f"{out}/{contract.ACTOR}", f"{out}/{contract.TRAIN_STATE}/{contract.ACTOR}")}


def test_the_next_ppo_takes_exactly_what_the_last_published_once(tmp_path):
    trainer, topo = _trainer(), parallel.topology()
    wanted = _kept_ppo(tmp_path, trainer)
    kept = ppo_kept.take(wanted, ("here",), topo)
    assert kept[contract.ACTOR].model is trainer.model and kept[contract.ACTOR].opt is trainer.opt
    assert trainer.opt.topo is topo and trainer.opt.dp_group is None  # bound to this stage's groups
    assert ppo_kept.take(wanted, ("here",), topo) is None  # taken once


def test_nothing_is_taken_for_other_inputs_or_elsewhere(tmp_path):
    topo = parallel.topology()
    wanted = _kept_ppo(tmp_path, _trainer())
    assert ppo_kept.take(wanted, ("another layout",), topo) is None
    wanted = _kept_ppo(tmp_path, _trainer())
    _publish(wanted[contract.ACTOR][0], {"x": {"bytes": 1}})  # other weights published there since
    assert ppo_kept.take(wanted, ("here",), topo) is None
    wanted = _kept_ppo(tmp_path, _trainer())
    assert ppo_kept.take({**wanted, contract.CRITIC: (wanted[contract.ACTOR][0], None)}, ("here",), topo) is None
    wanted = _kept_ppo(tmp_path, _trainer())
    assert ppo_kept.take({contract.ACTOR: (wanted[contract.ACTOR][0], None)}, ("here",), topo) is None


def test_what_is_kept_is_taken_for_the_same_files_under_another_output_id(tmp_path):
    # A remake that comes out as it was puts its old manifests back (pipeline/remakes.py): another
    # id, the same files — which the kept state made.
    trainer, topo = _trainer(), parallel.topology()
    wanted = _kept_ppo(tmp_path, trainer)
    before = publish.output_id(wanted[contract.ACTOR][0])
    _publish(wanted[contract.ACTOR][0])
    assert publish.output_id(wanted[contract.ACTOR][0]) != before
    assert ppo_kept.take(wanted, ("here",), topo)[contract.ACTOR].model is trainer.model


def test_fp32_parameters_from_lower_precision_weights_are_not_kept(tmp_path):
    # fp32 parameters are their own masters; the next ppo reading bf16 weights would round them.
    wanted = _kept_ppo(tmp_path, _trainer(separate_masters=False), store=torch.bfloat16)
    assert ppo_kept.take(wanted, ("here",), parallel.topology()) is None
    wanted = _kept_ppo(tmp_path, _trainer(separate_masters=False), store=torch.float32)
    assert ppo_kept.take(wanted, ("here",), parallel.topology()) is not None


def test_a_ppo_that_takes_the_kept_state_verifies_only_the_checkpoints_it_reads(monkeypatch):
    from llamarl.stages import ppo

    verified = []
    monkeypatch.setattr(publish, "require_published", lambda root, kind: {"root": root})
    monkeypatch.setattr(ppo.outputs, "verify_input", lambda root, manifest, prefix: verified.append(root))
    monkeypatch.setattr(ppo, "verify_train_state", lambda url, manifest, checkpoint: verified.append(url))
    cfg = SimpleNamespace(actor="run/iter-001/ppo/actor", reference="run/shard/actor", critic=None)
    inputs = SimpleNamespace(critic=None, ref_source="forward",
                             states={contract.ACTOR: ("run/iter-001/ppo/train_state/actor", {})})
    ppo._verify_inputs(cfg, inputs, kept=False)
    assert verified == [cfg.actor, cfg.reference, "run/iter-001/ppo/train_state/actor"]
    verified.clear()
    ppo._verify_inputs(cfg, inputs, kept=True)  # the actor and its state come from memory
    assert verified == [cfg.reference]
    verified.clear()
    ppo._verify_inputs(cfg, SimpleNamespace(**{**vars(inputs), "ref_source": "rollout"}), kept=True)
    assert verified == []


def test_a_resident_worker_keeps_the_reference_model_for_the_next_ppo_of_the_same_checkpoint(tmp_path, monkeypatch):
    url, topo, model = str(tmp_path / "shard" / "actor"), parallel.topology(), torch.nn.Linear(2, 2)
    _publish(url)
    monkeypatch.setattr(job, "_resident", True)
    ppo_kept.keep_reference(url, model, ("here",))
    assert ppo_kept.take_reference(url, ("another layout",), topo) is None  # and what was kept is let go
    ppo_kept.keep_reference(url, model, ("here",))
    assert ppo_kept.take_reference(url, ("here",), topo) is model
    assert ppo_kept.take_reference(url, ("here",), topo) is None  # taken once: the ppo keeps it again
    ppo_kept.keep_reference(url, model, ("here",))
    _publish(url, {"x": {"bytes": 1}})  # another checkpoint published there since
    assert ppo_kept.take_reference(url, ("here",), topo) is None


def test_a_stage_process_keeps_no_reference_model(tmp_path, monkeypatch):
    url = str(tmp_path / "shard" / "actor")
    _publish(url)
    monkeypatch.setattr(job, "_resident", False)
    ppo_kept.keep_reference(url, torch.nn.Linear(2, 2), ("here",))
    assert ppo_kept.take_reference(url, ("here",), parallel.topology()) is None


def test_no_reference_is_parked_where_the_ranks_copies_would_crowd_the_host(tmp_path, monkeypatch):
    url = str(tmp_path / "shard" / "actor")
    _publish(url)
    monkeypatch.setattr(job, "_resident", True)
    monkeypatch.setattr(ppo_kept, "MAX_SHARE_OF_HOST", 0.0)
    ppo_kept.keep_reference(url, torch.nn.Linear(2, 2), ("here",))
    assert ppo_kept.take_reference(url, ("here",), parallel.topology()) is None
