"""The sizes a capture works to, decided before it runs: the model's shape, the plan's sizes, a capture's bytes on the host and the device."""
