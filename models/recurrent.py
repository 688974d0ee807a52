"""Recurrent layers that ``vmap`` can batch: ``nn.RNN``/``nn.GRU``/``nn.LSTM`` hand-unrolled.

In torch 2.13 ``vmap(grad)`` fails on ``nn.GRU`` and ``nn.RNN`` and runs ``nn.LSTM`` through a
slow fallback (the fused kernels have no batching rule). These subclasses keep the stock
parameters (same names, shapes and initialisation, so a ``state_dict`` moves freely between
them and the stock layers) and compute the same equations step by step with ``F.linear``,
which ``vmap`` batches. They are always batch-first and return the output sequence only.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

Cell = tuple[torch.Tensor, torch.Tensor | None]


class _Unrolled(nn.RNNBase):
    """Shared loop over layers, directions and steps; subclasses give the cell."""

    vmap_safe: ClassVar[bool] = True  # the registry keeps these on the vmap route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__.removeprefix('Sequence')} expects "
                             f"[batch, steps, {self.input_size}]; got {list(x.shape)}")
        for k in range(self.num_layers):
            outs = []
            for suffix in ("", "_reverse")[: 2 if self.bidirectional else 1]:
                seq = x.flip(1) if suffix else x
                out = self._direction(seq, k, suffix)
                outs.append(out.flip(1) if suffix else out)
            x = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return x

    def _direction(self, seq: torch.Tensor, k: int, suffix: str) -> torch.Tensor:
        def weight(name: str) -> torch.Tensor | None:
            return getattr(self, f"{name}_l{k}{suffix}", None)

        w_ih, w_hh = weight("weight_ih"), weight("weight_hh")
        assert w_ih is not None and w_hh is not None
        b_hh = weight("bias_hh")
        gates_in = F.linear(seq, w_ih, weight("bias_ih"))  # every step at once
        w_hr = weight("weight_hr")
        h = seq.new_zeros((seq.shape[0], w_hr.shape[0] if w_hr is not None else self.hidden_size))
        c = seq.new_zeros((seq.shape[0], self.hidden_size)) if self.mode == "LSTM" else None
        steps = []
        for t in range(seq.shape[1]):
            h, c = self._cell(gates_in[:, t], F.linear(h, w_hh, b_hh), h, c)
            if w_hr is not None:
                h = F.linear(h, w_hr)
            steps.append(h)
        return torch.stack(steps, 1)

    def _cell(self, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor | None) -> Cell:
        """One step from the input part ``gi`` and hidden part ``gh`` of the gates."""
        raise NotImplementedError


class SequenceRNN(_Unrolled, nn.RNN):  # type: ignore[misc]
    """``nn.RNN(batch_first=True)``: h' = act(W_ih x + b_ih + W_hh h + b_hh)."""

    def _cell(self, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor | None) -> Cell:
        pre = gi + gh
        return (torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)), None


class SequenceGRU(_Unrolled, nn.GRU):  # type: ignore[misc]
    """``nn.GRU(batch_first=True)``; gate rows in torch's order (reset, update, new)."""

    def _cell(self, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor | None) -> Cell:
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None


class SequenceLSTM(_Unrolled, nn.LSTM):  # type: ignore[misc]
    """``nn.LSTM(batch_first=True)``; gate rows in torch's order (input, forget, cell, output)."""

    def _cell(self, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
              c: torch.Tensor | None) -> Cell:
        assert c is not None
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
