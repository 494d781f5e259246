"""The CPU-speed wing: C kernels and packed weights the engine uses when they load."""
