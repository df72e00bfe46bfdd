"""One worker of a two-process MultiWorkerMirroredStrategy cluster (TF_CONFIG set by the test).

Trains the library's two entry points on ragged data (70 samples, global micro-batches of 16, 16,
16, 16, 6) and compares each with a big-batch run in this process, without a strategy; prints
``RESULTS {json}`` with the max abs weight differences and a digest of the final weights.
Usage: TF_CONFIG=... python tests/multiworker_cases.py (its folder on sys.path finds ``helpers``).
"""

import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gacli  # noqa: E402
from helpers import (  # noqa: E402
    big_batch_reference,
    epoch_windows,
    make_data,
    max_weight_difference,
    mlp_layers,
    plain_model,
)

SAMPLES, PER_WORKER, ACCUM, EPOCHS = 70, 8, 2, 2


def digest(model):
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = PER_WORKER * strategy.num_replicas_in_sync
    x, y = make_data(SAMPLES)
    windows = epoch_windows(SAMPLES, global_batch * ACCUM, EPOCHS)
    reference = big_batch_reference(lambda: keras.optimizers.SGD(0.1, momentum=0.9), windows, x, y)
    results = {}

    with strategy.scope():
        inputs, outputs = mlp_layers()
        model = gacli.GradientAccumulateModel(accum_steps=ACCUM, inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch), epochs=EPOCHS, verbose=0
    )
    results["fit-model-wrapper"] = max_weight_difference(model, reference)
    results["fit-model-wrapper-digest"] = digest(model)

    with strategy.scope():
        model = plain_model()
        accumulator = gacli.GradientAccumulateOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), accum_steps=ACCUM
        )
        accumulator.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    )

    @tf.function
    def train_micro_batch(batch):
        def on_replica(x_local, y_local):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x_local, training=True) - y_local))
            grads = tape.gradient(loss, model.trainable_variables)
            accumulator.apply_gradients(
                zip(grads, model.trainable_variables), sample_count=tf.shape(x_local)[0]
            )

        strategy.run(on_replica, args=batch)

    for _ in range(EPOCHS):
        for batch in dataset:
            train_micro_batch(batch)
        accumulator.finish_epoch()
    results["custom-loop"] = max_weight_difference(model, reference)
    results["custom-loop-digest"] = digest(model)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
