"""TokenBatch: a padded ``[batch, seqlen]`` input as the flat token stream lib/ computes on
(``input_ids [N]``, ``positions [N]``), and back (``to_padded``). Remove-padding keeps only the
valid tokens, packed (varlen attention); otherwise every position stays, with a key mask. N is
rounded up to a multiple of TP under sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from llamarl.lib.model.attention import Packed, Padded


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    meta: Padded | Packed  # how the tokens form sequences, for attention
    mask: torch.Tensor  # [B, S] bool, True at real tokens
    valid_index: torch.Tensor | None  # packed: flat index into B*S of each packed token
    num_real: int  # tokens before sequence-parallel padding

    @classmethod
    def from_padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        remove_padding: bool = True,
        pad_to_multiple: int = 1,
    ) -> TokenBatch:
        """``position_ids`` default to each row's count of real tokens before it (so left padding
        keeps the positions a prompt would have alone)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seqlen], got shape {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if remove_padding:
            valid_index = mask.flatten().nonzero().squeeze(1)
            ids = input_ids.flatten()[valid_index]
            pos = position_ids.flatten()[valid_index]
            lens = mask.sum(1, dtype=torch.int32)
            cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=ids.device)
            cu[1:] = lens.cumsum(0)
            n = int(cu[-1])
            pad = -n % pad_to_multiple
            max_len = int(lens.max()) if len(lens) else 0
            if pad:
                # SP padding becomes one extra sequence of its own: it attends only to itself and
                # stays finite whatever the backend does with tokens outside cu_seqlens.
                cu = torch.cat([cu, cu.new_tensor([n + pad])])
                max_len = max(max_len, pad)
            meta = Packed(cu, max_len)
        else:
            valid_index = None
            ids, pos = input_ids.flatten(), position_ids.flatten()
            n = ids.numel()
            pad = -n % pad_to_multiple
            meta = Padded(mask)
        if pad:
            ids = torch.cat([ids, ids.new_zeros(pad)])
            pos = torch.cat([pos, pos.new_zeros(pad)])
        return cls(ids, pos, meta, mask, valid_index, n)

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray], *, pad_to_multiple: int = 1) -> TokenBatch:
        """The remove-padding batch ``from_padded`` makes of ``rows`` (int64 token ids) right-padded,
        positions from 0 in each, as host tensors; built from the rows' lengths with numpy rather
        than a dozen tensor ops over a padded copy (the ppo update builds one a micro-batch, on a
        host that also has to keep the GPU fed)."""
        lens = np.array([len(r) for r in rows], dtype=np.int64)
        width = int(lens.max()) if len(lens) else 0
        n = int(lens.sum())
        starts = np.cumsum(lens) - lens
        positions = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
        valid_index = positions + np.repeat(np.arange(len(rows), dtype=np.int64) * width, lens)
        pad = -n % pad_to_multiple
        cu = np.zeros(len(rows) + 1 + (1 if pad else 0), dtype=np.int32)
        cu[1 : len(rows) + 1] = np.cumsum(lens)
        if pad:  # as from_padded: SP padding is one extra sequence of its own
            cu[-1] = n + pad
        ids = np.zeros(n + pad, dtype=np.int64)
        if n:
            ids[:n] = np.concatenate(rows)
        mask = np.arange(width)[None, :] < lens[:, None]
        return cls(torch.from_numpy(ids), torch.from_numpy(np.concatenate([positions, np.zeros(pad, np.int64)])),
                   Packed(torch.from_numpy(cu), max(width, pad)), torch.from_numpy(mask),
                   torch.from_numpy(valid_index), n)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)

    def flat(self, per_position: torch.Tensor) -> torch.Tensor:
        """A ``[B, S, ...]`` tensor (labels, masks) in this batch's token order, length N."""
        x = per_position.reshape(-1, *per_position.shape[2:])
        x = x[self.valid_index] if self.valid_index is not None else x
        pad = self.num_tokens - x.shape[0]
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token results ``[N, ...]`` back to ``[B, S, ...]``; padding positions get 0."""
        b, s = self.shape
        x = x[: self.num_real]
        if self.valid_index is None:
            return x.reshape(b, s, *x.shape[1:])
        out = x.new_zeros((b * s, *x.shape[1:]))
        out = out.index_copy(0, self.valid_index, x)
        return out.view(b, s, *x.shape[1:])

    def last_token_index(self) -> torch.Tensor:
        """For each row, the index into the N tokens of its last real token."""
        b, s = self.shape
        cols = torch.arange(s, device=self.mask.device)
        last_col = torch.where(self.mask, cols, -1).amax(1)
        if (last_col < 0).any():
            raise ValueError("a row of attention_mask has no real token; every sequence needs at least one")
        if self.valid_index is None:
            return torch.arange(b, device=last_col.device) * s + last_col
        return self.meta.cu_seqlens[1 : b + 1].long() - 1
