"""`batchinfer tune`: a pilot sample of the user's corpus, run through the real engine over a grid
of throughput settings (successive halving, one engine start per setting), the winning overrides
as a Hydra config group, and a forecast of the whole corpus with a bootstrap interval."""
