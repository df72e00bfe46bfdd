"""How fast can accumulation at micro-batch 32 be, next to one batch of 256? (MLP 784-512-256-10)

The issue's MLP target asks gacli for >= 0.75x the samples/s of plain fit at the big batch (B).
This profile takes fit(), callbacks and tf.data out of the picture and times, inside compiled
functions, only the arithmetic every accumulation must do:

  big      one forward/backward pass over 256 samples and one SGD update (B's work)
  fused    8 forward/backward passes over 32 samples each, summed, one update, all in ONE call
           (unrolled: TensorFlow may run the 8 passes side by side, holding all their activations)
  looped   the same in a tf.while_loop that runs one micro-batch at a time (parallel_iterations=1):
           in-graph accumulation that keeps the memory of one micro-batch
  per-call one forward/backward pass over 32 samples per call, 8 calls, then an update
           (what fit() at the micro-batch does, minus Keras' own per-step work)

and, to say where per-call's time goes, its parts alone (per window of 256 samples):

  grads-32   8 calls of one forward/backward pass over 32 samples, gradients returned, no update
  grads-256  one forward/backward pass over 256 samples, no update
  add-8      8 calls that only add a ready gradient into the accumulators (2.1 M floats each)

    python benchmarks/mlp_floor.py [--jit] [--repeats 7]

It prints the median time per sample of each and fused/big: if that ratio is below 0.75, no
accumulation that runs the micro-batches one after the other reaches the target on this machine;
the gap is the matrix multiplications' efficiency at 32 rows against 256.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MICRO, K = 32, 8


def loss_gradients(model, loss_fn):
    """``gradients(x, y)``: the gradients of ``loss_fn`` on ``model`` for one batch."""

    def gradients(x_part, y_part):
        with tf.GradientTape() as tape:
            loss = loss_fn(y_part, model(x_part, training=True))
        return tape.gradient(loss, model.trainable_variables)

    return gradients


def interleaved_medians(variants, repeats, windows, wait):
    """{name: median seconds per window}: each of ``variants`` (callables running one window)
    traced and warmed up, then timed ``windows`` at a time, the variants interleaved in each of
    ``repeats`` rounds; ``wait()`` returns once the last step has run."""
    for run in variants.values():
        run()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            for _ in range(windows):
                run()
            wait()
            times[name].append((time.perf_counter() - start) / windows)
    return {name: statistics.median(values) for name, values in times.items()}


def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jit", action="store_true", help="compile with XLA")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--windows", type=int, default=40, help="windows of 256 per repeat")
    args = parser.parse_args()

    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accumulators = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(MICRO * K, 784)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=MICRO * K).astype("int32"))

    gradients = loss_gradients(model, loss_fn)

    @tf.function(jit_compile=args.jit)
    def big():
        optimizer.apply(gradients(x, y), model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def fused():
        total = None
        for index in range(K):
            part = gradients(
                x[index * MICRO : (index + 1) * MICRO], y[index * MICRO : (index + 1) * MICRO]
            )
            total = part if total is None else [a + b for a, b in zip(total, part)]
        optimizer.apply([g / K for g in total], model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def looped():
        def body(index, total):
            start = index * MICRO
            part = gradients(x[start : start + MICRO], y[start : start + MICRO])
            return index + 1, [a + b for a, b in zip(total, part)]

        zeros = [tf.zeros_like(v) for v in model.trainable_variables]
        _, total = tf.while_loop(
            lambda index, _: index < K, body, (tf.constant(0), zeros), parallel_iterations=1
        )
        optimizer.apply([g / K for g in total], model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def micro_step(index):
        start = index * MICRO
        part = gradients(x[start : start + MICRO], y[start : start + MICRO])
        for accumulator, gradient in zip(accumulators, part):
            accumulator.assign_add(gradient)

    @tf.function(jit_compile=args.jit)
    def apply_window():
        optimizer.apply([a / K for a in accumulators], model.trainable_variables)
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    def per_call():
        for index in range(K):
            micro_step(tf.constant(index))
        apply_window()

    @tf.function(jit_compile=args.jit)
    def micro_gradients(index):
        start = index * MICRO
        return gradients(x[start : start + MICRO], y[start : start + MICRO])

    @tf.function(jit_compile=args.jit)
    def big_gradients():
        return gradients(x, y)

    ready = micro_gradients(tf.constant(0))

    @tf.function(jit_compile=args.jit)
    def add_gradient(part):
        for accumulator, gradient in zip(accumulators, part):
            accumulator.assign_add(gradient)

    def grads_32():
        for index in range(K):
            micro_gradients(tf.constant(index))

    def add_8():
        for _ in range(K):
            add_gradient(ready)

    variants = {
        "big": big,
        "fused": fused,
        "looped": looped,
        "per-call": per_call,
        "grads-32": grads_32,
        "grads-256": big_gradients,
        "add-8": add_8,
    }
    medians = {
        name: seconds / (MICRO * K)
        for name, seconds in interleaved_medians(
            variants, args.repeats, args.windows, model.trainable_variables[0].numpy
        ).items()
    }
    print(
        f"MLP 784-512-256-10, micro {MICRO} x {K} vs batch {MICRO * K}, jit_compile={args.jit},"
        f" {args.repeats} interleaved repeats of {args.windows} windows"
    )
    for name, value in medians.items():
        print(f"  {name:9s} {value * 1e6:8.1f} us/sample   {medians['big'] / value:5.2f}x big")
    print(
        f"fused / big samples/s: {medians['big'] / medians['fused']:.2f} "
        "(the ceiling for accumulation at micro-batch 32 on this machine)"
    )
    window = {name: value * MICRO * K * 1e3 for name, value in medians.items()}
    print(
        f"per window of {MICRO * K}: big {window['big']:.2f} ms = forward/backward "
        f"{window['grads-256']:.2f} ms + update; per-call {window['per-call']:.2f} ms = "
        f"8 forward/backward of {MICRO} {window['grads-32']:.2f} ms + 8 additions into the "
        f"accumulators {window['add-8']:.2f} ms + update and calls"
    )


if __name__ == "__main__":
    main()
