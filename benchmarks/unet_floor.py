"""What can accumulation save on the UNet? (128x128x1, 4 levels, 16 base filters, micro-batch 8)

The issue asks gacli for >= 1.3x the samples/s of Keras' gradient_accumulation_steps (C) on this
UNet. Accumulation can only save work that plain fit at the micro-batch (A) does per micro-batch
and gacli does once a window: the optimizer update and Keras' per-call overhead. This profile
times, inside compiled functions, the parts of one micro-batch:

  step     one forward/backward pass over 8 samples and one SGD update (A's compiled work)
  grads    the forward/backward pass alone, gradients returned
  update   one SGD update from ready gradients
  add      adding ready gradients into the accumulators (gacli's extra work per micro-batch)

and prints the ceiling of accumulation against A, step / (step - update * (1 - 1/k) + add): the
speed-up gacli would have if Keras' per-call work cost nothing for either. With C at about A's
speed (bench.py measures it), the ceiling against C is about the same number.

    python benchmarks/unet_floor.py [--jit] [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jit", action="store_true", help="compile with XLA")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    spec = bench.MODELS["unet"]
    micro, k = spec["micro_batch_size"], spec["accum_steps"]
    keras.utils.set_random_seed(0)
    model = bench.shipped_model(spec)
    optimizer = keras.optimizers.SGD(bench.LEARNING_RATE)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    accumulators = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
    x, y = bench.synthetic_arrays(dict(spec, seed=0))
    x, y = tf.constant(x[:micro]), tf.constant(y[:micro])

    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def step():
        optimizer.apply(gradients(), model.trainable_variables)

    grads = tf.function(gradients, jit_compile=args.jit)
    ready = grads()

    @tf.function(jit_compile=args.jit)
    def update(part):
        optimizer.apply(part, model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def add(part):
        for accumulator, gradient in zip(accumulators, part):
            accumulator.assign_add(gradient)

    # (function, calls per timing): the cheap parts are timed over more calls.
    variants = {
        "step": (step, 4),
        "grads": (grads, 4),
        "update": (lambda: update(ready), 40),
        "add": (lambda: add(ready), 40),
    }
    for run, _ in variants.values():  # trace, compile, warm up
        run()
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (run, calls) in variants.items():  # interleaved
            start = time.perf_counter()
            for _ in range(calls):
                run()
            model.trainable_variables[0].numpy()  # wait for the last call
            times[name].append((time.perf_counter() - start) / calls)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    params = model.count_params()
    print(
        f"UNet {spec['input_shape']}, {params:,} parameters, micro-batch {micro}, k {k}, "
        f"jit_compile={args.jit}, {args.repeats} interleaved repeats; ms per micro-batch:"
    )
    for name, value in ms.items():
        print(f"  {name:7s} {value:9.3f} ms")
    # Accumulation keeps the step's forward/backward pass, adds the accumulation and pays 1/k of
    # the update. (From the step, not from grads: returning the gradients from a call costs a
    # copy that no training step pays.)
    floor = ms["step"] - ms["update"] * (1 - 1 / k) + ms["add"]
    print(
        f"update share of A's step: {ms['update'] / ms['step']:.1%}; accumulation's extra add: "
        f"{ms['add'] / ms['step']:.1%}"
    )
    print(
        f"ceiling of accumulation vs A: step / (step - update * (1 - 1/{k}) + add) = "
        f"{ms['step'] / floor:.3f}x"
    )


if __name__ == "__main__":
    main()
