"""Restarts through torchrun's elastic agent: resume by itself, and only this job's checkpoint.

Outside a guard window (see :class:`~adaptive_batching.faults.guard.StepGuard`) a rank that runs
out of memory cannot tell the others, so it records the cut the rest of the run needs in the output
folder (``oom_cut.json``) and exits non-zero. torchrun's agent then stops every rank and, with
``--max-restarts R``, starts them again: ``TORCHELASTIC_RESTART_COUNT`` is above 0 and
``TORCHELASTIC_RUN_ID`` is the job's. The recipe then resumes from the job's last complete
checkpoint under the recorded cut. A new job (restart count 0), or a checkpoint written by another
job, is never resumed by surprise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaptive_batching.core import logs
from adaptive_batching.faults.checkpoints import MARKER, latest_complete_checkpoint, stopped_before_first_save
from adaptive_batching.runtime.files import write_atomically

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"
CUT_FILE = "oom_cut.json"


def job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """torchrun's id of this job (the same in every restart of it), or None outside torchrun."""
    return env.get(RUN_ID) or None


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    try:
        return int(env.get(RESTART_COUNT, "0"))
    except ValueError:
        return 0


def resume_after_restart(output_dir: Path, env: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether this start is torchrun restarting this job, with a checkpoint of this job to resume;
    and the line to log ("" for a first start)."""
    count = restart_count(env)
    if count == 0:
        return False, ""
    this_job = job_id(env)
    latest = latest_complete_checkpoint(Path(output_dir), this_job) if this_job is not None else None
    if latest is None:
        other = latest_complete_checkpoint(Path(output_dir))
        if other is None:
            return (
                False,
                f"torchrun restart {count}: no complete checkpoint in {output_dir}, starting from the beginning",
            )
        written_by = json.loads((other / MARKER).read_text(encoding="utf-8")).get("job_id")
        return False, (
            f"torchrun restart {count}: the checkpoint in {other} was written by job "
            f"{written_by!r}, not this job {this_job!r}; not resumed, starting from the beginning"
        )
    record = json.loads((latest / MARKER).read_text(encoding="utf-8"))
    return True, (
        f"torchrun restart {count} of job {this_job}: resuming from {latest} (optimizer step {record['global_step']})"
    )


def resume_decision(asked: bool, output_dir: Path) -> tuple[bool, str | None]:
    """Whether this run resumes (``resume_from_checkpoint`` was ``asked``, or a torchrun restart of this job
    finds a checkpoint of its own) and, for a restart, the job whose checkpoints it may take. A run stopped before
    its first checkpoint is asked to resume: it starts from the beginning, and says so in one line."""
    if asked:
        # First the checkpoints: finding them finishes a save that a kill interrupted.
        stopped = None if latest_complete_checkpoint(Path(output_dir)) else stopped_before_first_save(output_dir)
        if stopped is None:
            return True, None
        logs.info(
            f"resume_from_checkpoint=True: no checkpoint in {output_dir}, the run was stopped before its "
            f"first one ({stopped}): starting from the beginning (what it cached, token counts or profile, "
            "is reused)"
        )
        return False, None
    resume, why = resume_after_restart(output_dir)
    if why:
        logs.info(why)
    return resume, job_id() if resume else None


def record_cut(output_dir: Path, recovery_state: dict[str, Any], **details: Any) -> Path:
    """Write the OOM-recovery state a restart must run under, whole or not at all."""
    path = Path(output_dir) / CUT_FILE
    write_atomically(path, json.dumps({"recovery": recovery_state, **details}, indent=2, sort_keys=True) + "\n")
    return path


def recorded_cut(output_dir: Path) -> dict[str, Any] | None:
    """The recorded OOM-recovery state, if a rank wrote one and it is readable."""
    try:
        record = json.loads((Path(output_dir) / CUT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("recovery"), dict) else None
