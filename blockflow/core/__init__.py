"""What every BlockFlow process shares, and nothing else: the spec a block runs, the error tree,
model graphs and their cuts, CUDA driver calls, NVML, and every environment-variable name and
runtime-directory path. Block processes import it; it imports nothing else of BlockFlow's."""
