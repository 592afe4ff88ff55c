"""Progress: a bar on a terminal, one plain line every N steps in a file or log (CI, SLURM)."""

import io

import pytest
from omegaconf import OmegaConf

from experiments.progress import Progress
from experiments.train import run
from tests.experiments.conftest import compose_config


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(progress: Progress, steps: int) -> None:
    for i in range(steps):
        progress.update(f"loss {10 - i}")
    progress.close()


@pytest.mark.parametrize(("total", "every", "printed"), [(10, 3, [3, 6, 9, 10]), (40, 0, list(range(2, 41, 2))),
                                                       (5, 0, [1, 2, 3, 4, 5])])
def test_a_file_gets_one_plain_line_every_n_steps_and_the_last(total, every, printed):
    out = io.StringIO()
    _run(Progress(total, desc="zero3", every=every, file=out), total)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [int(line.split()[2].split("/")[0]) for line in lines] == printed
    assert lines[-1].startswith(f"zero3 step {total}/{total} (100%) | loss {10 - total + 1} |")


def test_a_resumed_run_counts_from_where_it_restarted():
    out = io.StringIO()
    _run(Progress(10, initial=6, every=2, file=out), 4)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["8/10", "10/10"]


def test_a_terminal_gets_a_redrawn_bar_and_disabled_writes_nothing():
    tty, off = _Terminal(), io.StringIO()
    _run(Progress(5, desc="dp", file=tty), 5)
    _run(Progress(5, desc="dp", file=off, enabled=False), 5)
    assert "\r" in tty.getvalue() and "5/5" in tty.getvalue() and "loss 6" in tty.getvalue()
    assert off.getvalue() == ""


def test_a_training_run_logged_to_a_file_prints_plain_lines(tmp_path, capfd):
    overrides = ["model=mlp", "data.max_bytes=200000", "optim.warmup_steps=0", "steps=4", "progress_every=2",
                 "runtime=simulate", "layout=dp", "mesh=dp2"]
    cfg = compose_config("train", overrides)
    assert OmegaConf.select(cfg, "progress") is True
    run(cfg, str(tmp_path))
    err = capfd.readouterr().err  # pytest's capture is not a terminal, like a CI log
    lines = [line for line in err.splitlines() if " step " in line]
    assert [line.split()[2] for line in lines] == ["2/4", "4/4"], err
    assert "\r" not in err and all("tok/s" in line for line in lines)
