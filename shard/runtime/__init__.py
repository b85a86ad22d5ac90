"""Where the model runs: the device and dtype, the process group of a tensor-parallel deployment, and each rank's
slice of the weights."""
