"""What the launcher reads from a running trainer and its GPU: the trainer log's progress and
saves, and the GPU's clocks, power and utilisation. Below both `runs` and `watchdog`, which use
them; it imports neither."""
