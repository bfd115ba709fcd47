"""The simple gradient noise scale of McCandlish et al. 2018, measured from gradients a step already has.

The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (``G`` the true gradient, ``Sigma`` the
per-sample gradient covariance) is the global batch, in samples, around which a larger batch stops
paying for itself. A minibatch gradient of ``n`` samples has ``E|G_n|^2 = |G|^2 + tr(Sigma) / n``, so
two squared norms at two sizes ``b < B`` solve for both unknowns (the paper's appendix A.1):

    |G|^2      ~ (B * S_big - b * S_small) / (B - b)
    tr(Sigma)  ~ (S_small - S_big) / (1/b - 1/B)

with ``S_small`` the mean squared norm of one or more gradients of ``b`` samples and ``S_big`` the
squared norm of a gradient of ``B`` samples. Both are unbiased but noisy (the |G|^2 estimate is often
negative for one step), so :class:`NoiseScaleEstimator` keeps an exponential moving average of each
and reports the ratio of the averages; the average of per-step ratios would be biased and dominated by
the steps whose |G|^2 estimate is near 0.

Which gradients the trainer feeds (sizes in samples, i.e. sequences, like the global batch that the
growth functions compare the noise scale with; the gradients are each a mean per token, as the
trainer normalises them; pass tokens in both sizes instead to get the noise scale in tokens):

* This trainer shards with FSDP2 and reduce-scatters in *every* micro batch's backward (it never turns
  gradient sync off), so a rank's own gradient is never held whole and is not observable without an
  extra copy. What each rank holds right after the **first** micro batch's backward is its shard of
  that micro batch's gradient averaged over all ranks: the small batch, ``b = micro_batch x ranks``
  samples. Take its local squared norm there with :func:`squared_grad_norm` (only when the step has
  at least 2 micro batches, else there is no smaller batch), and the first micro batch's token count.
* After the last micro batch and the trainer's normalisation (``scale_grads`` by ranks / tokens),
  before clipping, the sharded gradients are the whole step's: the big batch, ``B`` = the step's
  samples over all ranks. Take its local squared norm there.
* Reduce the pair and the first micro batch's tokens in ONE all-reduce of a 3-element tensor. The
  squared norm of a sharded gradient is the sum over ranks of the local sums of squares, so this is
  exact. The first micro batch's gradient was still a sum over its tokens divided by the number of
  ranks (FSDP's average), so ``S_small = reduced_small * (ranks / tokens_first) ** 2``, ``S_big =
  reduced_big``. Then ``update(S_small, b, S_big, B)``.
* Where per-rank gradients are observable before any reduction (a single process, DDP under
  ``no_sync``), ``S_small`` may instead be the mean over ranks and micro batches of the per-rank
  micro-batch squared norms with ``b = micro_batch``: more small draws per step, the same expectation.

Cost per step: two sums of squares over the local gradient shards and one scalar all-reduce; never an
extra forward or backward, and no copy of a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_STATE_KEYS = ("ema_gradient_sq_norm", "ema_trace_sigma", "ema_weight", "updates", "skipped")


def _local_part(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``grad`` and how many ranks hold the same values, so that the sum over all ranks of
    ``|part|^2 / copies`` is the exact ``|grad|^2``.

    A DTensor contributes its local shard; a dimension of its mesh on which it is replicated holds the same
    values on every rank of that dimension, so its share is divided by that dimension's size. A pending
    reduction (``Partial``) is not a gradient yet and is refused.
    """
    if not isinstance(grad, DTensor):
        return grad, 1
    copies = 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError("squared_grad_norm: a gradient has a Partial placement (not reduced yet)")
        if placement.is_replicate():
            copies *= grad.device_mesh.size(dim)
    return grad.to_local(), copies


def squared_grad_norm(parameters: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The local sum of squares of the parameters' gradients, as a 0-dim float32 tensor.

    For plain tensors it is the squared norm of all gradients. For DTensor gradients (FSDP2 shards)
    it is this rank's part: the sum of this tensor over all ranks of the mesh (one scalar all-reduce,
    which the caller can batch with others) is the exact squared norm of the whole gradient.
    Parameters without a gradient count 0. ``device`` places the zero returned when no parameter has
    a gradient (default: CPU); otherwise the result is on the gradients' device.

    The norms are taken in float32 by one ``_foreach_norm`` (a few multi-tensor kernels on a GPU, not one per
    parameter), and nothing is read back: no host sync.
    """
    parts = [_local_part(p.grad) for p in parameters if p.grad is not None]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.stack(torch._foreach_norm([part for part, _ in parts], 2, dtype=torch.float32)).square()
    copies = [c for _, c in parts]
    if any(c > 1 for c in copies):
        squares = squares / torch.tensor(copies, dtype=torch.float32).to(squares.device, non_blocking=True)
    return squares.sum()


def two_batch_estimates(
    small_sq_norm_mean: float, small_size: float, big_sq_norm: float, big_size: float
) -> tuple[float, float]:
    """One step's unbiased estimates ``(|G|^2, tr(Sigma))`` from squared norms at two batch sizes.

    ``small_sq_norm_mean`` is the mean squared norm of gradients of ``small_size`` samples,
    ``big_sq_norm`` the squared norm of a gradient of ``big_size`` samples, ``0 < small < big``.
    Either estimate may be negative for one step; only their averages are meaningful.
    """
    _check_size_pair(small_size, big_size)
    b, B = float(small_size), float(big_size)
    gradient_sq_norm = (B * big_sq_norm - b * small_sq_norm_mean) / (B - b)
    trace_sigma = (small_sq_norm_mean - big_sq_norm) / (1.0 / b - 1.0 / B)
    return gradient_sq_norm, trace_sigma


def _check_size_pair(small_size: float, big_size: float) -> None:
    """Finite sizes with ``0 < small_size < big_size``; else ValueError naming them."""
    for name, v in (("small_size", small_size), ("big_size", big_size)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"noise scale: {name} must be a finite number > 0, got {v!r}")
    if small_size >= big_size:
        raise ValueError(
            f"noise scale: small_size ({small_size!r}) must be below big_size ({big_size!r}); "
            "with one micro batch per step and one rank there is no smaller batch to compare"
        )


class NoiseScaleEstimator:
    """Running simple noise scale ``B_simple``: the ratio of EMAs of ``tr(Sigma)`` and ``|G|^2``.

    Call :meth:`update` once per optimizer step with the squared norms described in the module
    docstring. Each of ``|G|^2`` and ``tr(Sigma)`` is averaged with ``ema = decay * ema + (1 - decay)
    * x`` and bias-corrected by the accumulated weight (as Adam does), so early values are plain
    means of the steps so far. :attr:`value` is ``EMA[tr(Sigma)] / EMA[|G|^2]``, in the units of the
    sizes passed (samples): None for the first ``warmup`` updates and whenever ``EMA[|G|^2] <= 0``
    (the signal is not resolved yet: the noise dominates the batches measured); clamped at 0 when
    ``EMA[tr(Sigma)] < 0`` (a covariance trace is never negative; noise below what is measurable).

    A step with a non-finite squared norm (an overflowed gradient) is ignored and counted in
    :attr:`skipped`; bad sizes raise ValueError, as they are the caller's mistake.

    Args:
        decay: EMA decay per update, in [0, 1); default 0.95 (about 20 steps of memory).
        warmup: updates before a value is reported; default 10, >= 1.
    """

    def __init__(self, decay: float = 0.95, warmup: int = 10) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"NoiseScaleEstimator: decay must be a number in [0, 1), got {decay!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"NoiseScaleEstimator: warmup must be an integer >= 1, got {warmup!r}")
        self.decay = float(decay)
        self.warmup = warmup
        self._ema_g2 = 0.0
        self._ema_trace = 0.0
        self._weight = 0.0  # 1 - decay**updates, kept as a sum so a changed decay stays consistent
        self.updates = 0
        self.skipped = 0

    def update(self, small_sq_norm_mean: float, small_size: float, big_sq_norm: float, big_size: float) -> float | None:
        """Fold one step's measurement in and return :attr:`value`.

        Args:
            small_sq_norm_mean: mean squared norm of the small-batch gradients (each a per-sample
                or per-token mean gradient of ``small_size`` samples).
            small_size: samples in each small batch (> 0).
            big_sq_norm: squared norm of the whole step's gradient (the same kind of mean).
            big_size: samples in the whole step, over all ranks (> ``small_size``).
        """
        _check_size_pair(small_size, big_size)
        s_small, s_big = float(small_sq_norm_mean), float(big_sq_norm)
        if not (math.isfinite(s_small) and math.isfinite(s_big)):
            self.skipped += 1
            return self.value
        g2, trace = two_batch_estimates(s_small, small_size, s_big, big_size)
        keep = self.decay
        self._ema_g2 = keep * self._ema_g2 + (1.0 - keep) * g2
        self._ema_trace = keep * self._ema_trace + (1.0 - keep) * trace
        self._weight = keep * self._weight + (1.0 - keep)
        self.updates += 1
        return self.value

    @property
    def gradient_sq_norm(self) -> float | None:
        """Bias-corrected EMA of ``|G|^2`` (None before any update); for logging."""
        return self._ema_g2 / self._weight if self._weight > 0 else None

    @property
    def trace_sigma(self) -> float | None:
        """Bias-corrected EMA of ``tr(Sigma)`` (None before any update); for logging."""
        return self._ema_trace / self._weight if self._weight > 0 else None

    @property
    def value(self) -> float | None:
        """The simple noise scale in samples (units of the sizes passed), or None while unresolved."""
        if self.updates < self.warmup or self._ema_g2 <= 0.0:
            return None
        return max(0.0, self._ema_trace / self._ema_g2)  # the bias corrections cancel in the ratio

    def state_dict(self) -> dict[str, Any]:
        """Plain floats and ints, for a checkpoint. ``decay`` and ``warmup`` are the config's, not state."""
        return {
            "ema_gradient_sq_norm": self._ema_g2,
            "ema_trace_sigma": self._ema_trace,
            "ema_weight": self._weight,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the constructor's ``decay`` and ``warmup`` stay."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"NoiseScaleEstimator.load_state_dict: missing {missing} in {sorted(state)}")
        weight = float(state["ema_weight"])
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"NoiseScaleEstimator.load_state_dict: ema_weight must be in [0, 1], got {weight!r}")
        self._ema_g2 = float(state["ema_gradient_sq_norm"])
        self._ema_trace = float(state["ema_trace_sigma"])
        self._weight = weight
        self.updates = int(state["updates"])
        self.skipped = int(state["skipped"])
