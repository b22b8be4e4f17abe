"""DSpark drafter training on the tiny random target (CPU seconds)."""

import math

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jax_dspark.drafters import load_drafter, save_drafter
from jax_dspark.drafters._safetensors import load_safetensors, save_safetensors
from jax_dspark.models.dspark import tiny_dspark
from jax_dspark.models.llama import TINY, tiny_llama
from jax_dspark.train.data import concat_sequences, pack_sequences
from jax_dspark.train.trainer import TrainConfig, learning_rate, make_batches, train, train_many


def _random_data(seed=0, n=6, seq_len=40):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, TINY.vocab_size, rng.integers(4, 10))) for _ in range(n)]
    # Answers with structure (a repeated motif) so a drafter has something to learn.
    answers = [list(np.tile(rng.integers(1, TINY.vocab_size, 3), 10)[: rng.integers(12, 28)]) for _ in range(n)]
    return pack_sequences(prompts, answers, seq_len=seq_len)


def test_pack_sequences_masks_only_answer_tokens():
    data = pack_sequences([[5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14, 15, 16]], seq_len=8)
    np.testing.assert_array_equal(data.tokens[0], [5, 6, 7, 10, 11, 12, 0, 0])
    np.testing.assert_array_equal(data.loss_mask[1], [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(data.lengths, [6, 6])


def test_pack_sequences_truncates_answers_to_the_row_length():
    data = pack_sequences([[1, 2, 3, 4]], [[5, 6, 7, 8, 9]], seq_len=6)
    np.testing.assert_array_equal(data.tokens[0], [1, 2, 3, 4, 5, 6])
    assert data.loss_mask[0].sum() == 2


def test_concat_sequences_keeps_every_row_in_order_and_refuses_other_widths():
    a, b = _random_data(seed=1, n=3), _random_data(seed=2, n=4)
    both = concat_sequences([a, b])
    assert both.num_sequences == 7 and both.response_tokens == a.response_tokens + b.response_tokens
    np.testing.assert_array_equal(both.tokens[3:], b.tokens)
    np.testing.assert_array_equal(both.loss_mask[:3], a.loss_mask)
    with pytest.raises(ValueError, match="same seq_len"):
        concat_sequences([a, _random_data(n=2, seq_len=48)])


def test_train_command_records_more_data_the_lineage_of_init_and_renamed_paths(tmp_path):
    from jax_dspark.cli import main
    from jax_dspark.train.data import load_sequences, save_sequences

    extra = tmp_path / "extra.npz"
    save_sequences(extra, _random_data(seed=3, n=5, seq_len=512))
    out = tmp_path / "d"
    rc = main(["train", "--target", "tiny", "--prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4",
               "--data", str(tmp_path / "new.npz"), "--more-data", str(extra), "--steps", "2",
               "--batch-size", "2", "--num-anchors", "2", "--block-size", "3", "--num-layers", "1",
               "--intermediate-size", "32", "--markov-rank", "4", "--out", str(out)])
    assert rc == 0
    import json

    meta = json.loads((tmp_path / "d.json").read_text())
    new = load_sequences(tmp_path / "new.npz")
    assert meta["training"]["sequences"] == new.num_sequences + 5
    assert f"--more-data {extra}" in meta["command"] and "lineage" not in meta

    # Continued with --init: the new JSON carries the first run (command + summary) as its lineage;
    # --record-paths names the scratch paths in the command as the shipped ones.
    rc = main(["train", "--target", "tiny", "--data", str(tmp_path / "new.npz"), "--steps", "1",
               "--batch-size", "2", "--num-anchors", "2", "--block-size", "3", "--num-layers", "1",
               "--intermediate-size", "32", "--markov-rank", "4", "--init", str(out), "--out", str(tmp_path / "e"),
               "--more-data", str(extra), "--record-paths", f"{tmp_path / 'e'}=pkg/e", f"{extra}=extra.npz"])
    assert rc == 0
    later = json.loads((tmp_path / "e.json").read_text())
    assert later["lineage"] == [dict(command=meta["command"],
                                     training={k: v for k, v in meta["training"].items() if k != "history"})]
    assert f"--out pkg/e --init {out}" in later["command"] and "--more-data extra.npz" in later["command"]
    assert str(tmp_path) not in later["command"].replace(str(out), "")
    assert f"{extra} (recorded as extra.npz)" in later["paths_note"]

    with pytest.raises(ValueError, match="missing.npz"):
        main(["train", "--target", "tiny", "--more-data", str(tmp_path / "missing.npz"), "--out", str(out)])


def test_train_command_grows_vanilla_drafters_gated_beside_their_ablation_and_records_the_variant(tmp_path):
    import json

    from jax_dspark.cli import main
    from jax_dspark.train.data import save_sequences

    data = tmp_path / "data.npz"
    save_sequences(data, _random_data(seed=4, n=5, seq_len=512))
    common = ["train", "--target", "tiny", "--data", str(data), "--steps", "1", "--batch-size", "2",
              "--num-anchors", "2", "--block-size", "3", "--num-layers", "1", "--intermediate-size", "32"]
    v, off = str(tmp_path / "v"), str(tmp_path / "off")
    assert main(common + ["--markov-rank", "4", "0", "--out", v, off]) == 0
    g, v2, off2 = str(tmp_path / "g"), str(tmp_path / "v2"), str(tmp_path / "off2")
    assert main(common + ["--markov-rank", "4", "4", "0", "--markov-variant", "gated", "vanilla", "vanilla",
                          "--init", v, v, off, "--out", g, v2, off2]) == 0
    gated = json.loads((tmp_path / "g.json").read_text())
    assert gated["config"]["markov_gate"] and "--markov-variant gated" in gated["command"]
    assert load_drafter(g).markov_gate is not None
    for name in ("v2", "off2"):
        meta = json.loads((tmp_path / f"{name}.json").read_text())
        assert not meta["config"]["markov_gate"] and "--markov-variant" not in meta["command"]
    with pytest.raises(ValueError, match="markov-variant"):
        main(common + ["--markov-rank", "0", "--markov-variant", "gated", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="markov-variant"):
        main(common + ["--markov-rank", "4", "4", "0", "--markov-variant", "gated", "vanilla",
                       "--out", g, v2, off2])


@pytest.mark.parametrize("pair, match", [("no-equals", "'no-equals' is not GIVEN=RECORDED"),
                                         ("=x", "'=x' is not GIVEN"), ("other=x", r"\['other'\] is not a given")])
def test_train_command_rejects_a_record_path_it_cannot_apply(tmp_path, pair, match):
    from jax_dspark.cli import main

    with pytest.raises(ValueError, match=match):
        main(["train", "--target", "tiny", "--out", str(tmp_path / "d"), "--markov-rank", "4", "--record-paths", pair])


def test_learning_rate_warms_up_then_decays_to_zero():
    cfg = TrainConfig(steps=100, learning_rate=1e-3, warmup_steps=10)
    lrs = [learning_rate(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert learning_rate(100, 100, cfg) == pytest.approx(0.0, abs=1e-12)
    assert not math.isnan(learning_rate(5, 5, cfg))


def test_batches_anchor_inside_answers_with_labels_after_the_anchor():
    data = _random_data()
    cfg = TrainConfig(batch_size=3, num_anchors=5, seed=1)
    tokens, lengths, anchors, labels, valid = next(make_batches(data, cfg, block_size=3))
    assert tokens.shape == (3, data.seq_len) and anchors.shape == (3, 5) and labels.shape == (3, 5, 3)
    for b in range(3):
        row = int(np.nonzero((data.tokens == tokens[b]).all(axis=1))[0][0])
        for k, a in enumerate(anchors[b]):
            assert a >= 0 and data.loss_mask[row, a] and data.loss_mask[row, a + 1]
            n = int(valid[b, k].sum())
            np.testing.assert_array_equal(labels[b, k, :n], tokens[b, a + 1:a + 1 + n])


def test_training_steps_reduce_the_loss():
    target = tiny_llama(0)
    drafter = tiny_dspark(TINY, seed=3, block_size=3, num_layers=1, markov_rank=8)
    cfg = TrainConfig(steps=24, batch_size=4, num_anchors=6, learning_rate=3e-3, warmup_steps=4, log_every=4)
    result = train(target, drafter, _random_data(), cfg)
    losses = [h["loss"] for h in result.history]
    assert result.steps == 24 and len(losses) == 6
    assert losses[-1] < 0.85 * losses[0], losses


def test_drafters_trained_together_match_each_trained_alone():
    """One shared target forward per step changes nothing: same batches, same updates."""
    target = tiny_llama(0)
    cfg = TrainConfig(steps=6, batch_size=3, num_anchors=4, learning_rate=3e-3, warmup_steps=2, log_every=3)
    kinds = [dict(markov_rank=4), dict(markov_rank=0), dict(markov_rank=6, markov_factors="embedding")]
    make = [lambda k=k: tiny_dspark(TINY, seed=3, block_size=3, num_layers=1, **k) for k in kinds]
    together = [m() for m in make]
    results = train_many(target, together, _random_data(), cfg)
    assert [r.steps for r in results] == [6, 6, 6] and all(len(r.history) == 2 for r in results)
    for m, joint, result in zip(make, together, results):
        alone = m()
        single = train(target, alone, _random_data(), cfg)
        np.testing.assert_allclose([h["loss"] for h in result.history], [h["loss"] for h in single.history],
                                   rtol=2e-4)
        for a, b in zip(jax.tree_util.tree_leaves(nnx.state(joint, nnx.Param)),
                        jax.tree_util.tree_leaves(nnx.state(alone, nnx.Param))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
    assert results[0].history[-1]["loss"] != results[1].history[-1]["loss"]


def test_drafters_trained_together_need_one_block_size():
    target = tiny_llama(0)
    pair = [tiny_dspark(TINY, block_size=3, num_layers=1), tiny_dspark(TINY, block_size=4, num_layers=1)]
    with pytest.raises(ValueError, match="block size"):
        train_many(target, pair, _random_data(), TrainConfig(steps=1))


@pytest.mark.parametrize("factors, gate", [("table", False), ("embedding", False), ("embedding", True)])
def test_saved_drafter_loads_with_the_bf16_rounded_weights(tmp_path, factors, gate):
    drafter = tiny_dspark(TINY, seed=5, block_size=3, num_layers=1, markov_rank=4, markov_factors=factors,
                          markov_gate=gate)
    if gate:  # a trained gate is not zero
        drafter.markov_gate.w[...] = jax.random.normal(jax.random.key(6), drafter.markov_gate.w.shape)
    save_drafter(drafter, tmp_path / "d", {"command": "test"})
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config
    for_decoding = load_drafter(tmp_path / "d", target=tiny_llama(0))
    assert for_decoding.config.markov_factors == "table"
    want = jax.tree_util.tree_leaves(nnx.state(drafter, nnx.Param))
    got = jax.tree_util.tree_leaves(nnx.state(loaded, nnx.Param))
    for w, g in zip(want, got):
        rounded = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(g, np.float32), rounded)


def test_safetensors_round_trip_keeps_names_dtypes_and_values(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a.b": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
               "c": rng.integers(-9, 9, (4,)).astype(np.int32)}
    save_safetensors(tmp_path / "x.safetensors", tensors, metadata={"k": "v"})
    back, meta = load_safetensors(tmp_path / "x.safetensors")
    assert meta == {"k": "v"} and set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value)


def test_load_drafter_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="name_or_path"):
        load_drafter("no_such_drafter_here")


@pytest.mark.parametrize("name", ["smollm2_dspark", "smollm2_markov_off"])
def test_shipped_drafters_fit_16_mib_and_load_with_block_7(name):
    from jax_dspark.drafters import drafter_path, load_drafter_meta

    path = drafter_path(name)
    assert path.stat().st_size < 16 * 2**20
    meta = load_drafter_meta(name)
    assert meta["command"].startswith("jax-dspark train ") and f"--out jax_dspark/drafters/{name}" in meta["command"]
    # Continued drafters name the runs before them, oldest first, each writing the same path.
    if "--init" in meta["command"]:
        assert meta["lineage"] and "--init" not in meta["lineage"][0]["command"]
        for run in meta["lineage"]:
            assert run["command"].startswith("jax-dspark train ") and f"--out jax_dspark/drafters/{name}" in run["command"]
            assert run["training"]["steps"] > 0
    drafter = load_drafter(name)
    assert drafter.block_size == 7
    assert (drafter.markov is None) == (name == "smollm2_markov_off")


def test_init_continues_from_a_saved_drafter_grows_it_and_rejects_another_config(tmp_path):
    import dataclasses

    from jax_dspark.commands.train import _initial

    drafter = tiny_dspark(TINY, seed=5, block_size=3, num_layers=1, markov_rank=4, markov_factors="embedding")
    save_drafter(drafter, tmp_path / "d", {"command": "test"})
    stored = np.asarray(drafter.markov.p1[...]).astype(ml_dtypes.bfloat16).astype(np.float32)
    start = _initial(str(tmp_path / "d"), drafter.config, 0)
    np.testing.assert_array_equal(np.asarray(start.markov.p1[...]), stored)
    grown = _initial(str(tmp_path / "d"), dataclasses.replace(drafter.config, markov_rank=8), 0)
    assert grown.config.markov_rank == 8 and grown.markov.p1.shape == (TINY.hidden_size, 8)
    np.testing.assert_array_equal(np.asarray(grown.markov.p1[...])[:, :4], stored)

    gated = _initial(str(tmp_path / "d"), dataclasses.replace(drafter.config, markov_gate=True), 0)
    assert gated.config.markov_gate and not np.any(np.asarray(gated.markov_gate.w[...]))
    np.testing.assert_array_equal(np.asarray(gated.markov.p2[...]),
                                  2 * np.asarray(drafter.markov.p2[...]).astype(ml_dtypes.bfloat16).astype(np.float32))

    with pytest.raises(ValueError, match="markov_rank"):
        _initial(str(tmp_path / "d"), dataclasses.replace(drafter.config, markov_rank=2), 0)
    deeper = _initial(str(tmp_path / "d"), dataclasses.replace(drafter.config, num_layers=2, markov_rank=8), 0)
    assert deeper.config.num_layers == 2 and deeper.config.markov_rank == 8
    with pytest.raises(ValueError, match="block_size"):
        _initial(str(tmp_path / "d"), dataclasses.replace(drafter.config, block_size=4, markov_rank=8), 0)

