"""BlockFlow: DNNs cut into shared blocks, served on NVIDIA Triton."""

__version__ = "0.2.0"
