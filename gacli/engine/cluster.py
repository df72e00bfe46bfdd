"""Facts and settings of a multi-worker cluster that TensorFlow keeps private: whether a strategy
really spans several processes, and how long a silent worker is waited for. Read and set through
``_keras_compat``."""

from gacli.engine import _keras_compat as compat


def in_multi_worker_mode(strategy):
    """Whether ``strategy`` is a ``tf.distribute.MultiWorkerMirroredStrategy`` that really spans
    several processes (one made without a ``TF_CONFIG`` cluster runs in one process)."""
    return compat.in_multi_worker_mode(strategy)


def configure_heartbeat_timeout(seconds):
    """Make a lost worker known to the others after ``seconds``: the heartbeat timeout of
    TensorFlow's coordination service for the ``TF_CONFIG`` cluster, set up as
    ``MultiWorkerMirroredStrategy`` would set it up. The other workers' collectives then fail
    with ``tf.errors.UnavailableError`` instead of waiting (TensorFlow's default is minutes).
    Call it before the strategy is made; a process configures its cluster once, and a second
    call changes nothing. TensorFlow's public API has no setting for it."""
    return compat.configure_heartbeat_timeout(seconds)
