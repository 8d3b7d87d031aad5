"""Models: where a model lives (local folder, hub cache, PyPI-shipped defaults), its config.json,
sizing arithmetic, context length and login-node token counts.

At the bottom of the pipeline: imports only the base modules (errors), never vllm or torch."""
