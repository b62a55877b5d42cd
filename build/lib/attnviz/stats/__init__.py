"""Numbers from attention maps: the numpy definitions of every statistic and the block reducers that stream them."""
