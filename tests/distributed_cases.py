"""Runs accumulation under MirroredStrategy on logical CPU devices; prints JSON of the measured
max abs weight differences against single-device big-batch runs.

A separate process because the CPU must be split into logical devices before TensorFlow
initialises. Usage: python tests/distributed_cases.py (its folder on sys.path finds ``helpers``).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import gacli  # noqa: E402
from helpers import (  # noqa: E402
    agc_big_batch_reference,
    big_batch_reference,
    embedding_big_batch_reference,
    embedding_layers,
    epoch_windows,
    make_data,
    max_weight_difference,
    mlp_layers,
    moving_average,
    noise_scale_errors,
    noise_scale_run,
    plain_model,
    token_data,
)

OPTIMIZERS = {
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    # Clipping binds here (gradient norms are ~1): it must act on the gradient of the whole
    # window over all replicas, not on each replica's part.
    "momentum-global-clipnorm": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.02
    ),
    "momentum-clipvalue": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipvalue=0.002),
    "sgd-agc": lambda: keras.optimizers.SGD(0.5),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
}
EPOCHS = 2
CLIP_FACTOR = 0.01


def setting(optimizer, replicas, samples, micro, accum_steps):
    """Data, the single-device big-batch reference (windows of micro x replicas x k samples) and
    a MirroredStrategy over ``replicas`` logical CPUs."""
    x, y = make_data(samples)
    windows = epoch_windows(samples, micro * replicas * accum_steps, EPOCHS)
    if "agc" in optimizer:
        # AGC on the big batch's gradient, computed in NumPy: no gacli code in the reference.
        reference = agc_big_batch_reference(OPTIMIZERS[optimizer], windows, x, y, CLIP_FACTOR)
    else:
        reference = big_batch_reference(OPTIMIZERS[optimizer], windows, x, y)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    return x, y, reference, strategy


def fit_case(wrapper, optimizer, replicas, samples, micro, accum_steps, steps_per_execution=1):
    """model.fit with a global batch of micro x replicas."""
    x, y, reference, strategy = setting(optimizer, replicas, samples, micro, accum_steps)
    with strategy.scope():
        if wrapper == "model":
            inputs, outputs = mlp_layers()
            model = gacli.GradientAccumulateModel(
                accum_steps=accum_steps,
                inputs=inputs,
                outputs=outputs,
                use_agc="agc" in optimizer,
                clip_factor=CLIP_FACTOR,
            )
            model.compile(
                optimizer=OPTIMIZERS[optimizer](),
                loss="mse",
                steps_per_execution=steps_per_execution,
            )
        else:
            model = plain_model()
            model.compile(
                optimizer=gacli.GradientAccumulateOptimizer(
                    OPTIMIZERS[optimizer](),
                    accum_steps=accum_steps,
                    use_agc="agc" in optimizer,
                    clip_factor=CLIP_FACTOR,
                ),
                loss="mse",
            )
    model.fit(x, y, batch_size=micro * replicas, epochs=EPOCHS, shuffle=False, verbose=0)
    return max_weight_difference(model, reference)


def custom_loop_case(optimizer, replicas, samples, micro, accum_steps, loss_style="local-mean"):
    """A user's loop: strategy.run per global micro-batch, each replica passing its count.

    ``loss_style``, the three ways Keras and TensorFlow users write a replica's loss:
    ``local-mean`` (the replica's mean), ``keras-loss`` (a keras.losses.Loss called in replica
    context: the mean divided by the replicas) and ``compute-average-loss``
    (tf.nn.compute_average_loss with the global micro-batch size).
    """
    x, y, reference, strategy = setting(optimizer, replicas, samples, micro, accum_steps)
    with strategy.scope():
        model = plain_model()
        accumulator = gacli.GradientAccumulateOptimizer(
            OPTIMIZERS[optimizer](), accum_steps=accum_steps
        )
        accumulator.build(model.trainable_variables)
        keras_loss = keras.losses.MeanSquaredError()
    global_micro = micro * replicas
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_micro)
    )

    @tf.function
    def train_micro_batch(x_batch, y_batch):
        def on_replica(x_local, y_local):
            count = tf.shape(x_local)[0]
            with tf.GradientTape() as tape:
                prediction = model(x_local, training=True)
                if loss_style == "keras-loss":
                    loss = keras_loss(y_local, prediction)
                    divisor = count * strategy.num_replicas_in_sync
                elif loss_style == "compute-average-loss":
                    per_example = tf.reduce_mean(tf.square(prediction - y_local), axis=-1)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_micro)
                    divisor = global_micro
                else:
                    loss = tf.reduce_mean(tf.square(prediction - y_local))
                    divisor = None
            grads = tape.gradient(loss, model.trainable_variables)
            accumulator.apply_gradients(
                zip(grads, model.trainable_variables), sample_count=count, loss_divisor=divisor
            )

        strategy.run(on_replica, args=(x_batch, y_batch))

    for _ in range(EPOCHS):
        for x_batch, y_batch in dataset:
            train_micro_batch(x_batch, y_batch)
        accumulator.finish_epoch()
    return max_weight_difference(model, reference)


def restored_case(optimizer, replicas=2):
    """Plain fit() with the optimizer wrapper stops mid-window (3 micro-batches, k=2); new objects
    restore the checkpoint and apply the open window, as a resumed run's end does. Nothing in the
    new objects has traced a micro-step: the window must be applied from saved state alone."""
    import tempfile

    x, y = make_data(96)
    make_optimizer = OPTIMIZERS[optimizer]
    reference = big_batch_reference(make_optimizer, [np.arange(0, 64), np.arange(64, 96)], x, y)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])

    def build():
        with strategy.scope():
            model = plain_model()
            model.compile(
                optimizer=gacli.GradientAccumulateOptimizer(make_optimizer(), accum_steps=2),
                loss="mse",
            )
            model.optimizer.build(model.trainable_variables)
        return model, tf.train.Checkpoint(model=model, optimizer=model.optimizer)

    model, checkpoint = build()
    with model.optimizer.fit_continues():
        model.fit(x, y, batch_size=16 * replicas, epochs=1, shuffle=False, verbose=0)
    path = checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    restored, checkpoint = build()
    with strategy.scope():
        checkpoint.restore(path).assert_existing_objects_matched()
    restored.optimizer.finish_epoch(last=True)
    return max_weight_difference(restored, reference)


def embedding_case(optimizer, replicas, samples, micro, accum_steps):
    """The model wrapper's fit() on the embedding model, whose sparse gradients are accumulated
    on each replica, against the single-device big batch with repeated rows summed (E5)."""
    x, y = token_data(samples)
    windows = epoch_windows(samples, micro * replicas * accum_steps, EPOCHS)
    reference = embedding_big_batch_reference(OPTIMIZERS[optimizer], windows, x, y)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        inputs, outputs = embedding_layers()
        model = gacli.GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=outputs
        )
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    model.fit(x, y, batch_size=micro * replicas, epochs=EPOCHS, shuffle=False, verbose=0)
    return max_weight_difference(model, reference)


def noise_scale_case(accum_steps):
    """The largest relative error of the noise scale's parts under 2 replicas (each replica's
    micro-batch is a small batch, the window over both replicas the big one)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return max(noise_scale_errors(noise_scale_run(1.5, strategy=strategy, accum_steps=accum_steps)))


def noise_scale_every_case():
    """Under 2 replicas, noise_scale_every=3 against every window measured: the largest relative
    difference of its smoothed |G|^2 and tr(Sigma) from the moving average (decay 0.95) of the
    every-window run's raw estimates at windows 0, 3, 6, ... (fixed weights: the same windows)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    _, every_window, _ = noise_scale_run(1.5, epochs=1, strategy=strategy)
    _, _, summary = noise_scale_run(1.5, epochs=1, strategy=strategy, every=3)
    expected = moving_average(every_window[::3])
    found = np.array([summary["grad_sq"], summary["trace_cov"]])
    count_error = abs(summary["windows"] - len(every_window[::3]))
    return float(np.max(np.abs(found / expected - 1))) + count_error


# (replicas, samples, micro-batch per replica, accum_steps) of the 2-replica settings.
def remat_case(precision, replicas=2, samples=70, micro=16, accum_steps=2):
    """The model wrapper's fit() under MirroredStrategy with and without recomputation (blocks
    of Dense, AccumBatchNormalization, ReLU and Dropout; ragged windows): the largest difference
    of any variable, the moving statistics and window sums included."""
    x, y = make_data(samples)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    keras.mixed_precision.set_global_policy(precision)
    variables = []
    try:
        for remat in (None, "every"):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                layers = [keras.Input((x.shape[1],))]
                for _ in range(2):
                    layers += [
                        keras.layers.Dense(8, use_bias=False),
                        gacli.AccumBatchNormalization(accum_steps=accum_steps, momentum=0.5),
                        keras.layers.ReLU(),
                        keras.layers.Dropout(0.3),
                    ]
                layers.append(keras.layers.Dense(1, dtype="float32"))
                model = gacli.wrap_model(
                    keras.Sequential(layers), accum_steps=accum_steps, remat=remat
                )
                model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
            model.fit(x, y, batch_size=micro * replicas, epochs=EPOCHS, shuffle=False, verbose=0)
            variables.append([np.asarray(v.numpy(), "float64") for v in model.variables])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return max(float(np.max(np.abs(a - b))) for a, b in zip(*variables, strict=True))


RAGGED = (2, 70, 16, 2)
FULL = (2, 128, 16, 2)


def cases():
    """{case name: a function that measures it}."""
    found = {}
    for optimizer in ("momentum", "adam"):
        # 70 samples: global micro-batches of 32, 32, 6 (3 per replica); windows of 64 and 6.
        found[f"model-2replicas-ragged-{optimizer}"] = (fit_case, "model", optimizer, 2, 70, 16, 2)
        found[f"model-1replica-ragged-{optimizer}"] = (fit_case, "model", optimizer, 1, 70, 16, 4)
        # A plain model's fit() weighs micro-batches equally: full windows only.
        found[f"optimizer-2replicas-{optimizer}"] = (fit_case, "optimizer", optimizer, *FULL)
        for style in ("local-mean", "keras-loss", "compute-average-loss"):
            found[f"custom-loop-{style}-2replicas-ragged-{optimizer}"] = (
                custom_loop_case, optimizer, *RAGGED, style)  # fmt: skip
        # Several micro-batches a compiled call (gacli's own loop under several replicas): 3 does
        # not divide the epoch's 5 micro-batches, and windows of 2 straddle the calls.
        found[f"model-2replicas-ragged-steps_per_execution-{optimizer}"] = (
            fit_case, "model", optimizer, 2, 150, 16, 2, 3)  # fmt: skip
    for optimizer in ("momentum-global-clipnorm", "momentum-clipvalue", "sgd-agc"):
        found[f"model-2replicas-ragged-{optimizer}"] = (fit_case, "model", optimizer, *RAGGED)
        found[f"optimizer-2replicas-{optimizer}"] = (fit_case, "optimizer", optimizer, *FULL)
    for optimizer in ("momentum", "momentum-clipvalue", "momentum-global-clipnorm"):
        found[f"optimizer-2replicas-restored-{optimizer}"] = (restored_case, optimizer)
    for accum_steps in (1, 4):
        found[f"noise-scale-2replicas-k{accum_steps}"] = (noise_scale_case, accum_steps)
    found["noise-scale-2replicas-every3"] = (noise_scale_every_case,)
    for optimizer in ("momentum", "adam", "adamw"):
        found[f"embedding-model-2replicas-ragged-{optimizer}"] = (
            embedding_case, optimizer, *RAGGED)  # fmt: skip
    for precision in ("float32", "mixed_float16"):
        found[f"remat-model-2replicas-ragged-{precision}"] = (remat_case, precision)
    return found


# Each group runs in a process of its own: their models differ from the MLP of the others, and a
# second MirroredStrategy in one process can reuse the first's collective instance keys, which
# fails on tensors of another shape (TensorFlow's collectives, not gacli's).
SEPARATE = ("noise-scale", "embedding", "remat")


def main():
    """All cases but the SEPARATE ones, or those whose name holds the first argument:
    python tests/distributed_cases.py restored"""
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    results = {
        name: case[0](*case[1:])
        for name, case in cases().items()
        if (only in name if only else not any(group in name for group in SEPARATE))
    }
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
