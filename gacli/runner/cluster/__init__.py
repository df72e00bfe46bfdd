"""Devices and several processes: the ``tf.distribute`` strategy (strategy), SLURM's environment as
a cluster (slurm), a worker lost in training (lost_worker).
"""
