"""Engine: the shard worker, the only vllm importer (`vllm_engine`), the run's dtype and the
engine's own log.

Imports everything below it (config .. rundir). vllm and torch are imported by `vllm_engine`
when an engine is built, so importing this package does not import them."""
