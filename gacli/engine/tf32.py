"""TensorFloat-32: what it is, whether it is on, and a way to choose it for a block of code.

On NVIDIA GPUs from Ampere on, TensorFlow runs float32 matrix products and convolutions in TF32
by default: their inputs are rounded to 10 bits of mantissa (float32 has 23), which is about a
thousand times float32's round-off. Training still converges, but two computations of the same
update (k micro-batches and the big batch) then differ by far more than the exactness contract
allows (docs/contract.md, "On a GPU"). On a CPU, and on GPUs before Ampere, the setting changes
nothing. See TensorFlow's ``tf.config.experimental.enable_tensor_float_32_execution``.
"""

import contextlib

import tensorflow as tf

from gacli.engine.options import TF32


def tf32_enabled():
    """Whether TensorFlow would run float32 products in TF32 on a GPU that has it."""
    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


def set_tf32(mode):
    """Set TF32 per ``mode`` (a :class:`TF32` or its name; ``auto`` leaves it as it is) and
    return whether it was on before."""
    mode = TF32(mode)
    before = tf32_enabled()
    if mode is not TF32.auto:
        tf.config.experimental.enable_tensor_float_32_execution(mode is TF32.on)
    return before


@contextlib.contextmanager
def tf32_mode(mode):
    """Inside, TF32 per ``mode``; afterwards (even after an error) as it was. Yields whether it
    is on inside.

    Example:
        >>> with tf32_mode("off"):
        ...     model.fit(x, y)  # float32 products in float32 on every GPU
    """
    before = set_tf32(mode)
    try:
        yield tf32_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


def gpus_with_tf32():
    """The names of the visible GPUs whose float32 products TF32 changes (compute capability 8.0
    and up: Ampere, Hopper, Blackwell); empty on a CPU."""
    names = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        capability = details.get("compute_capability") or (0, 0)
        if tuple(capability) >= (8, 0):
            names.append(details.get("device_name", device.name))
    return names


def tf32_used(enabled):
    """Whether float32 products run in TF32: the setting ``enabled`` (:func:`tf32_enabled`) on
    and a visible GPU that has TF32. On a CPU, or on GPUs before Ampere, never."""
    return bool(enabled) and bool(gpus_with_tf32())


def tf32_description(enabled, mode=None):
    """One line for a start-up panel or a report: the state and whether it matters here;
    ``mode``, the ``tf32=`` chosen (a :class:`TF32` or its name), leads it when given."""
    gpus = gpus_with_tf32()
    mode = None if mode is None else TF32(mode).value
    if not gpus:
        effect = "no effect: no GPU that uses TF32 is visible; float32 products are exact float32"
        return effect if mode is None else f"{mode} ({effect})"
    lead = "" if mode is None else f"{mode}: "
    if enabled:
        return (
            f"{lead}on: float32 products on {gpus[0]} round inputs to 10 mantissa bits "
            "(tf32=off for float32 exactness)"
        )
    return f"{lead}off: float32 products on {gpus[0]} are exact float32"
