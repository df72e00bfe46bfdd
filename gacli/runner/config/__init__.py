"""The typed schema registered with Hydra (schema), the one validation of a composed config
(validate), a target's arguments against its signature (arguments) and the metric a sweeper
optimises (objective). No TensorFlow.
"""
