"""The engine as a whole: its states, configs, checkpoints and resuming, bad input, non-finite values, shutdown."""
