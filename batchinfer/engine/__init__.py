"""Engine: the only vllm importer (`vllm_engine`), the shard worker (`worker`: a shard under its
lock, from its committed parts to DONE.json) and its scheduler (`scheduler`: add/step/collect and
commits, with `feed`, `crashes`, and the task's rows in `generation` and `pooled`), the stop flag,
the engine class a worker builds (`factory`), the run's dtype and the engine's own log (`output`).

Imports everything below it (config .. rundir). vllm and torch are imported by `vllm_engine`
when an engine is built, so importing this package does not import them."""
