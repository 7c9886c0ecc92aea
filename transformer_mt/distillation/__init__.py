"""`tmt distill`: sequence-level knowledge distillation in one command (distill) and its record,
read back verified (record).

Imports: common, config, data, network, runs, translation, exchange, training (it translates
with a teacher, trains a student and exports it).
"""
