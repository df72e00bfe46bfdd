"""What the test modules and the scripts they start share: tiny data and models, big-batch
references (plain Keras, and AGC written in NumPy), the record of measured differences, and
ga-train run as a user runs it.

Imported as ``helpers``: pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in
pyproject.toml), and a script run as ``python tests/<script>.py`` has its own folder there.
``gacli`` is always the installed package. A test module imports another only from its own folder
(the cluster tests share their job; the report's robustness tests the faults' sweeps).
"""

import glob
import os
import signal
import subprocess
import sys
import time
from importlib import resources

import keras
import numpy as np
import tensorflow as tf
from hydra import compose, initialize_config_module
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

import gacli
from gacli.runner.config.schema import register_configs

TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/: helpers, fixtures, user_project
ROOT = os.path.dirname(TESTS)  # the repository

# Set by conftest for the fast lane (pytest --in-process): a test that would start ga-train or
# ga-report as a process is skipped instead.
IN_PROCESS_ONLY = {"on": False}

# Every weight difference a test measures, by test: conftest prints them at the end of the run,
# so the numbers behind each contract row are visible, not just "passed".
MEASURED = {}
# The running test's id (conftest's autouse fixture sets it): where record() files a number.
current_test = {"id": None}


def record(value, label=None):
    """File ``value`` under ``label`` (default: the running test) and return it."""
    MEASURED.setdefault(label or current_test["id"], []).append(value)
    return value


def weights_difference(weights_a, weights_b):
    """Largest absolute difference between two lists of weights of the same shapes."""
    assert [np.shape(a) for a in weights_a] == [np.shape(b) for b in weights_b]
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def max_weight_difference(model_a, model_b):
    """Largest absolute difference between the two models' weights, recorded."""
    return record(weights_difference(model_a.get_weights(), model_b.get_weights()))


# A tiny regression problem and its MLP.
FEATURES = 4
MICRO, K = 16, 4  # the exactness tests' micro-batch size and accum_steps


def make_data(num_samples=70, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, FEATURES)).astype("float32")
    y = x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(num_samples, 1))
    return x, y.astype("float32")


def mlp_layers(seed=0, features=FEATURES, hidden=8, outputs=1, activation="tanh"):
    """Symbolic inputs/outputs of a small MLP (one hidden layer) with deterministic initial
    weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden_layer = keras.layers.Dense(hidden, activation=activation)(inputs)
    return inputs, keras.layers.Dense(outputs)(hidden_layer)


def plain_model(seed=0):
    inputs, outputs = mlp_layers(seed)
    return keras.Model(inputs, outputs)


def accumulating_model(make_optimizer, wrapper, accum_steps=K, seed=0, **accumulation):
    """The same MLP trained by either wrapper: model-based or optimizer-based."""
    if wrapper == "model":
        inputs, outputs = mlp_layers(seed)
        model = gacli.GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=outputs, **accumulation
        )
        model.compile(optimizer=make_optimizer(), loss="mse")
    else:
        model = plain_model(seed)
        model.compile(
            optimizer=gacli.GradientAccumulateOptimizer(
                make_optimizer(), accum_steps=accum_steps, **accumulation
            ),
            loss="mse",
        )
    return model


OPTIMIZERS = {
    "sgd": (lambda: keras.optimizers.SGD(0.1), 1e-6),
    "momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1e-6),
    "adam": (lambda: keras.optimizers.Adam(0.01), 1e-5),
    "adamw": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05), 1e-5),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.01), 1e-5),
}


# Big-batch references: no gacli code runs in them.
def big_batch_reference(make_optimizer, windows, x, y, loss="mse", seed=0):
    """Plain Keras, one ``train_on_batch`` per window of sample indices; returns the model."""
    model = plain_model(seed)
    model.compile(optimizer=make_optimizer(), loss=loss)
    for window in windows:
        model.train_on_batch(x[window], y[window])
    return model


def epoch_windows(num_samples, window_size, epochs):
    """Windows of ``window_size`` consecutive samples, restarting each epoch
    (partial_window=apply)."""
    windows = []
    for _ in range(epochs):
        for start in range(0, num_samples, window_size):
            windows.append(np.arange(start, min(start + window_size, num_samples)))
    return windows


# An embedding model (contract row E5): its table's gradient is a tf.IndexedSlices. Tokens come
# from a small vocabulary, so rows repeat within a micro-batch and across the micro-batches of a
# window, and some rows go untouched for a whole window.
VOCABULARY, SEQUENCE, EMBEDDING_DIM = 50, 6, 8


def token_data(num_samples=70, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCABULARY, size=(num_samples, SEQUENCE)).astype("int32")
    y = rng.normal(size=(num_samples, 1)).astype("float32")
    return x, y


def embedding_layers(seed=0, vocabulary=VOCABULARY):
    """Symbolic inputs/outputs of an embedding, mean pooling and a Dense head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SEQUENCE,), dtype="int32")
    embedded = keras.layers.Embedding(vocabulary, EMBEDDING_DIM)(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(embedded))
    return inputs, outputs


def embedding_model(seed=0, vocabulary=VOCABULARY):
    return keras.Model(*embedding_layers(seed, vocabulary))


def summed_rows(gradient):
    """``gradient`` with each repeated row of an IndexedSlices summed into one (the TF1
    optimizers' de-duplication); a dense gradient as it is."""
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def embedding_big_batch_reference(make_optimizer, windows, x, y, form="summed", seed=0):
    """Plain Keras on the embedding model, one update per window of sample indices, handed the
    big batch's MSE gradient with repeated rows summed (``form="summed"``: contract row E5's
    reference), made dense (``"dense"``) or as the tape gives it (``"raw"``: what Keras' own
    ``fit`` hands its optimizer). Returns the model."""
    model = embedding_model(seed)
    optimizer = make_optimizer()
    loss = keras.losses.MeanSquaredError()  # what compile(loss="mse") computes
    convert = {"summed": summed_rows, "dense": tf.convert_to_tensor, "raw": lambda g: g}[form]
    for window in windows:
        with tf.GradientTape() as tape:
            value = loss(y[window], model(x[window], training=True))
        gradients = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip([convert(g) for g in gradients], model.trainable_variables))
    return model


# AGC written from the NFNets paper (Brock et al. 2021, section 4.1): per-unit L2 norms,
# ``max_norm = clip_factor * max(||w_unit||, eps)``, and a unit whose ``||g_unit||`` exceeds
# ``max_norm`` is rescaled to ``max_norm / ||g_unit|| * g_unit``. Computed in float64 from the
# float32 inputs; the axes are always given by the caller, never asked of gacli.

# Unit-norm axes by rank as the NFNets reference code and gradient-accumulator take them (None: the
# whole tensor is one unit). Rank 3 is their multi-head linear [in, heads, dim].
NFNETS_AXES = {0: None, 1: None, 2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def numpy_norm(x, axes):
    """L2 norm of ``x`` over ``axes`` in float64 (``None``: the whole tensor, a scalar)."""
    x = np.asarray(x, np.float64)
    if axes is None:
        return np.sqrt(np.sum(x * x))
    return np.sqrt(np.sum(x * x, axis=tuple(axes), keepdims=True))


def numpy_agc(weight, gradient, axes, clip_factor, eps):
    """(``gradient`` clipped unit-wise against ``weight`` over ``axes``, which units clipped)."""
    gradient = np.asarray(gradient, np.float64)
    max_norm = clip_factor * np.maximum(numpy_norm(weight, axes), eps)
    gradient_norm = numpy_norm(gradient, axes)
    clips = gradient_norm > max_norm
    return np.where(clips, gradient * max_norm / np.maximum(gradient_norm, 1e-300), gradient), clips


def weight_and_gradient(shape, axes, clip_factor, seed=0):
    """A float32 weight and gradient of ``shape`` whose units (norms over ``axes``) alternate
    between clipped and untouched: ``||g|| / ||w||`` is 5 x or 0.5 x ``clip_factor``, so a wrong
    axis or a missed clip is off by far more than float32 rounding."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(size=shape).astype("float32")
    gradient = rng.normal(size=shape).astype("float32")
    ratio = numpy_norm(gradient, axes) / numpy_norm(weight, axes)
    target = np.where(np.arange(np.size(ratio)).reshape(np.shape(ratio)) % 2, 5.0, 0.5)
    if axes is None:
        target = 5.0
    return weight, (gradient * clip_factor * target / ratio).astype("float32")


def agc_big_batch_reference(make_optimizer, windows, x, y, clip_factor, eps=1e-3, seed=0):
    """Plain Keras with AGC done in NumPy: per window of sample indices, the big batch's MSE
    gradient from a tape, each weight's gradient clipped by :func:`numpy_agc` over the NFNets axes
    of its rank, then the plain optimizer's ``apply_gradients``; returns the model."""
    model = plain_model(seed)
    optimizer = make_optimizer()
    loss = keras.losses.MeanSquaredError()  # what compile(loss="mse") computes
    for window in windows:
        with tf.GradientTape() as tape:
            value = loss(y[window], model(x[window], training=True))
        gradients = tape.gradient(value, model.trainable_variables)
        clipped = [
            numpy_agc(
                variable.numpy(),
                gradient.numpy(),
                NFNETS_AXES[len(variable.shape)],
                clip_factor,
                eps,
            )[0].astype("float32")
            for variable, gradient in zip(model.trainable_variables, gradients)
        ]
        optimizer.apply_gradients(zip(clipped, model.trainable_variables))
    return model


# ga-train as a user runs it, and what its runs leave behind.
def _refuse_in_process_lane(name):
    if IN_PROCESS_ONLY["on"]:
        import pytest

        pytest.skip(f"starts {name} as a process: not in the in-process lane (--in-process)")


def console_script(name, *arguments, cwd, timeout=600, env=None):
    """Run the installed console script ``name``; returns (exit code, stdout + stderr)."""
    _refuse_in_process_lane(name)
    command = [os.path.join(os.path.dirname(sys.executable), name), *arguments]
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})})
    result = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment
    )
    return result.returncode, result.stdout + result.stderr


def ga_train(*arguments, cwd, timeout=600, env=None):
    """Run the installed ga-train; returns (exit code, stdout + stderr)."""
    return console_script("ga-train", *arguments, cwd=cwd, timeout=timeout, env=env)


def ga_report(*arguments, cwd, timeout=120):
    """Run the installed ga-report; returns (exit code, stdout + stderr)."""
    return console_script("ga-report", *arguments, cwd=cwd, timeout=timeout)


def start_ga_train(*arguments, cwd):
    """Start the installed ga-train in the background; its Popen (stdout and stderr in one)."""
    _refuse_in_process_lane("ga-train")
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "ga-train"), *arguments],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(environment, TF_CPP_MIN_LOG_LEVEL="3"),
    )


def interrupt_after_checkpoints(cwd, count, arguments, label="default"):
    """Start ga-train with ``arguments`` in ``cwd``, wait for ``count`` checkpoints of its run under
    outputs/``label``/, SIGTERM it (it saves one more and exits 143); the run directory."""
    process = start_ga_train(*arguments, cwd=cwd)
    pattern = os.path.join(cwd, "outputs", label, "*", "checkpoints", "ckpt-*.index")
    deadline = time.time() + 300
    while len(glob.glob(pattern)) < count:
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    (run_dir,) = glob.glob(os.path.join(cwd, "outputs", label, "*"))
    return run_dir


def run_dir_of(output):
    lines = [line for line in output.splitlines() if line.startswith("run directory: ")]
    assert len(lines) == 2 and lines[0] == lines[1], output  # printed first and last
    return lines[0].split(": ", 1)[1]


def first_error_line(output):
    """The first line of ga-train's refusal (``ga-train: ...``), or the whole output if none."""
    lines = [line for line in output.splitlines() if line.startswith("ga-train:")]
    return lines[0] if lines else output


def assert_refused(code, output, first_line, tmp_path):
    """ga-train's answer to bad input: exit code 2, ``first_line`` in its paragraph, no traceback,
    and no run left under ``tmp_path``/outputs that resume= could take for an unfinished one."""
    assert code == 2, output
    assert "Traceback" not in output, output
    assert first_line in output, output
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(outputs.rglob("*.yaml")), list(outputs.rglob("*"))


def shipped(package, group=None):
    """Names of the YAML files shipped in ``package`` (``group``: a config group folder)."""
    folder = resources.files(package) / group if group else resources.files(package)
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def compose_config(*overrides):
    """ga-train's config for ``overrides``, composed in-process (quiet unless progress= given)."""
    from gacli.runner.command.user_input import replaced_sections

    register_configs()
    with initialize_config_module("gacli.configs", version_base="1.3"):
        quiet = [] if any(o.startswith("progress=") for o in overrides) else ["progress=none"]
        # As ga-train does: model._target_=... alone replaces the default model's file.
        deleted = replaced_sections(list(overrides))
        return compose("train", overrides=[*quiet, *deleted, *overrides])


def ga_train_big_batch_reference(cfg, window, learning_rates=None):
    """The final weights of ga-train's job ``cfg`` (momentum SGD, a constant learning rate)
    trained by plain Keras on one device: one ``train_on_batch`` per ``window`` samples (an int,
    or one per epoch: an accumulation schedule's stages), at ``learning_rates``: one per epoch, or
    a function of (epoch, updates done) giving the next update's; None: the configured one.

    ga-train's own model and data (same builder, seed and so initial weights; same training
    split) read in ga-train's order: pass ``p`` over the data is shuffled with that pass's seed
    (``pass_order``, which test_nonfinite checks against the stream ga-train reads), and a window
    is the next ``window`` samples of it, the last one of an epoch short (partial_window=apply).
    """
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.model import build_model
    from gacli.runner.training.run_state import pass_order

    assert (cfg.optimizer._target_, cfg.optimizer.schedule.value) == (
        "keras.optimizers.SGD",
        "constant",
    )
    assert cfg.optimizer.momentum is not None
    data = load_dataset(cfg.dataset, cfg.seed)
    x, y = (np.stack(column) for column in zip(*data.train.as_numpy_iterator()))
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_outputs, data.task)
    model.compile(
        optimizer=keras.optimizers.SGD(
            cfg.optimizer.learning_rate, momentum=cfg.optimizer.momentum
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    windows = [window] * cfg.epochs if isinstance(window, int) else list(window)
    updates = 0
    for epoch in range(cfg.epochs):
        if learning_rates is not None and not callable(learning_rates):
            model.optimizer.learning_rate.assign(learning_rates[epoch])
        order = pass_order(
            data.train_size,
            epoch,
            shuffle_seed=cfg.seed if cfg.dataset.shuffle else None,
            buffer_size=min(data.train_size, 10_000),
        )
        for start in range(0, data.train_size, windows[epoch]):
            batch = order[start : start + windows[epoch]]
            if callable(learning_rates):
                model.optimizer.learning_rate.assign(learning_rates(epoch, updates))
            model.train_on_batch(x[batch], y[batch])
            updates += 1
    return model.get_weights()


def event_tags(run_dir, every_point=False):
    """(the tags, an EventAccumulator) of a run's event file; ``every_point``: keep every
    point of a series (TensorBoard keeps 10 of each otherwise)."""
    files = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(files[0], size_guidance={"tensors": 0} if every_point else None)
    events.Reload()
    return set(events.Tags()["tensors"]), events


def scalars(events, tag):
    return [float(make_ndarray(event.tensor_proto)) for event in events.Tensors(tag)]


def final_weights(run_dir):
    """The weights of the model.keras a finished run saved."""
    import gacli.engine.accumulate_model  # noqa: F401  (registers the classes model.keras refers to)

    return keras.saving.load_model(os.path.join(run_dir, "model.keras")).get_weights()


def run_difference(run_a, run_b):
    """Largest absolute difference between two finished runs' final weights."""
    return weights_difference(final_weights(run_a), final_weights(run_b))


# -- the gradient noise scale against every example's gradient (test_noise_scale.py) ----------
GNS_FEATURES, GNS_CLASSES = 8, 3
# 4090 samples, micro-batches of 16 (per replica), windows of 4: the last micro-batch holds 10
# samples and the last window 3 micro-batches, so ragged windows are part of every epoch.
GNS_SAMPLES, MICRO_GNS, K_GNS = 4090, 16, 4


def noise_scale_data(label_noise):
    """A softmax-regression problem whose labels are noisier as ``label_noise`` grows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GNS_SAMPLES, GNS_FEATURES)).astype("float32")
    scores = x @ rng.normal(size=(GNS_FEATURES, GNS_CLASSES))
    y = (scores + label_noise * rng.normal(size=scores.shape)).argmax(axis=1)
    return x, y


def noise_scale_direct(model, x, y):
    """(|G|^2, tr(Sigma)) over the whole data set, from every example's gradient."""
    kernel, bias = (variable.numpy() for variable in model.trainable_variables)
    logits = x @ kernel + bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0  # d loss / d logits, per example
    per_example = np.concatenate([(x[:, :, None] * p[:, None, :]).reshape(len(y), -1), p], 1)
    mean = per_example.mean(axis=0)
    return float((mean**2).sum()), float(((per_example - mean) ** 2).sum(axis=1).mean())


def noise_scale_run(label_noise, epochs=4, strategy=None, accum_steps=K_GNS, every=1):
    """Train at learning rate 0 (fixed weights) with noise_scale=True (measured every ``every``
    windows) under ``strategy``: (the direct (|G|^2, tr Sigma), the engine's raw estimates after
    each window, its summary)."""
    x, y = noise_scale_data(label_noise)
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        inputs = keras.Input((GNS_FEATURES,))
        model = gacli.GradientAccumulateModel(
            accum_steps=accum_steps,
            noise_scale=True,
            noise_scale_every=every,
            inputs=inputs,
            outputs=keras.layers.Dense(GNS_CLASSES)(inputs),
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    windows = []

    class EveryWindow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            optimizer = self.model.optimizer
            if int(optimizer.window_micro_steps.numpy()) == 0:
                summary = optimizer.noise_scale()
                windows.append((summary["grad_sq_raw"], summary["trace_raw"]))

    replicas = model.distribute_strategy.num_replicas_in_sync
    model.fit(
        x, y, batch_size=MICRO_GNS * replicas, epochs=epochs, verbose=0, callbacks=[EveryWindow()]
    )
    return noise_scale_direct(model, x, y), np.array(windows), model.optimizer.noise_scale()


def moving_average(windows, decay=0.95):
    """The engine's bias-corrected exponential moving average of per-window rows
    (|G|^2, tr Sigma), computed in NumPy."""
    average, weight = np.zeros(np.shape(windows)[1]), 0.0
    for row in windows:
        average = decay * average + (1.0 - decay) * np.asarray(row)
        weight = decay * weight + (1.0 - decay)
    return average / weight


def noise_scale_errors(run):
    """Relative errors of the engine's |G|^2, tr(Sigma) and B_simple, averaged over windows."""
    (grad_sq, trace), windows, _ = run
    estimated_grad_sq, estimated_trace = windows.mean(axis=0)
    return (
        abs(estimated_grad_sq / grad_sq - 1),
        abs(estimated_trace / trace - 1),
        abs((estimated_trace / estimated_grad_sq) / (trace / grad_sq) - 1),
    )


def gns_softmax_model(input_shape, num_outputs, task, descent_steps=0, label_noise=1.0):
    """A model ``_target_`` for ga-train: softmax regression on ``noise_scale_data(label_noise)``,
    its weights ``descent_steps`` steps of full-batch gradient descent (rate 1) from zero: the
    more steps, the nearer the optimum, where the gradient is small beside its noise (a larger
    B_simple)."""
    del task
    x, y = noise_scale_data(label_noise)
    kernel = np.zeros((x.shape[1], num_outputs))
    bias = np.zeros(num_outputs)
    for _ in range(descent_steps):
        logits = x @ kernel + bias
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        kernel -= x.T @ p / len(y)
        bias -= p.mean(axis=0)
    inputs = keras.Input(input_shape)
    model = keras.Model(inputs, keras.layers.Dense(num_outputs)(inputs))
    model.layers[-1].set_weights([kernel.astype("float32"), bias.astype("float32")])
    return model


def free_ports(count):
    """``count`` TCP ports on 127.0.0.1 that were free a moment ago (all held at once while they
    are picked, so that they differ)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def custom_loop(model, optimizer, x, y, micro, epochs):
    """A user's own loop: one apply_gradients per micro-batch with its sample count."""
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(
            zip(grads, model.trainable_variables), sample_count=tf.shape(xb)[0]
        )

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
    for _ in range(epochs):
        for xb, yb in dataset:
            micro_step(xb, yb)
        optimizer.finish_epoch()
