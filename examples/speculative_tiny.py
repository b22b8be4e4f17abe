"""Speculative decoding with DSpark on tiny random-weight targets, on any machine (CPU is fine).

Run:  python examples/speculative_tiny.py

What it shows, top to bottom:
1. build a tiny dense (Llama-family) target and its standalone DSpark drafter;
2. generate greedily with and without the drafter: the tokens are identical, because
   verification is lossless (greedy = exact match against the target's argmax);
3. use the target itself as the drafter: every draft is accepted, so each decode round
   emits g + 1 tokens (the ceiling a trained drafter approaches);
4. sample at temperature 0.8 with confidence-scheduled verification;
5. the same on a tiny DeepSeek-V4 target with the V4-embedded drafter.

Random weights mean the DSpark drafters accept almost nothing (acceptance length ~1); the
point is the machinery: one jitted function per decode round, lossless output, and the
statistics a real checkpoint would report.
"""

from flax import nnx

from jax_dspark.models.deepseek_v4 import DeepseekV4, tiny
from jax_dspark.models.dspark import tiny_dspark
from jax_dspark.models.dspark_model_drafter import ModelDrafter
from jax_dspark.models.dspark_v4 import tiny_dspark_v4
from jax_dspark.models.llama import tiny_llama
from jax_dspark.ops import SamplingParams
from jax_dspark.spec.engine import generate
from jax_dspark.spec.schedule import SpsTable
from jax_dspark.spec.state import Scheduler


def show(name, result):
    s = result.stats
    print(f"{name:<28} acceptance length {s.acceptance_length:.2f}  verify rate {s.verify_rate:.2f}  "
          f"{s.tokens_per_s:7.1f} tok/s  TTFT {1000 * s.ttft_s:6.1f} ms  (compile {s.compile_s:.1f} s)")
    print(f"{'':<28} per-position acceptance {[round(a, 2) for a in s.per_position_acceptance]}")


# Prompts are token ids; two requests of different lengths share one batch.
prompts = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]]

# 1. A tiny Llama-family target (random weights, fixed seed) and a DSpark drafter for it.
target = tiny_llama(seed=0)
drafter = tiny_dspark(target.config, seed=1)          # block of 4 drafts per round

# 2. Greedy: plain decoding and speculative decoding emit the same tokens.
plain = generate(target, None, prompts, max_new_tokens=16)
spec = generate(target, drafter, prompts, max_new_tokens=16)
assert spec.tokens == plain.tokens
print("generated ids:", spec.tokens[0])
show("plain decoding", plain)
show("DSpark (random drafter)", spec)

# 3. The target as its own drafter: everything is accepted (acceptance length = g + 1).
show("target as drafter", generate(target, ModelDrafter(target, block_size=4), prompts, max_new_tokens=16))

# 4. Sampling, with the scheduler deciding how many drafts each request verifies. The table
#    is the target's verify steps per second at a given batch-token count; measure a real
#    one with `jax_dspark.spec.profile_sps`.
table = SpsTable.create([1, 8, 16, 32], [1.0, 0.9, 0.6, 0.3])
sampled = generate(target, drafter, prompts, max_new_tokens=16, seed=7,
                   sampling=SamplingParams(temperature=0.8, top_p=0.95), scheduler=Scheduler(table=table))
show("sampled + scheduled", sampled)

# 5. A tiny DeepSeek-V4 target (mHC, CSA/HCA attention, MoE) with its embedded drafter.
v4 = DeepseekV4(tiny(), rngs=nnx.Rngs(0))
v4_spec = generate(v4, tiny_dspark_v4(v4.config, seed=1), prompts, max_new_tokens=16)
assert v4_spec.tokens == generate(v4, None, prompts, max_new_tokens=16).tokens
show("DeepSeek-V4 + DSpark", v4_spec)
