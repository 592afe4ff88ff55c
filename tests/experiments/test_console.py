"""The console: one line per event, the same lines in train.log, a rank's error as one line plus its trace's path."""

import io
import json
import re
import subprocess
import sys
import warnings

import pytest

from experiments.console import Console, compile_done


def test_a_begun_line_is_ended_in_the_log_whole_and_a_warning_in_between_gets_its_own_line(tmp_path):
    out = io.StringIO()
    console = Console(str(tmp_path), file=out)
    console.begin("compiling step 1's graphs (jit=true) ...")
    console.end(" done in 3.0 s")
    with console.warnings_shown():
        console.begin("compiling ...")
        warnings.warn("an axis is idle", UserWarning, stacklevel=1)
        warnings.warn("an axis is idle", UserWarning, stacklevel=1)  # once per message
        console.end(" done")
    assert out.getvalue().splitlines() == ["compiling step 1's graphs (jit=true) ... done in 3.0 s", "compiling ...",
                                           "warning: UserWarning: an axis is idle", " done"]
    assert (tmp_path / "train.log").read_text().splitlines() == [
        "compiling step 1's graphs (jit=true) ... done in 3.0 s", "warning: UserWarning: an axis is idle",
        "compiling ... done"]
    assert [json.loads(ln) for ln in (tmp_path / "warnings.jsonl").read_text().splitlines()] == [
        {"category": "UserWarning", "message": "an axis is idle"}]
    Console(str(tmp_path / "off"), enabled=False).line("nothing")  # another rank: silent, no file
    assert not (tmp_path / "off").exists()


def test_the_compile_line_says_how_many_graphs_the_first_step_compiled():
    # the count is the step's own (Compiled.graphs: tests/shardings/step/test_jit.py counts it)
    assert compile_done(1, 88.04) == (" 1 graph compiled (with its backward), done in 88.0 s "
                                      "(tokens/s counts the steps after it)")
    assert compile_done(2, 3).startswith(" 2 graphs compiled (with their backward), done in 3.0 s")
    assert compile_done(0, 1).startswith(" no graph compiled (the step ran eagerly)")  # a layout that fell back


@pytest.mark.multiprocess
def test_a_ranks_error_is_one_line_and_the_path_of_its_trace(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "model=mlp", "layout=dp", "mesh=dp2", "steps=2",
                           "data.max_bytes=200000", "data.source=/no/such/dir", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    start, error, trace_at = proc.stderr.splitlines()  # no torch elastic log lines, no [rank0]: prefixes
    assert start == f"run directory: {tmp_path}" and trace_at == f"full trace: {tmp_path / 'error.log'}"
    # both ranks raise it: the launcher reports the first one, and the other as failing after it
    assert re.fullmatch(r"Error: rank (\d) of 2 raised ValueError: data\.source='/no/such/dir' is neither 'stdlib', "
                        r"'random' nor a directory\. Fix: pass data\.source=stdlib, data\.source=random or "
                        r"data\.source=/path/to/text/files\. \(ranks \[(\d)\] failed after it\)", error), error
    assert (tmp_path / "train.log").read_text() == proc.stderr
    trace = (tmp_path / "error.log").read_text()
    assert "Traceback (most recent call last)" in trace and "in load_corpus" in trace
