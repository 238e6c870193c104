"""bench/step_log.py reads a run's step logs and tells prompt steps and decode steps apart, with
what ran beside them."""
from __future__ import annotations

from bench.step_log import main, read_dir, summarize


def _write(path, rows):
    path.write_text("".join(" ".join(map(str, r)) + "\n" for r in rows))


def test_summary_counts_prompt_steps_beside_decode_steps(tmp_path, capsys):
    # prefill-0: one 1 s prompt step of 500 tokens from t=100; decode-0: a step inside it, one after
    _write(tmp_path / "prefill-0-11.steps", [(100.0, 0, 500, 1000.0, 800.0, 820.0, 1)])
    _write(tmp_path / "decode-0-12.steps", [(100.2, 4, 0, 20.0, 15.0, 16.0, 1), (101.5, 4, 0, 10.0, 10.0, 10.0, 2),
                                          (102.0, 4, 0)])  # a line cut short: skipped
    ranks = read_dir(tmp_path)
    assert sorted(ranks) == ["decode-0-12", "prefill-0-11"] and len(ranks["decode-0-12"]) == 2
    text = summarize(ranks)
    assert "| prefill-0-11 | 1 (1) | 500 | 2.000 | 1.600 | 0.02 |" in text  # 20 ms of decode beside its 1000
    assert "| decode-0-12 | 1 | 0 | 10.0 |" in text and "| decode-0-12 | 1 | 1 | 20.0 |" in text
    assert read_dir(tmp_path, since=101.0)["prefill-0-11"] == []
    assert main([str(tmp_path)]) == 0 and "Decode-only steps" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 1
