"""What a recorded layer keeps: the recorders the engine feeds, the statistics reduced block by block on the device, max-pooled maps, the sink's attention."""
