"""KV-cache what-ifs: compression of a prefilled cache (SPEC §13: :mod:`attnviz.kv.presses` scores the
keys, :mod:`attnviz.kv.compress` measures what keeping the top ones costs)."""
