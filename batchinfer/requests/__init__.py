"""Requests: a row -> chat messages or raw prompt -> tokens and sampling for the engine.

One path used by the worker, validate and plan. Imports the base modules, models and inputs."""
