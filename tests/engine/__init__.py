"""The engine as a whole: states, configs, checkpoints, resuming, bad input, non-finite values, shutdown."""
