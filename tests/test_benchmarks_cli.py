"""Every benchmark script imports on a machine without a GPU and answers --help (their runs
need the H200; this catches a script broken by a change to the code it imports)."""
from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setattr(sys, "path", [str(script.parent)] + sys.path)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_without_a_gpu_fails_with_a_message(script, monkeypatch, capsys):
    """(multirank_virtual printed "needs a CUDA GPU" and exited 0: a CI step would pass.)"""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setattr(sys, "path", [str(script.parent)] + sys.path)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code not in (0, None)
    assert "GPU" in str(e.value.code) + capsys.readouterr().err
