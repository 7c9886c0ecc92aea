"""What tmt keeps on disk of a model: one checkpoint (checkpoint), a run directory and where its
models are found (run), averages of checkpoints (averaging), the trainer's state (train_state), the
metrics log (metrics) and its curves (plot).

Imports: common, config, data, network.
"""
