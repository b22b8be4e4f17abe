"""`jax-dspark bench round` on the tiny target: the cases and parts it reports."""

import json

import pytest

from jax_dspark.bench import round as bench_round


def test_round_bench_reports_plain_and_speculative_rounds_with_their_parts(tmp_path):
    result = bench_round.run(str(tmp_path / "round.json"), commit="test", target="tiny", batch_sizes=(2,),
                             repeats=2)
    on_disk = json.loads((tmp_path / "round.json").read_text())
    assert on_disk["commit"] == "test" and (tmp_path / "round.md").is_file()
    plain, spec = result["cases"]
    assert (plain["drafter"], spec["drafter"]) == ("none", "dspark")
    assert plain["block"] == 0 and spec["block"] == 4 and spec["plain_step_ms"] == plain["round_ms"]
    for key in ("round_ms", "verify_forward_ms", "draft_ms", "backbone_ms"):
        assert spec[key] > 0, key
    assert spec["other_ms"] == pytest.approx(spec["round_ms"] - spec["verify_forward_ms"] - spec["draft_ms"])
    assert on_disk["target_param_bytes"] > 0
    assert spec["weights_floor_ms"] is None  # CPU: no bandwidth ceiling to quote


@pytest.mark.parametrize("kwargs, match", [(dict(batch_sizes=()), "batch_sizes"), (dict(repeats=0), "repeats"),
                                           (dict(target="gpt"), "target")])
def test_round_bench_rejects_bad_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench_round.run(str(tmp_path / "r.json"), **kwargs)
