"""Configuration: the typed `Config` dataclasses Hydra composes, and the run's fingerprint.

Owns the schema (`schema`), composition from overrides (`compose`) and the fingerprint rule
(`fingerprint`). Imports only the base modules (errors, security) and the models package."""
