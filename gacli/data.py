"""Data sets for ``ga-train``: each loader returns unbatched ``tf.data`` pipelines and their shapes.

``shapes`` (synthetic segmentation) and ``digits`` (scikit-learn's bundled images) need no files
and no network; ``npz``, ``image_folder`` and ``tfrecord`` read the user's data. A missing path or
an unusable file is a :class:`~gacli.config.ConfigError` before any training starts.
"""

import glob
import os
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from gacli.config import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


@dataclass
class DataBundle:
    train: tf.data.Dataset  # unbatched (x, y) pairs
    validation: "tf.data.Dataset | None"
    train_size: int
    validation_size: int
    input_shape: tuple
    task: str  # "classification" (integer labels) or "segmentation" (binary masks)
    num_outputs: int  # classes, or mask channels
    label_shape: tuple


def _split(x, y, fraction, seed):
    order = np.random.default_rng(seed).permutation(len(x))
    cut = len(x) - int(round(len(x) * fraction))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def _from_arrays(x, y, cfg, seed, task, num_outputs=None):
    if len(x) != len(y):
        raise ConfigError(
            f"dataset {cfg.name}: {len(x)} inputs but {len(y)} targets; both arrays must have one "
            "row per sample."
        )
    (x_train, y_train), (x_val, y_val) = _split(x, y, cfg.validation_split, seed)
    if len(x_train) == 0:
        raise ConfigError(
            f"dataset {cfg.name}: no training samples left after dataset.validation_split="
            f"{cfg.validation_split}; lower it, e.g. dataset.validation_split=0.1."
        )
    if task == "classification" and num_outputs is None:
        num_outputs = cfg.num_classes or int(np.max(y)) + 1
    validation = tf.data.Dataset.from_tensor_slices((x_val, y_val)) if len(x_val) else None
    return DataBundle(
        train=tf.data.Dataset.from_tensor_slices((x_train, y_train)),
        validation=validation,
        train_size=len(x_train),
        validation_size=len(x_val),
        input_shape=tuple(x.shape[1:]),
        task=task,
        num_outputs=num_outputs,
        label_shape=tuple(y.shape[1:]),
    )


def digits(cfg, seed):
    """scikit-learn's 1797 handwritten 8x8 digits, scaled to [0, 1], as images (8, 8, 1)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    return _from_arrays(x, data.target.astype("int32"), cfg, seed, "classification", 10)


def shapes(cfg, seed):
    """Seeded synthetic segmentation: noisy images with discs and squares; the mask marks discs."""
    rng = np.random.default_rng(seed)
    size, count = cfg.image_size, cfg.num_samples
    rows, cols = np.mgrid[:size, :size]
    images = rng.normal(0.0, 0.1, size=(count, size, size)).astype("float32")
    masks = np.zeros((count, size, size), "float32")
    for index in range(count):
        for _ in range(rng.integers(1, 4)):
            radius = rng.uniform(size / 10, size / 5)
            cy, cx = rng.uniform(radius, size - radius, size=2)
            if rng.random() < 0.5:
                shape = (rows - cy) ** 2 + (cols - cx) ** 2 <= radius**2
                masks[index][shape] = 1.0
            else:
                shape = (np.abs(rows - cy) <= radius) & (np.abs(cols - cx) <= radius)
            images[index][shape] += 1.0
    x = np.repeat(images[..., None], cfg.channels, axis=-1)
    return _from_arrays(x, masks[..., None], cfg, seed, "segmentation", 1)


def _require_path(cfg, what):
    if not cfg.path or cfg.path == "???":
        raise ConfigError(
            f"dataset={cfg.name} needs dataset.path=<{what}>, e.g. dataset.path=/data/{what}."
        )
    return os.path.expanduser(cfg.path)


def npz(cfg, seed):
    path = _require_path(cfg, "train.npz")
    if not os.path.isfile(path):
        raise ConfigError(
            f"dataset.path={cfg.path} does not exist; give the path of a .npz file with arrays "
            f"'{cfg.x_key}' and '{cfg.y_key}' (numpy.savez('train.npz', x=..., y=...))."
        )
    with np.load(path) as arrays:
        missing = [key for key in (cfg.x_key, cfg.y_key) if key not in arrays]
        if missing:
            raise ConfigError(
                f"{cfg.path} has no array {missing[0]!r} (it has {', '.join(arrays.files)}); set "
                "dataset.x_key= and dataset.y_key= to the names it uses."
            )
        x, y = arrays[cfg.x_key], arrays[cfg.y_key]
    x = x.astype("float32")
    if y.ndim >= 2 and y.shape[1:-1] == x.shape[1:-1] and y.ndim == x.ndim:
        return _from_arrays(x, y.astype("float32"), cfg, seed, "segmentation", y.shape[-1])
    return _from_arrays(x, y.astype("int32").reshape(len(y)), cfg, seed, "classification")


def image_folder(cfg, seed):
    import keras

    path = _require_path(cfg, "images")
    if not os.path.isdir(path):
        raise ConfigError(
            f"dataset.path={cfg.path} is not a directory; give a folder with one sub-folder of "
            "images per class, e.g. dataset.path=/data/train."
        )
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    if len(classes) < 2:
        raise ConfigError(
            f"dataset.path={cfg.path} has {len(classes)} class sub-folder(s); image_folder needs "
            "one sub-folder per class (at least two), each holding that class's images."
        )
    common = dict(
        directory=path, labels="inferred", label_mode="int", class_names=classes,
        color_mode="grayscale" if cfg.channels == 1 else "rgb",
        image_size=(cfg.image_size, cfg.image_size), batch_size=None, shuffle=True, seed=seed,
        verbose=False,
    )
    if cfg.validation_split > 0:
        train, validation = keras.utils.image_dataset_from_directory(
            validation_split=cfg.validation_split, subset="both", **common
        )
    else:
        train, validation = keras.utils.image_dataset_from_directory(**common), None
    scale = lambda image, label: (tf.cast(image, "float32") / 255.0, label)  # noqa: E731
    train = train.map(scale, num_parallel_calls=tf.data.AUTOTUNE)
    train_size = int(train.cardinality())
    validation_size = 0
    if validation is not None:
        validation = validation.map(scale, num_parallel_calls=tf.data.AUTOTUNE)
        validation_size = int(validation.cardinality())
    return DataBundle(train, validation, train_size, validation_size,
                      (cfg.image_size, cfg.image_size, cfg.channels), "classification",
                      cfg.num_classes or len(classes), ())


def tfrecord(cfg, seed):
    pattern = _require_path(cfg, "train-*.tfrecord")
    files = sorted(glob.glob(pattern))
    if not files:
        raise ConfigError(
            f"dataset.path={cfg.path} matches no file; give a TFRecord file or a glob such as "
            "dataset.path='/data/train-*.tfrecord'."
        )
    for key in (cfg.input_key, cfg.label_key):
        if key not in cfg.features:
            raise ConfigError(
                f"dataset.features has no {key!r}; describe it, e.g. "
                f"dataset.features.{key}={{shape:[28,28,1],dtype:float32}}."
            )
    spec = {
        name: tf.io.FixedLenFeature(list(feature["shape"]), feature.get("dtype", "float32"))
        for name, feature in cfg.features.items()
    }

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return tf.cast(example[cfg.input_key], "float32"), example[cfg.label_key]

    records = tf.data.TFRecordDataset(files)
    total = sum(1 for _ in records)
    validation_size = int(round(total * cfg.validation_split))
    parsed = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    # The count is known: telling tf.data lets Keras size epochs without running out of data.
    train = parsed.skip(validation_size).apply(
        tf.data.experimental.assert_cardinality(total - validation_size)
    )
    validation = parsed.take(validation_size) if validation_size else None
    label_shape = tuple(cfg.features[cfg.label_key]["shape"])
    num_outputs = cfg.num_classes
    if not num_outputs:
        num_outputs = int(max(int(np.max(label)) for _, label in parsed)) + 1
    return DataBundle(train, validation, total - validation_size, validation_size,
                      tuple(cfg.features[cfg.input_key]["shape"]), "classification", num_outputs,
                      label_shape)


LOADERS = {
    "digits": digits,
    "shapes": shapes,
    "npz": npz,
    "image_folder": image_folder,
    "tfrecord": tfrecord,
}


def load_dataset(cfg, seed=0):
    """The :class:`DataBundle` named by ``cfg.name``."""
    loader = LOADERS.get(cfg.name)
    if loader is None:
        raise ConfigError(
            f"dataset={cfg.name} is not a known dataset; use one of {', '.join(sorted(LOADERS))}, "
            "e.g. dataset=npz dataset.path=train.npz for your own arrays."
        )
    return loader(cfg, seed)
