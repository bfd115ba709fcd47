#!/usr/bin/env python
"""What marking the batch's sizes dynamic costs the compiled chunked loss, per call, beside torchtune's own.

Stock's (``torchtune.training.compile_loss``) and ours (``compiling.compile_loss``), each on its own code object,
called in turn on the same inputs, forward and backward: microseconds per loss call of 8 chunks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torchtune import training
from torchtune.modules.loss import CEWithChunkedOutputLoss

from adaptive_batching.training import compiling

MICRO_BATCH, VOCAB = 8, 64  # small logits keep the kernels short, so what is left is the per-call cost


# Two copies on purpose: Dynamo caches per code object, and a class made by a factory shares one.
class _Stock(CEWithChunkedOutputLoss):
    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")


class _Ours(CEWithChunkedOutputLoss):
    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="calls of each loss (default 3000)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    losses = {"stock": training.compile_loss(_Stock(), verbose=False),
              "ours": compiling.compile_loss(_Ours(), verbose=False)}
    times: dict[str, list[float]] = {name: [] for name in losses}
    generator = torch.Generator().manual_seed(0)
    names = list(losses)
    for call in range(args.calls):
        micro_batch, length = (1, 48) if call == 0 else (MICRO_BATCH, 16 + 8 * (call % 5))
        full = torch.randn(micro_batch, length, VOCAB, requires_grad=True)
        labels = torch.randint(0, VOCAB, (micro_batch, length), generator=generator)
        for name in names[call % 2:] + names[:call % 2]:  # each in each position in turn
            chunks = list(full.chunk(8, dim=1))
            start = time.perf_counter()
            losses[name](chunks, labels).backward()
            times[name].append(time.perf_counter() - start)
    skip = min(100, args.calls // 2)
    stock = times["stock"][skip:]
    print(f"compiled chunked cross-entropy, {args.calls} calls each (the first {skip} left out), micro batch "
          f"{MICRO_BATCH}, sample length 16-48, {VOCAB} logits per token, 1 thread\n")
    print("| loss | us per call (median) | minus stock's call beside it (median, us) |")
    print("|---|---:|---:|")
    for name, measured in times.items():
        measured = measured[skip:]
        extra = "-" if name == "stock" else f"{1e6 * statistics.median(b - a for a, b in zip(stock, measured)):.1f}"
        print(f"| {name} | {1e6 * statistics.median(measured):.0f} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
