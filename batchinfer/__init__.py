"""batchinfer: Slurm-native batch LLM inference with exactly-once output."""

__version__ = "0.1.0"
