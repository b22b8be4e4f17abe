"""Speculative decoding as pure, jittable functions: propose, verify, schedule, calibrate.

One decode round (see `../shared/DESIGN.md`): `verify` the previous block against the
target, `propose` the next block through the drafter's Markov chain, turn the confidence
logits into survivals (`calibrated_confidence`, `survival`) and let a scheduler pick how
many drafts of each request the next verify reads. `profile_sps` measures the throughput
table the schedulers need; `fit_sts` fits the calibration temperatures offline.
"""

from __future__ import annotations

# Proposal
from jax_dspark.spec.propose import Proposal, predecessors, propose

# Verification
from jax_dspark.spec.verify import PAD_TOKEN, Verification, verify

# Scheduling
from jax_dspark.spec.schedule import (
    SURVIVAL_EPS,
    SpsTable,
    allocate_topk,
    schedule_budgeted,
    schedule_causal,
    sps_at,
    survival,
    verify_budget,
)
from jax_dspark.spec.profile import profile_sps

# Calibration
from jax_dspark.spec.sts import StsFit, calibrated_confidence, expected_calibration_error, fit_sts

# Engine (jitted decode round, generate loop)
from jax_dspark.spec.engine import GenerateResult, GenerateStats, SpeculativeEngine, decode_round, generate, prefill
from jax_dspark.spec.state import DecodeState, RoundStats, Scheduler

__all__ = [
    "DecodeState",
    "GenerateResult",
    "GenerateStats",
    "RoundStats",
    "Scheduler",
    "SpeculativeEngine",
    "decode_round",
    "generate",
    "prefill",
    "PAD_TOKEN",
    "Proposal",
    "SURVIVAL_EPS",
    "SpsTable",
    "StsFit",
    "Verification",
    "allocate_topk",
    "calibrated_confidence",
    "expected_calibration_error",
    "fit_sts",
    "predecessors",
    "profile_sps",
    "propose",
    "schedule_budgeted",
    "schedule_causal",
    "sps_at",
    "survival",
    "verify",
    "verify_budget",
]
