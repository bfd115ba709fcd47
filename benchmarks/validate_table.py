"""The Markdown tables of ``validate_device.py``'s JSON (see its docstring for what each check does)."""

from __future__ import annotations

from typing import Any, Optional

GIB = 2**30


def _gib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / GIB:.3f}"


def _num(value: Optional[float], spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _true_max(entry: dict[str, Any]) -> str:
    true = entry.get("true_max")
    if not true:
        return "-"
    lo, hi = true["largest_fit"], true["smallest_fail"]
    bracket = f"{'-' if lo is None else lo} / {'-' if hi is None else hi}"
    if hi is None and lo is not None and lo >= true["limit"]:
        bracket += " (data limit)"
    return f"{bracket} ({len(true['trials'])})"


def _holds(entry: dict[str, Any]) -> str:
    """Is the chosen micro batch at most the largest that fitted a fresh process?"""
    true, profile = entry.get("true_max"), entry.get("profile")
    if not true or not profile or true["largest_fit"] is None:
        return "-"
    return "yes" if profile["micro_batch"] <= true["largest_fit"] else "NO"


def _steps(steps: Optional[dict[str, Any]]) -> str:
    if not steps:
        return "-"
    ok = steps["exit_code"] == 0 and steps["oom_errors"] == 0 and steps["ran"] == steps["requested"]
    limit = " (all the data)" if steps.get("data_limited") else ""
    return (f"{steps['ran']}/{steps['requested']}{limit} {'ok' if ok else 'FAILED'}, {steps['oom_errors']} OOM, "
            f"{steps['alloc_retries']} retries, peak {_gib(steps['max_peak_bytes'])}")


def _estimate(entry: dict[str, Any]) -> str:
    est, profile = entry.get("estimate"), entry.get("profile")
    if not est:
        return "-"
    if "error" in est:
        return "error"
    ratio = est["max_micro_batch"] / profile["max_micro_batch"] if profile and profile["max_micro_batch"] else None
    return f"{est['max_micro_batch']} (x{_num(ratio, '.2f')})"


def render(results: dict[str, Any]) -> str:
    """The settings table, then the token-budget table, with the device and the command."""
    device, meta = results.get("device", {}), results.get("meta", {})
    lines = [f"Device: {device.get('name', '?')} ({device.get('type', '?')}, "
             f"{_gib(device.get('memory_bytes'))} GiB), torch {device.get('torch', '?')}; model "
             f"{meta.get('model', '?')}, {meta.get('seq_len', '?')}-token samples, bf16, "
             f"budget {meta.get('budget') or 'the profiler' + chr(39) + 's own'}; command: `{meta.get('command', '?')}`",
             "",
             "| setting | budget GiB | chosen / largest ran (profile trials, s) | fresh-process fits / fails (runs) "
             "| chosen <= true max | steps at chosen | estimate (x largest ran) | tokens/s chosen | tokens/s stock 4x1 "
             "| speed-up |",
             "| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for key, entry in sorted(results.get("settings", {}).items()):
        profile = entry.get("profile")
        if profile is None:
            lines.append(f"| {key} | - | {str(entry.get('error', 'no profile'))[:160]} | | | | | | | |")
            continue
        chosen = entry.get("steps", {}).get("tokens_per_second")
        stock = (entry.get("stock") or {}).get("tokens_per_second")
        lines.append(
            f"| {key} | {_gib(profile['budget_bytes'])} | {profile['micro_batch']} / {profile['max_micro_batch']} "
            f"({profile['trial_steps']}, {profile['seconds']:.1f}) | {_true_max(entry)} | {_holds(entry)} "
            f"| {_steps(entry.get('steps'))} | {_estimate(entry)} | {_num(chosen)} | {_num(stock)} "
            f"| {'-' if not chosen or not stock else f'x{chosen / stock:.2f}'} |")
    tokens = results.get("token_budget")
    if tokens:
        lines += ["", f"Token budget against fixed micro batches: {tokens['samples']} samples of the long-tailed "
                      f"data, one epoch each, full fine-tuning, checkpointing off",
                  "", "| mode | micro batch | micro batches | padding waste | steps | tokens/s (training loop) |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for mode, run in tokens["runs"].items():
            size = f"{run['max_tokens']} tokens" if mode == "token budget" else f"{run['micro_batch']} samples"
            waste = run.get("waste")
            lines.append(f"| {mode} | {size} | {run.get('micro_batches', '-')} "
                         f"| {'-' if waste is None else f'{100 * waste:.1f}%'} | {run['steps']} "
                         f"| {_num(run['tokens_per_second'])} |")
    phases = results.get("phases", {})
    if phases:
        order = ("assets", "full", "lora", "qlora", "estimate", "tokens", "compile")
        names = sorted(phases, key=lambda k: (order.index(k) if k in order else len(order), k))
        lines += ["", "Phases (s): " + ", ".join(f"{k} {phases[k]['seconds']:.0f}" for k in names)]
    return "\n".join(lines) + "\n"
