"""Training (§5): Adam and the learning-rate schedule (optim), label-smoothed cross entropy
(loss), one update (step), where a run stands (progress), the loop (train), and `tmt train
--dry-run` (dry_run).

Imports: common, config, data, network, runs, translation (validation translates).
"""
