"""What a sum over all of a gradient costs inside an XLA computation on a CPU, in two forms.

Per micro-batch, the noise scale (``monitor.gns``) takes the squared norm of the micro-batch's
gradients, and the non-finite check (``nonfinite``, on by default in ``ga-train``) tests every
element of them. Both are a reduction of each gradient to one number. On the MLP 784-512-256-10
(535,818 gradients) this times, inside compiled functions and for ``--jit`` and not:

  nothing        a function that returns a constant (the cost of the call alone)
  squares        sum of squares as a reduction: 2 * tf.nn.l2_loss (gacli's form without XLA)
  squares-by-mm  the squares in rows of 128 times a column of ones (gacli's form under XLA)
  finite         tf.reduce_all(tf.math.is_finite(g)) per gradient
  finite-by-mm   gacli's form: under XLA the non-finite elements counted by the same product;
                 without XLA each gradient, in rows of its last axis, times a column of 2**-64,
                 summed (finite exactly when every element is)
  finite-by-sq   gacli's form without XLA (under XLA it is finite-by-mm): the squared norm
                 (squares), finite only if every element is, with every element tested only
                 where it is not; with the noise scale on, that squared norm is the one it uses

and prints the median microseconds per call over interleaved rounds, and each form's cost above
``nothing``. gacli's own functions give the by-mm forms (``gacli.engine.window``).

    python benchmarks/xla_sums.py [--repeats 7] [--calls 200]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SHAPES = [(784, 512), (512,), (512, 256), (256,), (256, 10), (10,)]


def forms():
    """{name: function of the list of gradients}."""
    from gacli.engine import window

    return {
        "nothing": lambda grads: tf.constant(0.0),
        "squares": lambda grads: tf.add_n([2.0 * tf.nn.l2_loss(g) for g in grads]),
        "squares-by-mm": lambda grads: tf.add_n([window.sum_of_squares(g) for g in grads]),
        "finite": lambda grads: tf.cast(
            tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]), "float32"
        ),
        "finite-by-mm": lambda grads: tf.cast(
            tf.reduce_all([window._all_finite(g) for g in grads]), "float32"
        ),
        "finite-by-sq": lambda grads: tf.cast(
            window.all_finite(grads, window.squared_norm(grads)), "float32"
        ),
    }


def timed(functions, grads, repeats, calls):
    """{name: median microseconds per call}, the functions interleaved in each round."""
    for function in functions.values():
        function(*grads).numpy()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(calls):
                result = function(*grads)
            result.numpy()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    tf.get_logger().setLevel("ERROR")  # ten functions traced in a loop, on purpose
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=shape).astype("float32")) for shape in SHAPES]
    print(f"TensorFlow {tf.__version__}; {sum(int(np.prod(s)) for s in SHAPES):,} gradients")
    print("| form | jit | us per call | above nothing |")
    print("|---|---|---:|---:|")
    for jit in (True, False):
        functions = {
            # The input's sum keeps every gradient an input of the compiled function.
            name: tf.function(
                lambda *g, form=form: form(list(g)) + 0.0 * tf.reduce_sum(g[-1]), jit_compile=jit
            )
            for name, form in forms().items()
        }
        medians = timed(functions, grads, args.repeats, args.calls)
        for name, value in medians.items():
            above = value - medians["nothing"]
            print(f"| {name} | {'on' if jit else 'off'} | {value:,.0f} | {above:,.0f} |")


if __name__ == "__main__":
    main()
