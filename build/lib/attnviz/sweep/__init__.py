"""Sweeps: a grid of models × architectures × interventions × corpora × measures, one Ray task per
cell, results as a Parquet dataset (:mod:`.spec` the TOML spec, :mod:`.measures` what a cell computes,
:mod:`.store` the files, :mod:`.run` the Ray driver)."""
