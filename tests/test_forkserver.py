"""The test fork server's ``fork_python``: a run's own ``python`` children forked from it, set up as ``Popen`` and a
new interpreter would set them up."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from recipe_runs import check, run_command

pytestmark = pytest.mark.e2e  # a command run in a subprocess

PARENT = textwrap.dedent("""
    import json, os, signal, subprocess, sys
    signal.signal(signal.SIGTERM, lambda *_: None)  # the parent's handler; a new interpreter has none
    work = os.path.join(os.path.dirname(os.path.abspath(__file__)), "work")
    forked = subprocess.run([sys.executable, "-u", "child.py", "a b", "c"], cwd=work, capture_output=True, text=True,
                            env={"ONLY": "this"}, input="fed")
    fresh = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                           text=True)
    print(json.dumps({"pid": os.getpid(), "code": forked.returncode, "out": forked.stdout, "err": forked.stderr,
                      "fresh_has_torch": fresh.stdout.strip()}))
""")
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "ppid": os.getppid(),
                      "stdin": sys.stdin.read(), "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "torch_loaded": "torch" in sys.modules}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
""")


def test_a_python_child_is_forked_with_its_own_argv_cwd_env_streams_handlers_and_exit_code(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "work" / "child.py").write_text(CHILD)
    parent = json.loads(
        check(run_command("script", [str(tmp_path / "parent.py")], cwd=tmp_path, fork_python=True)).stdout
    )
    child = json.loads(parent["out"])
    assert parent["code"] == 3 and parent["err"] == "to stderr\n" and child["stdin"] == "fed"
    assert child["argv"] == ["child.py", "a b", "c"] and child["cwd"] == str(tmp_path / "work")
    assert child["env"] == {"ONLY": "this"} and child["ppid"] == parent["pid"] and child["sigterm_default"]
    assert child["torch_loaded"]  # forked from the warm server's imports, not a new interpreter
    assert parent["fresh_has_torch"] == "False"  # ``python -c``: a new interpreter, as before


PLOTS = textwrap.dedent("""
    import subprocess, sys
    for module in ("adaptive_batching.profiling.plot", "json.tool"):
        done = subprocess.run([sys.executable, "-m", module, "missing.json", "out.png"], capture_output=True, text=True)
        print(module, done.returncode != 0, "forkserver.py" in done.stderr)
""")


def test_without_fork_python_only_the_profilers_plot_child_is_forked(tmp_path: Path) -> None:
    """Each recipe run's plot (``forkserver.ALWAYS_FORKED``): the failing child's traceback runs through the fork
    server's entry point; any other ``python -m`` of the run is a new interpreter, whose traceback does not."""
    (tmp_path / "plots.py").write_text(PLOTS)
    out = check(run_command("script", [str(tmp_path / "plots.py")], cwd=tmp_path)).stdout
    assert out.splitlines() == ["adaptive_batching.profiling.plot True True", "json.tool True False"]
