"""Error feedback: the worker keeps what compression dropped and adds it to the next update.

With a lossy codec ``C``, sending ``C(g_t)`` every round loses ``g_t - C(g_t)`` for good, and
a biased codec (top-k, nearest rounding) loses it in the same direction every time. Error
feedback (Seide et al., "1-bit SGD", 2014; Stich et al., "Sparsified SGD with Memory", 2018;
Karimireddy et al., "Error Feedback Fixes SignSGD", 2019) sends ``C(g_t + e_t)`` and keeps
``e_{t+1} = g_t + e_t - decode(C(g_t + e_t))``, so the sum of what was sent tracks the sum
of the true updates to within one residual.

Usage, per tensor key (e.g. a parameter name)::

    c = ef.compensate(key, delta)             # delta + residual
    buf = codec.encode(c, generator=g)
    ef.update(key, c, decode(buf))            # residual = c - decoded

The residual lives in the worker, never in the codec, and must be dropped
(``reset``) when the worker's state is replaced by a resync, since it refers to updates of a
state the worker no longer has.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class ErrorFeedback:
    """Per-key float32 residuals. Not thread-safe; one instance per worker."""

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, t: torch.Tensor) -> torch.Tensor:
        """``t + residual(key)`` as a new float32 tensor (``t`` as float32 if none yet)."""
        r = self._residuals.get(key)
        if r is None:
            return t.detach().to(torch.float32, copy=True)
        if r.shape != t.shape:
            raise ValueError(
                f"error feedback for {key!r}: tensor shape {tuple(t.shape)} != residual shape {tuple(r.shape)}"
            )
        return torch.add(t.detach().to(device=r.device, dtype=torch.float32), r)

    def compensate_into(self, key: Hashable, t: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``t + residual(key)`` (``t`` if none yet) as float32 into ``out``, a CPU vector of
        t's size: `compensate` without a new tensor (the same elementwise add)."""
        r = self._residuals.get(key)
        if r is None:
            out.copy_(t.detach().reshape(-1))
            return
        if r.shape != t.shape:
            raise ValueError(
                f"error feedback for {key!r}: tensor shape {tuple(t.shape)} != residual shape {tuple(r.shape)}"
            )
        torch.add(t.detach().to(device=r.device, dtype=torch.float32).reshape(-1), r.reshape(-1), out=out)

    def store(self, key: Hashable, residual: torch.Tensor) -> None:
        """Keep ``residual`` (float32) as the residual of ``key``: held, not copied, so the caller
        must not change it in place afterwards (nothing here does: `compensate` and
        `compensate_into` read it, `update` and `store` replace it)."""
        if residual.dtype != torch.float32:
            raise ValueError(f"error feedback for {key!r}: a residual is float32, not {residual.dtype}")
        self._residuals[key] = residual.detach()

    def update(self, key: Hashable, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Store ``compensated - decoded`` as the residual of ``key``."""
        if compensated.shape != decoded.shape:
            raise ValueError(
                f"error feedback for {key!r}: compensated shape {tuple(compensated.shape)}"
                f" != decoded shape {tuple(decoded.shape)}"
            )
        self._residuals[key] = torch.sub(compensated.detach().float(), decoded.detach().to(compensated.device).float())

    def residual(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them (e.g. after a resync)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)
