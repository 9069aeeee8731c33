"""examples/serving_loop.py on the GPU (issue 17): 200 steps of continuous
batching (joins, forks, leaves) through one CUDA graph captured at step 0,
checked against the float64 reference every 20 steps."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serving_loop.py"


def test_serving_loop_replays_one_graph(capsys):
    spec = importlib.util.spec_from_file_location("serving_loop", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    captures = []
    real = mod.Server.capture
    mod.Server.capture = lambda self: (captures.append(1), real(self))[1]
    rc = mod.main(["--steps", "200", "--layers", "4", "--num-pages", "8192", "--check-every", "20"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert captures == [1] and "graph captures 1" in text
    assert "10 failed" not in text and ", 0 failed" in text
    low, high = text.split("batch ")[1].split(" ")[0].split("-")
    assert int(low) < int(high), "the batch size never changed"


def test_serving_loop_draft_verify_steps(capsys):
    """--draft 3: every step appends 4 tokens per request and decodes all of
    them (qo_indptr) through the same single graph, checked every 10 steps."""
    spec = importlib.util.spec_from_file_location("serving_loop", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--steps", "60", "--layers", "2", "--num-pages", "8192", "--check-every", "10", "--draft", "3",
                   "--max-batch", "16"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "graph captures 1" in text and "tokens per request and step 4" in text and ", 0 failed" in text

