"""Where a window's time goes with a 200,000-row embedding table, and which form of the window's
update is faster (the model of embedding_bench.py: Embedding(200_000, 64), sequence 64, mean
pooling, Dense(2); micro-batch 32, k=8).

Inside compiled functions, without fit(), callbacks or tf.data, per window of 256 samples:

  big          one forward/backward pass over 256 samples and one Adam update handed the raw
               IndexedSlices (B's work)
  grads-32     8 calls of one forward/backward pass over 32 samples, gradients returned
  scatter-8    8 calls that scatter a ready micro-batch gradient's rows into the accumulators
               (gacli's accumulation)
  densify-8    8 calls that make the same gradient dense and add it (gacli before)
  <opt>-dense  the window's update handed the dense sum (accumulators / count), then the
               accumulators zeroed: what gacli does under XLA
  <opt>-rows   the same update handed the window's touched rows, each once, as IndexedSlices
               (gathered from the accumulator), then only those rows zeroed; the touched rows are
               given, so this is the most a record of them could save
  <opt>-scan   the rows form, the touched rows found by scanning the accumulator for rows that
               are not zero (no record needed; without XLA only, whose shapes must be static):
               what gacli does without XLA

for <opt> in Adam, SGD with momentum 0.9 and AdamW.

    python benchmarks/embedding_floor.py [--jit] [--repeats 5]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from embedding_bench import SIZES, text_classifier, token_arrays  # noqa: E402
from mlp_floor import interleaved_medians, loss_gradients  # noqa: E402

MICRO, K = SIZES["micro_batch_size"], SIZES["accum_steps"]
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.004),
}


def update_forms(model, accumulators, touched, jit):
    """{name: a compiled window update} for each optimizer, in its dense and its rows form."""
    table, others = model.trainable_variables[0], model.trainable_variables[1:]
    forms = {}
    for name, make in OPTIMIZERS.items():
        optimizer = make()
        optimizer.build(model.trainable_variables)

        @tf.function(jit_compile=jit)
        def dense(optimizer=optimizer):
            optimizer.apply([a / (MICRO * K) for a in accumulators], model.trainable_variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))

        def rows(optimizer=optimizer, touched=touched):
            values = tf.gather(accumulators[0], touched) / (MICRO * K)
            gradients = [tf.IndexedSlices(values, touched, tf.shape(table, "int64"))]
            gradients += [a / (MICRO * K) for a in accumulators[1:]]
            optimizer.apply(gradients, [table, *others])
            accumulators[0].scatter_update(tf.IndexedSlices(tf.zeros_like(values), touched))
            for accumulator in accumulators[1:]:
                accumulator.assign(tf.zeros_like(accumulator))

        def scan(rows=rows):
            # tf.where's shape is known only when it runs: XLA cannot compile this form.
            rows(touched=tf.where(tf.reduce_any(accumulators[0] != 0, axis=1))[:, 0])

        forms[f"{name}-dense"] = dense
        forms[f"{name}-rows"] = tf.function(rows, jit_compile=jit)
        if not jit:
            forms[f"{name}-scan"] = tf.function(scan)
    return forms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jit", action="store_true", help="compile with XLA")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--windows", type=int, default=5, help="windows of 256 per repeat")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = text_classifier(SIZES["vocabulary"], SIZES["embedding_dim"], SIZES["sequence"])
    tokens, labels = token_arrays(dict(SIZES, seed=0))
    x, y = tf.constant(tokens[: MICRO * K]), tf.constant(labels[: MICRO * K])
    touched = tf.constant(np.unique(tokens[: MICRO * K]).astype("int64"))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accumulators = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
    big_optimizer = keras.optimizers.Adam(1e-3)
    big_optimizer.build(model.trainable_variables)

    gradients = loss_gradients(model, loss_fn)

    @tf.function(jit_compile=args.jit)
    def big():
        big_optimizer.apply(gradients(x, y), model.trainable_variables)

    @tf.function(jit_compile=args.jit)
    def micro_gradients(index):
        start = index * MICRO
        return gradients(x[start : start + MICRO], y[start : start + MICRO])

    ready = micro_gradients(tf.constant(0))

    @tf.function(jit_compile=args.jit)
    def scatter(part):
        accumulators[0].scatter_add(part[0])
        for accumulator, gradient in zip(accumulators[1:], part[1:]):
            accumulator.assign_add(gradient)

    @tf.function(jit_compile=args.jit)
    def densify(part):
        for accumulator, gradient in zip(accumulators, part):
            accumulator.assign_add(tf.convert_to_tensor(gradient))

    variants = {
        "big": big,
        "grads-32": lambda: [micro_gradients(tf.constant(i)) for i in range(K)],
        "scatter-8": lambda: [scatter(ready) for _ in range(K)],
        "densify-8": lambda: [densify(ready) for _ in range(K)],
        **update_forms(model, accumulators, touched, args.jit),
    }
    window = {
        name: seconds * 1e3
        for name, seconds in interleaved_medians(
            variants, args.repeats, args.windows, model.trainable_variables[0].numpy
        ).items()
    }
    print(
        f"Embedding({SIZES['vocabulary']:,}, {SIZES['embedding_dim']}), micro {MICRO} x {K} vs "
        f"batch {MICRO * K}, jit_compile={args.jit}; {touched.shape[0]:,} rows touched in the "
        f"window; ms per window of {MICRO * K}, median of {args.repeats} interleaved repeats"
    )
    for name, value in window.items():
        print(f"  {name:15s} {value:8.2f} ms")
    for name in OPTIMIZERS:
        print(
            f"{name}: the rows form takes {window[f'{name}-rows'] / window[f'{name}-dense']:.2f}x "
            "the dense form's time"
            + (
                f", the scan form {window[f'{name}-scan'] / window[f'{name}-dense']:.2f}x"
                if f"{name}-scan" in window
                else ""
            )
        )
    floor = window["grads-32"] + window["scatter-8"] + window["adam-dense"]
    print(
        f"a window of gacli at its floor: 8 forward/backward {window['grads-32']:.1f} ms + 8 "
        f"scatters {window['scatter-8']:.1f} ms + the update {window['adam-dense']:.1f} ms = "
        f"{floor:.1f} ms, {window['big'] / floor:.2f}x big's samples/s (before: 8 dense additions "
        f"{window['densify-8']:.1f} ms instead of the scatters)"
    )


if __name__ == "__main__":
    main()
