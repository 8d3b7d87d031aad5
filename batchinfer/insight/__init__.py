"""Insight: the login-node tools that look at a run without running it: validate, plan (sizing),
status, report, charts and cost.

Imports any package below it (config .. launch); imports neither vllm nor torch."""
