"""DSpark's context rings (models/dspark.py): per request slot and draft stage, the context rows
of the request's last `window` committed positions.

A context row of position p is stage s's kv_norm(wkv(main_x)) with RoPE at p, main_x from the
target features of the step that ran p (DSparkDrafter.context_rows). Slot q holds position p
at row q * W + p % W, with its position in `pos` (-1: none), so a drafting step reads the W
rows of its slot and keeps those in [anchor - W, anchor) (DSparkDrafter.propose). Only
committed positions are written (after a verify, the accepted ones), so a row is never
overwritten by a rejected draft: W rows suffice. Saved prefixes (prefix caching) keep a copy
of the W rows; the row after the last one is a trash row for the writes a step drops.
"""
from __future__ import annotations

import torch


class DSparkRings:
    def __init__(self, stages: int, window: int, dim: int, num_slots: int, num_saved: int, dtype: torch.dtype,
                 device):
        self.window, self.num_slots = window, num_slots
        n = (num_slots + num_saved) * window + 1
        self.rows = torch.zeros(stages, n, dim, dtype=dtype, device=device)
        self.pos = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.trash = n - 1

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.pos.numel() * self.pos.element_size()

    def _block(self, q: int) -> slice:
        return slice(q * self.window, (q + 1) * self.window)

    def reset(self, slot: int) -> None:
        """A slot taken by a new request holds no row yet."""
        self.pos[self._block(slot)] = -1

    def write(self, rows: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Store per stage rows [M, D] of positions [M] of requests in slots [M] where keep [M]
        (bool); the kept rows must hold distinct (slot, position % W) (at most the last W
        positions of a request per call)."""
        W = self.window
        idx = torch.where(keep, slots * W + positions % W, torch.full_like(positions, self.trash))
        for s, r in enumerate(rows):
            self.rows[s, idx] = r.to(self.rows.dtype)
        self.pos[idx] = positions

    def gather(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """slots [B] -> (per stage the rows [B, W, D], their positions [B, W], -1: none)."""
        idx = slots[:, None] * self.window + torch.arange(self.window, device=slots.device)
        return [self.rows[s, idx] for s in range(self.rows.shape[0])], self.pos[idx]

    def save(self, slot: int, k: int) -> None:
        """Copy slot's rows to saved prefix k."""
        dst = self._block(self.num_slots + k)
        self.rows[:, dst] = self.rows[:, self._block(slot)]
        self.pos[dst] = self.pos[self._block(slot)]

    def load(self, k: int, slot: int) -> None:
        """Copy saved prefix k's rows to slot."""
        src = self._block(self.num_slots + k)
        self.rows[:, self._block(slot)] = self.rows[:, src]
        self.pos[self._block(slot)] = self.pos[src]
