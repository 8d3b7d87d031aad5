"""Inputs: open a corpus (files, globs, hub datasets, OpenAI batch files), stable row ids, the
shard plan, and a login-node preview.

Imports the base modules and models; nothing of the run directory or the engine."""
