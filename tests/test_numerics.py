"""Nothing non-finite is trained on or published, units: ppo's step check (each term named with its
likely cause, every rank agreeing), its schedule check, the scores' bound against ppo's arithmetic,
and metrics that stay valid JSON. The stages themselves: tests/test_faults.py (processes) and
tests/test_ppo.py (ranks)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from llamarl.lib.files import publish
from llamarl.lib.rl import core as rl
from llamarl.lib.errors import UserError
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_checks import StepCheck, check_schedule
from llamarl.stages.ppo_metrics import json_lines

NAN, INF = float("nan"), float("inf")


def _cfg(**kw) -> PPOConfig:
    return PPOConfig(rollout="r", scores="s", actor="a", out="o", **kw)


def _opt(largest: float, lr: float = 1e-6, dtype=torch.bfloat16):
    """What the check reads of a ShardedAdamW after its step."""
    return types.SimpleNamespace(param_dtype=dtype, lr=lr, largest_master=lambda: torch.tensor(largest))


def _refusal(check: StepCheck, when: str = "optimizer step 3") -> str:
    with pytest.raises(UserError) as e:
        check.verify(when)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_each_term_is_named_with_its_likely_cause():
    check = StepCheck(_cfg(), [-1e30, 1e30], "cpu")
    check.watch("value loss", torch.tensor([1.0, INF]))
    assert _refusal(check) == ("ppo optimizer step 3: value loss not finite; likely cause: the rewards' scale (scores "
                               "from -1e+30 to 1e+30, kl_coef=0.05), or a learning rate too high for the critic "
                               "(critic_lr=1e-05) in an earlier update; nothing was published")
    check.watch("advantages", torch.tensor(NAN))
    assert "before the first optimizer step: advantages not finite; likely cause: the rewards' scale" in _refusal(
        check, "before the first optimizer step")
    # The first term in the order a fault spreads (losses, gradients, weights); the others listed.
    check.watch("actor grad norm", torch.tensor(INF, dtype=torch.float64))
    check.watch_update("actor", _opt(NAN, lr=0.5))
    check.watch("policy loss", torch.tensor(NAN))
    assert _refusal(check).startswith("ppo optimizer step 3: policy loss not finite (also: actor grad norm, actor "
                                      "masters); likely cause: ")
    check.watch_update("actor", _opt(INF, lr=0.5, dtype=torch.float32))  # fp32 parameters and checkpoint
    assert _refusal(check).endswith("actor masters not finite; likely cause: the learning rate (actor_lr=1e-06, now "
                                    "0.5); lower it; nothing was published")


def test_a_step_judged_after_the_next_is_launched_names_its_own_learning_rate():
    # ppo reads a step once the next is launched (ppo_trainer.StepReads): what the next step
    # watches neither changes the verdict nor the cause named for the step before.
    check = StepCheck(_cfg(), [0.0, 1.0], "cpu")
    check.watch_update("actor", _opt(NAN, lr=0.5))
    flags, updates = check.take()
    check.watch_update("actor", _opt(1.0, lr=0.25))
    with pytest.raises(UserError) as e:
        check.judge("optimizer step 3", flags.tolist(), updates)
    assert str(e.value).startswith("ppo optimizer step 3: actor masters not finite") and "now 0.5)" in str(e.value)
    check.verify("optimizer step 4")


def test_masters_must_fit_the_dtypes_they_are_copied_and_stored_in():
    check = StepCheck(_cfg(), [0.0, 1.0], "cpu", stored=torch.float16)
    check.watch_update("critic", _opt(65504.0, dtype=torch.float32))  # float16's largest: fits
    check.verify("optimizer step 1")
    check.watch_update("critic", _opt(70000.0, dtype=torch.float32))
    assert "critic masters not finite or beyond float16" in _refusal(check)
    check = StepCheck(_cfg(), [0.0, 1.0], "cpu", stored=torch.float32)
    check.watch_update("actor", _opt(3.3e38))  # below bfloat16's largest, 3.39e38
    check.verify("optimizer step 1")
    check.watch_update("actor", _opt(3.4e38))  # an fp32 master a bf16 copy would make inf
    assert "actor masters not finite or beyond bfloat16" in _refusal(check)


def test_a_clean_step_passes_and_the_flags_start_again():
    check = StepCheck(_cfg(), [0.0, 1.0], "cpu")
    for term in ("policy loss", "entropy", "value loss", "actor grad norm"):
        check.watch(term, torch.tensor(1e30))  # large is not the check's business: finite is
    check.verify("optimizer step 1")
    check.watch("policy loss", torch.tensor(NAN))
    with pytest.raises(UserError):
        check.verify("optimizer step 2")
    check.verify("optimizer step 3")  # step 2's flag does not linger
    with pytest.raises(ValueError, match="'loss' is not a term of the step check"):
        check.watch("loss", torch.tensor(1.0))


def _flag_on_rank_one() -> str | None:
    import torch.distributed as dist

    check = StepCheck(_cfg(), [0.0, 1.0], "cpu")
    check.watch("policy loss", torch.tensor(0.5))
    if dist.get_rank() == 1:  # as the last pipeline stage alone holds the losses
        check.watch("value loss", torch.tensor(NAN))
    try:
        check.verify("optimizer step 7")
    except UserError as e:
        return str(e)
    return None


def test_a_flag_on_one_rank_stops_every_rank_with_the_same_line(pool2):
    lines = pool2.run(_flag_on_rank_one)
    assert lines[0] == lines[1] and lines[0].startswith("ppo optimizer step 7: value loss not finite;"), lines


def test_the_check_reads_nothing_back_before_verify(monkeypatch):
    # One read a step: the watches stay on the device (a read per tensor would stall a GPU).
    check = StepCheck(_cfg(), [0.0, 1.0], "cpu")
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    check.watch("policy loss", torch.tensor([0.5, 1.0]))
    check.watch("actor grad norm", torch.tensor(2.0, dtype=torch.float64))
    check.watch_update("actor", _opt(1.0))
    assert reads == []
    check.verify("optimizer step 1")
    assert reads == ["tolist"]


def test_an_iteration_past_the_decay_is_refused():
    cfg = _cfg(lr_decay="linear", total_steps=10, warmup_steps=2)
    check_schedule(cfg, 0, 12)
    check_schedule(cfg, 9, 4)  # step 10 still has a learning rate
    with pytest.raises(UserError, match=r"^a: this iteration's optimizer steps 11\.\.14 all come at or after "
                                        r"total_steps=10, where lr_decay='linear' has brought the learning rate to 0"):
        check_schedule(cfg, 10, 4)
    with pytest.raises(UserError):  # the critic's schedule decays alike
        check_schedule(_cfg(lr_decay="cosine", total_steps=10), 10, 4)
    check_schedule(_cfg(), 10**6, 4)  # constant: never 0


# ---- the scores' bound ------------------------------------------------------------------------------------


def _advantages(scores: torch.Tensor):
    """gae's path without a critic: the score at the last token, returns, whitening; and the value
    loss of a zero critic."""
    mask = torch.ones(len(scores), 3)
    adv = rl.returns_to_go(rl.token_rewards(scores, torch.zeros_like(mask), mask, 0.0), mask, 1.0)
    zero = torch.zeros_like(mask)
    return rl.whiten(adv, mask), rl.value_loss(zero, zero, adv, 0.2)


def test_the_scores_bound_is_what_ppos_float32_arithmetic_survives():
    spread = torch.tensor([1.0, -1.0, 1.0, 0.5])
    # Beyond it the whitening makes every advantage 0 and the value loss overflows: nothing is learnt.
    adv, value_loss = _advantages(spread * 1e30)
    assert (adv == 0).all() and value_loss.isinf().all()
    # At it every number stays finite and the advantages keep the scores' order.
    adv, value_loss = _advantages(spread * rl.MAX_ABS_SCORE)
    assert torch.isfinite(adv).all() and torch.isfinite(value_loss).all()
    assert torch.equal(adv[:, 0].argsort(), spread.argsort())
    assert torch.allclose(adv, _advantages(spread)[0], atol=1e-5)  # whitening removes the scale exactly


# ---- metrics stay valid JSON ----------------------------------------------------------------------------


def _strict(line: str) -> dict:
    def refuse(word):
        raise ValueError(f"{word} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_undefined_or_non_finite_metrics_are_null():
    rows = [{"step": 1, "policy_loss": NAN, "kl": INF, "value_loss": None, "tis": {"max": -INF}, "pair": (1.0, NAN)}]
    (line,) = json_lines(rows).decode().splitlines()
    assert _strict(line) == {"step": 1, "policy_loss": None, "kl": None, "value_loss": None, "tis": {"max": None},
                             "pair": [1.0, None]}


def test_the_runs_metrics_average_what_is_defined(tmp_path):
    # The run's metrics.jsonl from its ppo outputs: a step without a value loss (no critic: null) or
    # with a bare NaN (a ppo of an older version wrote them) is left out of the mean, and an
    # iteration with none is null.
    from llamarl.pipeline.metrics import update_metrics

    run = tmp_path / "run"
    for i, steps in enumerate([[{"kl": 0.5, "value_loss": None}, {"kl": 1.5, "value_loss": None}],
                               [{"kl": NAN, "value_loss": 2.0}, {"kl": 1.0, "value_loss": 4.0}]], start=1):
        ppo_dir = run / f"iter-{i:03d}" / "ppo"
        ppo_dir.mkdir(parents=True)
        (ppo_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))  # Python's own: NaN
        publish.publish(str(ppo_dir), {"kind": "ppo", "files": {},
                                       "summary": {"mean_score": 0.25 * i, "mean_response_length": 4.0}})
    update_metrics(str(run), 2)
    written = [_strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kl"], r["value_loss"]) for r in written] == [(1.0, None), (1.0, 3.0)], written
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"  # an iteration of no value loss plots as a gap
    # and `llamarl run` prints its table with a dash there
    import io

    from rich.console import Console

    from llamarl.pipeline.cli import _print_metrics

    out = io.StringIO()
    _print_metrics(Console(file=out, width=120), str(run), 2, None)
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert [line.split("│")[5].strip() for line in rows] == ["–", "3.0000"], out.getvalue()  # value loss
