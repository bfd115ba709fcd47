#!/usr/bin/env python
"""What marking the batch's sizes dynamic costs the compiled chunked loss, per call, beside torchtune's own.

    python benchmarks/compile_marks.py [--calls 3000] [--vocab 64] [--micro-batch 8]

With ``compile: True`` torchtune compiles each chunk's cross-entropy of ``CEWithChunkedOutputLoss``
(``training.compile_loss``); ours (``training/compiling.py``) marks each chunk's logits and labels unbacked so that
one graph serves every micro batch. Three compiled losses in this one process, each on a function of its own (so
each has its own Dynamo cache), called in turn on the same inputs, forward and backward:

* stock: ``torchtune.training.compile_loss``, no marks (its graph specialises on the micro batch);
* marked every call: the wrapper as it was at 0e6d573, marking both tensors of each of the 8 chunks on every call;
* ours: ``compiling.compile_loss`` as it is now (the marks step aside after the first call with gradients).

Small logits (``--vocab``) keep the kernels short, so what is left is the per-call cost. The first call of each is
at micro batch 1 (as the profiler's compile), the rest at ``--micro-batch`` with sample lengths cycling 16-48.
Microseconds per loss call (8 chunks): the median of each, and the median over calls of each one's difference from
the stock call made next to it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torchtune import training
from torchtune.modules.loss import CEWithChunkedOutputLoss

from adaptive_batching.training import compiling


# Three copies on purpose: Dynamo caches per code object, and a class made by a factory shares one.
class _Stock(CEWithChunkedOutputLoss):
    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")


class _MarkedEveryCall(CEWithChunkedOutputLoss):
    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")


class _Ours(CEWithChunkedOutputLoss):
    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")


def marked_every_call() -> Any:
    """The compiled loss as ``compiling.compile_loss`` made it at 0e6d573: both tensors marked on every call."""
    compiled = training.compile_loss(_MarkedEveryCall(), verbose=False)
    inner: Callable[..., Any] = compiled.compute_cross_entropy

    def compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        torch._dynamo.decorators.mark_unbacked(logits, 0)
        torch._dynamo.decorators.mark_unbacked(labels, 0)
        return inner(logits, labels, *args, **kwargs)

    compiled.compute_cross_entropy = compute_cross_entropy
    return compiled


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="calls of each loss (default 3000)")
    p.add_argument("--vocab", type=int, default=64, help="logits per token (default 64)")
    p.add_argument("--micro-batch", type=int, default=8, help="micro batch after the first call (default 8)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    losses = {"stock": training.compile_loss(_Stock(), verbose=False), "marked every call": marked_every_call(),
              "ours": compiling.compile_loss(_Ours(), verbose=False)}
    times: dict[str, list[float]] = {name: [] for name in losses}
    generator = torch.Generator().manual_seed(0)
    names = list(losses)
    for call in range(args.calls):
        micro_batch, length = (1, 48) if call == 0 else (args.micro_batch, 16 + 8 * (call % 5))
        full = torch.randn(micro_batch, length, args.vocab, requires_grad=True)
        labels = torch.randint(0, args.vocab, (micro_batch, length), generator=generator)
        for name in names[call % 3:] + names[:call % 3]:  # each in each position in turn
            chunks = list(full.chunk(8, dim=1))
            start = time.perf_counter()
            losses[name](chunks, labels).backward()
            times[name].append(time.perf_counter() - start)
    skip = min(100, args.calls // 2)
    stock = times["stock"][skip:]
    print(f"compiled chunked cross-entropy, {args.calls} calls each (the first {skip} left out), micro batch "
          f"{args.micro_batch}, sample length 16-48, {args.vocab} logits per token, 1 thread\n")
    print("| loss | us per call (median) | minus stock's call beside it (median, us) |")
    print("|---|---:|---:|")
    for name, measured in times.items():
        measured = measured[skip:]
        extra = "-" if name == "stock" else f"{1e6 * statistics.median(b - a for a, b in zip(stock, measured)):.1f}"
        print(f"| {name} | {1e6 * statistics.median(measured):.0f} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
