"""tf.distribute strategies for ``ga-train``: default, one_device, mirrored, multi_worker, tpu."""

import os

import tensorflow as tf

from gacli.rundir import read_tf_config
from gacli.runner.config.schema import ClusterSource, ConfigError, StrategyName


def _split_cpu(count):
    """Split the first CPU into ``count`` logical devices (must happen before TF uses devices)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < count:
            raise ConfigError(
                f"strategy.logical_cpus={count}: TensorFlow was already initialised in this "
                f"process with {have} CPU device(s) (e.g. an earlier job of a multirun); run "
                "this setting in its own process."
            ) from None


def _check_devices(devices):
    """ConfigError for an asked-for device this machine does not have: TensorFlow would put the
    work on the CPU without a word (one_device) or wait for ever (mirrored)."""

    if not devices:
        return  # and TensorFlow's devices stay unlisted: a multi-worker cluster starts later

    def short(name):  # /job:localhost/replica:0/task:0/device:GPU:0 -> /gpu:0
        return "/" + name.lower().rsplit("/", 1)[-1].removeprefix("device:")

    known = sorted({short(device.name) for device in tf.config.list_logical_devices()})
    for device in devices:
        if short(device) not in known:
            raise ConfigError(
                f"strategy.devices names {device}, which this machine does not have; it has "
                f"{', '.join(known)}. Name those (e.g. strategy.devices=[{known[-1]}]), or "
                "leave strategy.devices empty for all of them."
            )


def make_strategy(cfg):
    """The ``tf.distribute.Strategy`` named by ``cfg`` (a StrategyConfig)."""
    if cfg.logical_cpus:
        _split_cpu(cfg.logical_cpus)
    _check_devices(cfg.devices)
    if cfg.name == StrategyName.default:
        return tf.distribute.get_strategy()
    if cfg.name == StrategyName.one_device:
        device = (
            cfg.devices[0]
            if cfg.devices
            else ("/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0")
        )
        return tf.distribute.OneDeviceStrategy(device)
    if cfg.name == StrategyName.mirrored:
        devices = list(cfg.devices) or None
        if devices is None and cfg.logical_cpus and not tf.config.list_logical_devices("GPU"):
            cpus = tf.config.list_logical_devices("CPU")[: cfg.logical_cpus]
            devices = [device.name for device in cpus]
        return tf.distribute.MirroredStrategy(devices)
    if cfg.name == StrategyName.multi_worker and cfg.cluster == ClusterSource.slurm:
        from gacli.runner.cluster import slurm

        slurm.configure(port=cfg.port)  # TF_CONFIG from SLURM's environment (done once)
    if cfg.name == StrategyName.multi_worker:
        config = os.environ.get("TF_CONFIG")
        if not config:
            raise ConfigError(
                "strategy=multi_worker reads the cluster from the TF_CONFIG environment variable, "
                'which is not set; e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", '
                '"host2:12345"]}, "task": {"type": "worker", "index": 0}}\' '
                "(docs/guides/distributed.md shows Kubernetes and SLURM)."
            )
        read_tf_config(config)  # ConfigError, saying what to give, for one that cannot be read
        from gacli.engine.cluster import configure_heartbeat_timeout

        configure_heartbeat_timeout(cfg.peer_timeout_seconds)
        return tf.distribute.MultiWorkerMirroredStrategy()
    # TPU: the resolver finds the TPU from strategy.tpu or the environment (e.g. TPU_NAME).
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=cfg.tpu or None)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.OpError) as error:
        raise ConfigError(
            f"strategy=tpu found no TPU ({str(error).splitlines()[0]}). Run on a TPU VM, or give "
            "its name or address, e.g. strategy.tpu=my-tpu or strategy.tpu=grpc://10.0.0.2:8470; "
            "elsewhere use strategy=default or strategy=mirrored."
        ) from None
    return tf.distribute.TPUStrategy(resolver)


def is_multi_worker(strategy):
    """Whether ``strategy`` spans several worker processes."""
    from gacli.engine.cluster import in_multi_worker_mode

    return in_multi_worker_mode(strategy)
