"""Numbers from attention maps: the numpy definitions, the block reducers, A-vs-B measures."""
