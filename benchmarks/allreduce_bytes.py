"""Contract row D2: bytes the workers exchange per micro-batch, with k=1 and k=8.

Starts two MultiWorkerMirroredStrategy workers on 127.0.0.1 for each accumulation setting, trains
the same number of micro-batches with gacli's model wrapper, and reads the loopback interface's
byte counter (/proc/net/dev, Linux) around the measured micro-batches in worker 0. With k=8 the
gradients are all-reduced once per window instead of once per micro-batch, so about 1/8 of the
bytes should cross.

    python benchmarks/allreduce_bytes.py            # MLP 784-512-256-10, 64 measured micro-batches
    python benchmarks/allreduce_bytes.py --quick    # a small MLP, 32 micro-batches (the test's)

Plain Keras cannot be the baseline here: its fit() fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585), so k=1 is gacli with accumulation off.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

WARMUP = 8  # micro-batches before the measurement: one full window for every k measured


def loopback_bytes():
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])  # received; each byte is sent once on lo
    raise RuntimeError("no loopback interface in /proc/net/dev")


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import gacli

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = args.micro_batch * strategy.num_replicas_in_sync
    steps = WARMUP + args.micro_batches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, args.widths[0])).astype("float32")
    y = rng.integers(0, args.widths[-1], size=len(x)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((args.widths[0],))
        hidden = inputs
        for width in args.widths[1:-1]:
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        outputs = keras.layers.Dense(args.widths[-1])(hidden)
        model = gacli.GradientAccumulateModel(
            accum_steps=args.accum, inputs=inputs, outputs=outputs
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    marks = {}

    class Meter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 in (WARMUP, steps):
                marks[batch + 1] = (loopback_bytes(), int(model.optimizer_step.numpy()))

    model.fit(data, epochs=1, verbose=0, callbacks=[Meter()])
    (start, first_update), (end, last_update) = marks[WARMUP], marks[steps]
    print(
        "MEASURED "
        + json.dumps(
            {
                "bytes": end - start,
                "micro_batches": args.micro_batches,
                "updates": last_update - first_update,
                "parameters": model.count_params(),
            }
        ),
        flush=True,
    )


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def measure(accum, args):
    """Run one two-worker cluster; worker 0's measurement."""
    ports = free_ports(2)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--accum",
        str(accum),
        "--micro-batches",
        str(args.micro_batches),
        "--micro-batch",
        str(args.micro_batch),
        "--widths",
        *map(str, args.widths),
    ]
    processes = []
    for index in range(2):
        cluster = {
            "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
        environment = dict(os.environ, TF_CONFIG=json.dumps(cluster), TF_CPP_MIN_LOG_LEVEL="3")
        processes.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
            )
        )
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        if process.returncode != 0:
            raise SystemExit(f"worker failed (k={accum}):\n{out[-2000:]}\n{err[-3000:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("MEASURED "))
    return json.loads(line[len("MEASURED ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small MLP, 32 micro-batches")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument(
        "--micro-batches", type=int, default=64, help="measured micro-batches (a multiple of 8)"
    )
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per worker")
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[784, 512, 256, 10],
        help="MLP layer widths, input first",
    )
    args = parser.parse_args()
    if args.quick and not args.worker:
        args.micro_batches, args.widths = 32, [64, 256, 10]
    if args.worker:
        return worker(args)
    if args.micro_batches % 8:
        parser.error("--micro-batches must be a multiple of 8")
    results = {str(k): measure(k, args) for k in (1, 8)}
    one, eight = results["1"], results["8"]
    print(
        f"D2: 2 workers on 127.0.0.1, MLP {'-'.join(map(str, args.widths))} "
        f"({one['parameters']:,} parameters, {4 * one['parameters']:,} bytes of float32 "
        f"gradients), {args.micro_batches} micro-batches of {args.micro_batch} per worker"
    )
    print(f"{'k':>3} {'updates':>8} {'bytes':>12} {'bytes/update':>13} {'bytes/micro-batch':>18}")
    for k, row in results.items():
        print(
            f"{k:>3} {row['updates']:>8} {row['bytes']:>12,} "
            f"{row['bytes'] / max(row['updates'], 1):>13,.0f} "
            f"{row['bytes'] / row['micro_batches']:>18,.0f}"
        )
    print(f"k=8 / k=1 bytes: {eight['bytes'] / one['bytes']:.3f} (target <= 0.25, ideal 0.125)")
    if args.json:
        print(json.dumps({"gacli": results}))


if __name__ == "__main__":
    main()
