"""`zo train`: the tiny GPT trained with any config, on one process or under torchrun; `zo checkpoint`."""
