"""Subcommands of the `jax-dspark` CLI; see `jax_dspark.cli`."""
