"""KV-cache what-ifs: compression of a prefilled cache (docs/methods.md#kv-cache-compression: :mod:`attnviz.kv.presses` scores the
keys, :mod:`attnviz.kv.compress` measures what keeping the top ones costs)."""
