"""Flax NNX model definitions, importable as `jax_dspark.models`."""
