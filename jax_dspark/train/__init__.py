"""DeepSpec-style DSpark drafter training in JAX (`jax-dspark train`).

Pieces: `prompts` (training prompts kept disjoint from the evaluation sets), `anchors`
(random anchors per sequence and their block labels), `losses` (0.1 CE + 0.9 TV + 1.0 BCE
with position weights exp(-k/4)).
"""
