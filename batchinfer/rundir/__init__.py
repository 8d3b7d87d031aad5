"""Run directory: preparing DIR (run.yaml, plan.json, input), parts, progress and DONE records,
locks, the output schema, progress statistics, and the merge.

The on-disk contract (docs/inputs-outputs.md, "The run directory"). Imports config, models, inputs, requests and the base
modules; never the engine (a finished DIR never imports vllm)."""
