"""Sampling from vocab-parallel logits, each sequence drawing from its own random stream.

Keyed streams (a response's uniforms are a pure function of its key, the step and the global
vocabulary index), Gumbel-max, and under TP five numbers per row gathered instead of the
vocabulary: why each holds, and the measurements, docs/generation.md "Sampling". The log-prob
returned is under ``softmax(logits / temperature)`` without top-k / top-p: the distribution PPO trains.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from llamarl.lib.distributed.parallel import group_size
from llamarl.lib.errors import UserError
from llamarl.lib.model import mappings

_M32 = 0xFFFFFFFF

# Names the draw algorithm (hash, uniforms, Gumbel-max): recorded with every rollout, so a change
# to any of them redoes old rollouts instead of mixing two algorithms' rows. Bump it with them.
SAMPLER = "keyed-gumbel-1"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # EOS and any other stop tokens

    def check(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---- the random streams ----------------------------------------------------------------------

def _mix(x):
    """A 32-bit integer finaliser (Wellons' lowbias32, hash-prospector constants), on Python ints
    or int64 tensors holding values below 2^32. Both multipliers are below 2^31, so no product
    reaches 2^63: no overflow anywhere, the same bits on every device and in compiled code."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def sequence_keys(seed: int, keys, samples: int = 1, device=None) -> torch.Tensor:
    """``[len(keys) * samples, 2]`` int64 stream keys, prompt-major (key 0's samples first): the
    two 32-bit words naming the random stream of each response ``s`` of each prompt ``k``."""
    digests = [hashlib.sha256(f"{seed}:{k}:{s}".encode()).digest() for k in keys for s in range(samples)]
    words = [(int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")) for d in digests]
    return torch.tensor(words, dtype=torch.int64, device=device).reshape(-1, 2)


def uniforms(keys: torch.Tensor, steps: torch.Tensor, vocab_index: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in (0, 1), ``[rows, len(vocab_index)]``: row r's stream at token index
    ``steps[r]``, one per global vocabulary index. Two rounds with two 32-bit row words, so two
    rows never share a (shifted) run of values."""
    s = steps & _M32
    r1 = _mix(keys[:, 0] ^ _mix(s))
    r2 = _mix(keys[:, 1] ^ _mix(s ^ 0x5BD1E995))
    h = _mix(_mix(vocab_index[None, :] ^ r1[:, None]) ^ r2[:, None])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


# ---- the draw --------------------------------------------------------------------------------

def _row_stats(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, lo: torch.Tensor,
               vocab_start: int, temperature: float) -> torch.Tensor:
    """This shard's part of the draw: ``[rows, 5]`` fp64 — best perturbed logit, its global token
    id, max logit, sum of ``exp(logit - max)``, the best token's logit; logits at
    ``temperature`` (1 when greedy, then unperturbed). Tokens whose logit is below ``lo`` are not
    drawn. ``_kernel`` is the same arithmetic in one pass."""
    raw = logits.float()
    greedy = temperature == 0
    x = raw if greedy else raw / temperature
    if greedy:
        y = x
    else:
        idx = torch.arange(x.shape[-1], device=x.device) + vocab_start
        y = x - torch.log(-torch.log(uniforms(keys, steps, idx)))
    y = torch.where(raw >= lo[:, None], y, float("-inf"))
    best, arg = y.max(-1)
    m = x.max(-1).values
    s = torch.exp(x - m[:, None]).sum(-1)
    xa = x.gather(-1, arg[:, None]).squeeze(-1)
    return torch.stack([best.double(), (arg + vocab_start).double(), m.double(), s.double(), xa.double()], -1)


# ---- the per-shard pass as one Triton kernel (CUDA) ---------------------------------------------


@functools.cache
def _kernel():
    """``lib/engine/sampler_kernel.py``'s kernel, compiled on first use; None without Triton (imported
    here, not at import time, so that importing lib/ never imports Triton)."""
    try:
        from llamarl.lib.engine import sampler_kernel
    except ImportError:
        return None
    return sampler_kernel.row_stats_kernel


def fused_available() -> bool:
    """Whether ``sample(..., fused=True)`` can run here (Triton is importable)."""
    return _kernel() is not None


SPLIT_COLS = 16384  # columns of a row one program of the kernel reads: 8 programs a row of Llama 3's vocabulary
_BLOCK = 2048  # columns a program reads at a time (SPLIT_COLS is a multiple)


def _fused_row_stats(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, lo: torch.Tensor,
                     vocab_start: int, temperature: float) -> torch.Tensor:
    """``_row_stats`` of each split of ``SPLIT_COLS`` columns, ``[splits, rows, 5]`` in column
    order (combined as shards are), as one Triton kernel launch (capturable in a CUDA graph once
    compiled)."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, n = x.shape
    splits = max(1, -(-n // SPLIT_COLS))
    out = torch.empty(splits, rows, 5, dtype=torch.float64, device=x.device)
    if rows:
        _kernel()[(rows, splits)](x, x.stride(0), n, SPLIT_COLS, keys.contiguous(), steps.contiguous(),
                                  lo.float().contiguous(), out, vocab_start, float(temperature) or 1.0,
                                  GREEDY=temperature == 0, BLOCK=_BLOCK, num_warps=8)
    return out


def warm_up(params: SamplingParams, vocab: int, vocab_start: int, dtype: torch.dtype, device: torch.device,
            rows: int = 16) -> None:
    """Compile the fused per-shard pass for these logits on dummy inputs, so that the engine's
    first draw (and its CUDA graph capture) finds it compiled. Safe in a thread: the rollout stage
    compiles while it loads the weights."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the thread's current device (``set_device`` is per thread)
    with torch.no_grad():
        logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
        keys = torch.zeros(rows, 2, dtype=torch.int64, device=device)
        steps = torch.zeros(rows, dtype=torch.int64, device=device)
        lo = torch.full((rows,), float("-inf"), device=device)
        _fused_row_stats(logits, keys, steps, lo, vocab_start, params.temperature)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_gather(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[tp, *x.shape]``."""
    tp = group_size(group)
    return x[None] if tp == 1 else mappings.all_gather(x, group).view(tp, *x.shape)


def _ordered(f: torch.Tensor) -> torch.Tensor:
    """fp32 → int64 with the same order (negative floats' magnitude bits reversed)."""
    b = f.view(torch.int32).long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)


def _unordered(o: torch.Tensor) -> torch.Tensor:
    b = torch.where(o < 0, (-o - 1) | 0x80000000, o)
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def _nucleus_threshold(x: torch.Tensor, temperature: float, top_p: float, group: ProcessGroup | None) -> torch.Tensor:
    """Per row, the smallest logit top-p keeps, over vocab-parallel ``x [rows, vocab / tp]``: token
    j is kept when the mass of the tokens above it is below ``top_p``. That mass falls as the
    threshold rises, so bisection over the 2^32 fp32 values in order finds it: 33 all-reduces of
    ``[rows]``, never a gather or a global sort."""
    m = mappings.all_reduce(x.max(-1).values, group, dist.ReduceOp.MAX)
    p = torch.exp((x - m[:, None]) / temperature)
    p = p / mappings.all_reduce(p.sum(-1), group)[:, None]
    lo = _ordered(torch.full_like(m, float("-inf")))  # mass above it ≈ 1: not kept (top_p < 1)
    hi = _ordered(m)  # nothing above the maximum: kept
    for _ in range(33):
        mid = (lo + hi) // 2
        mass = mappings.all_reduce((p * (x > _unordered(mid)[:, None])).sum(-1), group)
        keep = mass < top_p
        hi, lo = torch.where(keep, mid, hi), torch.where(keep, lo, mid)
    return _unordered(hi)


def _threshold(x: torch.Tensor, params: SamplingParams, group: ProcessGroup | None) -> torch.Tensor | None:
    """Per row, the smallest *unscaled* logit top-k / top-p keep (None: no filter). Thresholds on
    the fp32 logits as they come, not divided by the temperature, so that the shard pass, compiled
    or not, compares the very same numbers (a compiled division may round differently)."""
    t = params.temperature
    if params.top_k:
        k = min(params.top_k, x.shape[-1])
        cand = _all_gather(x.topk(k, dim=-1).values, group)  # [tp, rows, k]: the only candidates
        cand = cand.permute(1, 0, 2).reshape(x.shape[0], -1)
        cand = cand.topk(min(params.top_k, cand.shape[-1]), dim=-1).values  # sorted, descending
        lo = cand[:, -1]
        if params.top_p < 1.0:
            # Top-p over the top-k set, renormalised: the mass of the tokens before each candidate.
            probs = torch.softmax(cand / t, dim=-1)
            kept = ((probs.cumsum(-1) - probs) < params.top_p).sum(-1)
            lo = cand.gather(-1, (kept - 1)[:, None]).squeeze(-1)
        return lo
    if params.top_p < 1.0:
        return _nucleus_threshold(x, t, params.top_p, group)
    return None


def sample(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, steps: torch.Tensor | int = 0, *,
           vocab_start: int = 0, group: ProcessGroup | None = None, fused: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of this rank's vocabulary slice ``logits [rows, vocab / tp]`` (which
    starts at global id ``vocab_start``; pass the model's TP group): ``keys [rows, 2]``
    (``sequence_keys``), ``steps`` each row's token index in its response. Returns (global token
    ids, fp32 log-probs), identical on every TP rank. ``fused``: the per-shard pass as one Triton
    kernel (``fused_available``); on a GPU what the engine runs, on CPU Triton's interpreter."""
    rows = logits.shape[0]
    if not torch.is_tensor(steps):
        steps = torch.full((rows,), steps, dtype=torch.int64, device=logits.device)
    lo = None
    if not params.greedy and (params.top_k or params.top_p < 1.0):
        lo = _threshold(logits.float(), params, group)
    if lo is None:
        lo = torch.full((rows,), float("-inf"), device=logits.device)
    if fused:
        stats = _fused_row_stats(logits, keys, steps, lo, vocab_start, params.temperature)
    else:
        stats = _row_stats(logits, keys, steps, lo, vocab_start, params.temperature)[None]
    parts = _all_gather(stats, group).view(-1, rows, 5)  # [tp × splits, rows, 5], in column order
    win = parts[..., 0].argmax(0)  # the first part holding the largest: the global argmax's
    best = parts.gather(0, win[None, :, None].expand(1, rows, 5))[0]
    top = parts[..., 2].max(0).values
    lse = top + torch.log((parts[..., 3] * torch.exp(parts[..., 2] - top)).sum(0))
    return best[:, 1].long(), (best[:, 4] - lse).float()
