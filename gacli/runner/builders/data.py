"""Data sets for ``ga-train``: each loader returns unbatched ``tf.data`` pipelines and their shapes.

``shapes`` (synthetic segmentation) and ``digits`` (scikit-learn's bundled images) need no files
and no network; ``npz``, ``image_folder`` and ``tfrecord`` read the user's data.

Every loader checks its data before training starts, at the cost of one read: a missing path, a
file that cannot be read or decoded, a non-finite input, or a label outside ``[0, num_classes)``
is a :class:`~gacli.errors.ConfigError` that names the file and the sample, so it is never found
an hour into training.
"""

import glob
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tensorflow as tf

from gacli.errors import ConfigError
from gacli.runner.builders import targets
from gacli.runner.config.arguments import section_arguments

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
# A dataset target's data of unknown size (a generator, a filter()) is read whole before
# training; past this many elements it is taken for one that never ends and refused. Data of a
# known size (assert_cardinality) is read to its end.
UNKNOWN_SIZE_LIMIT = 1_000_000


@dataclass
class DataBundle:
    train: tf.data.Dataset  # unbatched (x, y) pairs
    validation: "tf.data.Dataset | None"
    train_size: int
    validation_size: int
    input_shape: tuple
    # "classification" (integer labels), "segmentation" (binary masks) or "regression" (float
    # targets, one row of width num_outputs a sample)
    task: str
    num_outputs: int  # classes, mask channels, or regression targets per sample
    label_shape: tuple
    # What to call the training sample at a position of ``train`` (unshuffled) in a message,
    # within ``source`` (a file, a folder, a bundled data set).
    sample_name: Callable[[int], str] = lambda position: f"sample {position}"
    source: str = "the training data"


def _split_order(count, fraction, seed):
    """(training positions, validation positions) of a seeded split of ``count`` samples."""
    order = np.random.default_rng(seed).permutation(count)
    cut = count - int(round(count * fraction))
    return order[:cut], order[cut:]


def _first_rows(mask, name=lambda row: f"row {row}"):
    """'3 samples (the first: row 17)' for the rows where ``mask`` is true."""
    rows = np.flatnonzero(mask)
    return f"{len(rows)} sample{'s' if len(rows) != 1 else ''} (the first: {name(rows[0])})"


def _nonfinite_rows(values):
    """Which rows (samples) of ``values`` hold inf or nan: a bool per row."""
    if not len(values):
        return np.zeros(0, bool)
    return ~np.isfinite(np.asarray(values).reshape(len(values), -1)).all(axis=1)


def _check_arrays(x, y, cfg, source, task, num_outputs):
    """ConfigError naming the rows of non-finite inputs or targets and of bad labels; returns
    the number of classes for classification."""
    if not np.issubdtype(x.dtype, np.number) and x.dtype != bool:
        raise ConfigError(
            f"{source}: the inputs have dtype {x.dtype}; save numbers (e.g. x.astype('float32'))."
        )
    bad = _nonfinite_rows(x)
    if bad.any():
        raise ConfigError(
            f"{source}: the inputs of {_first_rows(bad)} hold inf or nan; one such value turns "
            "every weight into nan. Replace those values (e.g. numpy.nan_to_num) or drop the "
            "samples."
        )
    if task == "segmentation":
        bad = _nonfinite_rows(y)
        if bad.any():
            raise ConfigError(
                f"{source}: the masks of {_first_rows(bad)} hold inf or nan; replace or drop them."
            )
        return num_outputs
    if task == "regression":
        return _check_targets(y, source)
    return _check_labels(y, cfg, source, num_outputs)


def _check_targets(y, source, name=lambda row: f"row {row}"):
    """The width of regression targets (samples, width); ConfigError naming the rows that are not
    finite numbers."""
    if not np.issubdtype(y.dtype, np.number) or y.ndim not in (1, 2):
        raise ConfigError(
            f"{source}: dataset.task=regression needs float targets of shape (samples,) or "
            f"(samples, k), and the targets have dtype {y.dtype} and shape {y.shape}; save "
            "numbers (e.g. y.astype('float32')), or drop dataset.task for class labels."
        )
    bad = _nonfinite_rows(y)
    if bad.any():
        raise ConfigError(
            f"{source}: the targets of {_first_rows(bad, name)} hold inf or nan, which would "
            "turn every weight into nan; replace or drop those samples."
        )
    _refuse_overflowing_targets(y, source, name)
    return 1 if y.ndim == 1 else y.shape[1]


def _refuse_overflowing_targets(y, source, name):
    """ConfigError for regression targets whose squares, summed over the samples, overflow
    float32: the squared error of a model that predicts about 0, as an untrained one does, and
    the epoch's loss total would be inf."""
    squares = np.square(np.asarray(y, "float64")).reshape(len(y), -1).sum(axis=1)
    if squares.sum() <= np.finfo("float32").max:
        return
    row = int(np.argmax(squares))
    largest = float(np.max(np.abs(np.asarray(y, "float64").reshape(len(y), -1)[row])))
    raise ConfigError(
        f"{source}: the targets are too large to train on in float32: {name(row)} holds "
        f"{largest:.3g}, and the squares of such targets, summed over the {len(y)} samples, "
        f"exceed float32's largest number ({np.finfo('float32').max:.3g}), so the mean squared "
        "error would be inf. Scale the targets to about 1 (e.g. y / y.std(), and the "
        "predictions back by the same factor), or drop those samples."
    )


def _check_labels(y, cfg, source, num_outputs, name=lambda row: f"row {row}"):
    """The number of classes; ConfigError naming the labels that are not class indices."""
    if not np.issubdtype(y.dtype, np.number):
        raise ConfigError(
            f"{source}: the labels have dtype {y.dtype}; classification needs "
            "integer class indices 0 .. num_classes-1."
        )
    fractional = (
        ~np.isfinite(y) | (y != np.round(y))
        if np.issubdtype(y.dtype, np.floating)
        else np.zeros(len(y), bool)
    )
    if fractional.any():
        raise ConfigError(
            f"{source}: the labels of {_first_rows(fractional, name)} are not whole numbers; "
            "classification needs integer class indices 0 .. num_classes-1 (one-hot labels: "
            "y.argmax(axis=1)); to predict the numbers themselves, add dataset.task=regression."
        )
    classes = num_outputs or cfg.num_classes or (int(np.max(y)) + 1 if len(y) else 0)
    outside = (y < 0) | (y >= classes)
    if outside.any():
        raise ConfigError(
            f"{source}: the labels of {_first_rows(outside, name)} lie outside 0 .. {classes - 1} "
            f"(the first is {int(y[np.flatnonzero(outside)[0]])}); "
            + (
                "set dataset.num_classes to the number of classes, or fix those labels."
                if cfg.num_classes
                else "labels must be class indices counted from 0."
            )
        )
    return classes


def _from_arrays(arrays, cfg, seed, task, num_outputs=None, source=None):
    """The DataBundle of ``arrays`` = (inputs, targets), one row per sample."""
    x, y = arrays
    source = source or f"dataset {cfg.name}"
    if len(x) != len(y):
        raise ConfigError(
            f"{source}: {len(x)} inputs but {len(y)} targets; both arrays must have one row per "
            "sample."
        )
    num_outputs = _check_arrays(x, y, cfg, source, task, num_outputs)
    if len(x) == 0:
        raise ConfigError(
            f"{source} holds no samples, so there is nothing to train on; point dataset.path at "
            "data that holds samples."
        )
    train_rows, validation_rows = _split_order(len(x), cfg.validation_split, seed)
    if len(train_rows) == 0:
        raise ConfigError(
            f"{source}: no training samples left after dataset.validation_split="
            f"{cfg.validation_split}; lower it, e.g. dataset.validation_split=0.1."
        )
    x = x.astype("float32", copy=False)
    y = y.astype("int32" if task == "classification" else "float32", copy=False)
    y = y.reshape(len(y), num_outputs) if task == "regression" else y
    validation = None
    if len(validation_rows):
        validation = tf.data.Dataset.from_tensor_slices((x[validation_rows], y[validation_rows]))
    return DataBundle(
        train=tf.data.Dataset.from_tensor_slices((x[train_rows], y[train_rows])),
        validation=validation,
        train_size=len(train_rows),
        validation_size=len(validation_rows),
        input_shape=tuple(x.shape[1:]),
        task=task,
        num_outputs=num_outputs,
        label_shape=tuple(y.shape[1:]),
        sample_name=lambda position: f"row {train_rows[position]}",
        source=source,
    )


def digits(cfg, seed):
    """scikit-learn's 1797 handwritten 8x8 digits, scaled to [0, 1], as images (8, 8, 1)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    return _from_arrays(
        (x, data.target.astype("int32")),
        cfg,
        seed,
        "classification",
        10,
        source="scikit-learn's digits",
    )


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
    return _from_arrays(
        (x, masks[..., None]), cfg, seed, "segmentation", 1, source=f"shapes (seed {seed})"
    )


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
    x, y = _read_npz(path, cfg)
    source = os.path.basename(path)
    if cfg.task == "regression":
        return _from_arrays((x, y), cfg, seed, "regression", source=source)
    if y.ndim >= 2 and y.shape[1:-1] == x.shape[1:-1] and y.ndim == x.ndim:
        return _from_arrays((x, y), cfg, seed, "segmentation", y.shape[-1], source=source)
    if y.ndim > 1 and int(np.prod(y.shape[1:])) != 1:
        raise ConfigError(
            f"{source}: '{cfg.y_key}' has shape {y.shape}, neither one label per sample nor a "
            "mask per image; give integer labels of shape (samples,) (one-hot: y.argmax(axis=1))."
        )
    return _from_arrays((x, y.reshape(len(y))), cfg, seed, "classification", source=source)


def _read_npz(path, cfg):
    """(x, y) from a .npz file, with no pickled objects; ConfigError naming the file otherwise."""
    advice = (
        f"write it with numpy.savez('{os.path.basename(path)}', {cfg.x_key}=inputs, "
        f"{cfg.y_key}=targets) from numeric arrays"
    )
    try:
        with open(path, "rb") as handle:
            start = handle.read(6)
        arrays = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        # A .npz is a zip archive ("PK"), a .npy starts with "\x93NUMPY", a pickle with 0x80;
        # anything else (a text or CSV file) is not numpy's at all, whatever numpy then says.
        known = start.startswith((b"PK", b"\x93NUMPY", b"\x80"))
        reason = _reason(error) if known else f"it is not a numpy file: it begins {start!r}"
        raise ConfigError(
            f"dataset.path={cfg.path} is not a readable .npz file ({reason}); {advice}."
        ) from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ConfigError(
            f"dataset.path={cfg.path} holds a single array (a .npy file), not named arrays "
            f"'{cfg.x_key}' and '{cfg.y_key}'; {advice}."
        )
    with arrays:
        missing = [key for key in (cfg.x_key, cfg.y_key) if key not in arrays.files]
        if missing:
            raise ConfigError(
                f"{cfg.path} has no array {missing[0]!r} (it has {', '.join(arrays.files)}); set "
                "dataset.x_key= and dataset.y_key= to the names it uses."
            )
        try:
            return arrays[cfg.x_key], arrays[cfg.y_key]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            raise ConfigError(
                f"dataset.path={cfg.path} is damaged: its arrays cannot be read "
                f"({_reason(error)}); {advice}."
            ) from None


def _reason(error):
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "allow_pickle" in text or "pickled" in text:
        return "it holds pickled Python objects, which are not loaded for safety"
    # TensorFlow's messages start with the op's function name and end with its name: the
    # reason lies between them, and is kept whole up to a length a paragraph can hold.
    text = text.rsplit("}} ", 1)[-1].split(" [Op:", 1)[0].strip()
    return text[:400]


def _class_folders(path, cfg):
    """The class sub-folders of an image folder, in label order; ConfigError when they cannot be
    the classes asked for."""
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    if len(classes) < 2:
        raise ConfigError(
            f"dataset.path={cfg.path} has {len(classes)} class sub-folder(s); image_folder needs "
            "one sub-folder per class (at least two), each holding that class's images."
        )
    if cfg.num_classes and cfg.num_classes != len(classes):
        raise ConfigError(
            f"dataset.num_classes={cfg.num_classes} but {cfg.path} has {len(classes)} class "
            f"folders ({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}), and an "
            "image folder's classes are its sub-folders (a class without one has no sample); "
            f"set dataset.num_classes={len(classes)} or 0 (counted from the folders)."
        )
    return classes


def image_folder(cfg, seed):
    path = _require_path(cfg, "images")
    if not os.path.isdir(path):
        raise ConfigError(
            f"dataset.path={cfg.path} is not a directory; give a folder with one sub-folder of "
            "images per class, e.g. dataset.path=/data/train."
        )
    classes = _class_folders(path, cfg)
    files, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(path, name)
        for entry in sorted(os.listdir(folder)):
            if entry.lower().endswith(IMAGE_SUFFIXES) and os.path.isfile(
                os.path.join(folder, entry)
            ):
                files.append(os.path.join(folder, entry))
                labels.append(label)
    if not files:
        raise ConfigError(
            f"dataset.path={cfg.path}: its class folders hold no images "
            f"({', '.join(IMAGE_SUFFIXES)})."
        )
    files, labels = _drop_undecodable(files, labels, cfg)
    train_rows, validation_rows = _split_order(len(files), cfg.validation_split, seed)
    files, labels = np.array(files), np.array(labels, "int32")
    size = (cfg.image_size, cfg.image_size)

    def load(file, label):
        image = tf.io.decode_image(
            tf.io.read_file(file), channels=cfg.channels, expand_animations=False
        )
        return tf.image.resize(image, size) / 255.0, label

    def images(rows):
        paths = tf.data.Dataset.from_tensor_slices((files[rows], labels[rows]))
        return paths.map(load, num_parallel_calls=tf.data.AUTOTUNE)

    return DataBundle(
        images(train_rows),
        images(validation_rows) if len(validation_rows) else None,
        len(train_rows),
        len(validation_rows),
        (cfg.image_size, cfg.image_size, cfg.channels),
        "classification",
        cfg.num_classes or len(classes),
        (),
        sample_name=lambda position: os.path.relpath(files[train_rows[position]], path),
        source=cfg.path,
    )


def _drop_undecodable(files, labels, cfg):
    """Decode every image once, before training; ConfigError naming the ones that fail, or
    (dataset.skip_bad_files=true) the lists without them and a warning that names them."""

    def decode(index, file):
        image = tf.io.decode_image(
            tf.io.read_file(file), channels=cfg.channels, expand_animations=False
        )
        return index, tf.shape(image)[0]  # an output that needs the decode, so it runs

    checked = tf.data.Dataset.from_tensor_slices((np.arange(len(files)), files))
    checked = checked.map(decode, num_parallel_calls=tf.data.AUTOTUNE).ignore_errors()
    readable = {int(index) for index, _ in checked.as_numpy_iterator()}
    bad = [index for index in range(len(files)) if index not in readable]
    if not bad:
        return files, labels
    named = "; ".join(
        f"{files[index]} ({_decode_error(files[index], cfg.channels)})" for index in bad[:3]
    )
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    if not cfg.skip_bad_files:
        raise ConfigError(
            f"dataset.path={cfg.path}: {len(bad)} of {len(files)} images cannot be decoded: "
            f"{named}{more}. Replace or remove them, or train without them with "
            "dataset.skip_bad_files=true."
        )
    print(
        f"dataset: skipping {len(bad)} image(s) that cannot be decoded "
        f"(dataset.skip_bad_files=true): {named}{more}"
    )
    keep = [index for index in range(len(files)) if index in readable]
    if not keep:
        raise ConfigError(
            f"dataset.path={cfg.path}: none of its {len(files)} images can be decoded."
        )
    return [files[index] for index in keep], [labels[index] for index in keep]


def _decode_error(file, channels):
    try:
        tf.io.decode_image(tf.io.read_file(file), channels=channels, expand_animations=False)
    except (tf.errors.OpError, ValueError) as error:
        return _reason(error).rsplit("}} ", 1)[-1].strip()
    return "unreadable"


def _tfrecord_files(cfg):
    """(files, feature spec) of dataset.path; ConfigError when none matches or the spec lacks the
    input or the label."""
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
    return files, spec


def _tfrecord_targets(cfg, labels, source, record_name):
    """(task, num_outputs, label_shape) of the scanned labels, checked for the task."""
    label_shape = tuple(cfg.features[cfg.label_key]["shape"])
    if cfg.task == "regression":
        # Regression targets of any stored shape train as one row of their values a sample.
        width = int(np.prod(label_shape))
        targets = labels.reshape(len(labels), width)
        return "regression", _check_targets(targets, source, record_name), (width,)
    label_rows = labels.reshape(len(labels), -1) if labels.ndim > 1 else labels
    num_outputs = _check_labels(
        label_rows if label_rows.ndim == 1 else label_rows[:, 0], cfg, source, None, record_name
    )
    return "classification", num_outputs, label_shape


def tfrecord(cfg, seed):
    files, spec = _tfrecord_files(cfg)
    counts, labels = [], []
    for file in files:
        count, file_labels = _scan_tfrecord(file, spec, cfg)
        counts.append(count)
        labels.append(file_labels)
    starts = np.cumsum([0] + counts)
    total = int(starts[-1])

    def record_name(index):
        file = int(np.searchsorted(starts, index, side="right")) - 1
        return f"{os.path.basename(files[file])} record {index - starts[file]}"

    source = cfg.path if len(files) > 1 else files[0]
    labels = np.concatenate(labels) if labels else np.zeros(0, "int64")
    task, num_outputs, label_shape = _tfrecord_targets(cfg, labels, source, record_name)

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        label = example[cfg.label_key]
        if task == "regression":
            label = tf.reshape(tf.cast(label, "float32"), label_shape)
        return tf.cast(example[cfg.input_key], "float32"), label

    validation_size = int(round(total * cfg.validation_split))
    parsed = tf.data.TFRecordDataset(files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    # The count is known: telling tf.data lets Keras size epochs without running out of data.
    train = parsed.skip(validation_size).apply(
        tf.data.experimental.assert_cardinality(total - validation_size)
    )
    validation = parsed.take(validation_size) if validation_size else None
    return DataBundle(
        train,
        validation,
        total - validation_size,
        validation_size,
        tuple(cfg.features[cfg.input_key]["shape"]),
        task,
        num_outputs,
        label_shape,
        sample_name=lambda position: record_name(position + validation_size),
        source=os.path.dirname(files[0]) if len(files) > 1 else files[0],
    )


def _scan_tfrecord(file, spec, cfg):
    """(records, labels) of one TFRecord file, read once in batches; ConfigError naming the file
    (and the record, when one does not parse) for damage, bad features or non-finite inputs."""
    batches = tf.data.TFRecordDataset(file).batch(1024)
    count, labels, stored = 0, [], 0
    try:
        for records in batches:
            # Each record is stored as its length (8 bytes), a checksum (4), the data and a
            # checksum (4): a file cut inside a record's header reads as a clean end.
            stored += int(tf.reduce_sum(tf.strings.length(records))) + 16 * len(records)
            examples = tf.io.parse_example(records, spec)
            inputs = examples[cfg.input_key]
            if inputs.dtype.is_floating:
                finite = tf.reduce_all(
                    tf.reshape(tf.math.is_finite(inputs), [len(records), -1]), axis=1
                ).numpy()
                if not finite.all():
                    raise ConfigError(
                        f"{file} record {count + int(np.flatnonzero(~finite)[0])}: its "
                        f"'{cfg.input_key}' holds inf or nan, which would turn every weight into "
                        "nan; replace or drop such records."
                    )
            labels.append(examples[cfg.label_key].numpy())
            count += len(records)
    except tf.errors.DataLossError as error:
        reason = _reason(error).split("'", 1)[0].strip()
        raise ConfigError(
            f"{file} is damaged after its first {_whole_records(file)} records ({reason}); "
            "rewrite it, or leave it out of dataset.path."
        ) from None
    except tf.errors.InvalidArgumentError as error:
        raise ConfigError(
            f"{file} record {count + _first_unparsable(file, spec, count)} does not match "
            f"dataset.features ({_reason(error)}); describe its "
            "features as they are stored (shape and dtype of each)."
        ) from None
    if stored != os.path.getsize(file):
        raise ConfigError(
            f"{file} is damaged after its first {count} records: {os.path.getsize(file) - stored} "
            "bytes at its end are not a whole record (the file was cut short, e.g. by a copy that "
            "did not finish); rewrite it, or leave it out of dataset.path."
        )
    return count, np.concatenate(labels) if labels else np.zeros(0, "int64")


def _whole_records(file):
    """How many records of a damaged TFRecord file read before the damage."""
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(file):
            count += 1
    except tf.errors.DataLossError:
        pass
    return count


def _first_unparsable(file, spec, start):
    for index, record in enumerate(tf.data.TFRecordDataset(file).skip(start)):
        try:
            tf.io.parse_single_example(record, spec)
        except tf.errors.InvalidArgumentError:
            return index
    return 0


def _own(cfg, seed, made):
    """The user's own data: what ``dataset._target_`` returned, (train, validation), each a
    ``tf.data.Dataset`` of unbatched ``(x, y)`` or ``(x, y, sample_weight)`` or a tuple of such
    arrays, read once: counted, checked (finite numbers, class labels) and described."""
    source = f"dataset._target_={cfg._target_}"
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise ConfigError(
            f"{source} returned {targets.described(made)}, not a pair (train, validation); "
            "return e.g. `return train, None` (validation may be None: dataset.validation_split "
            "of the training data is then held out)."
        )
    train = _own_part(made[0], source, "training")
    validation = None if made[1] is None else _own_part(made[1], source, "validation")
    if validation is not None and not cfg.validation_split:
        raise ConfigError(
            f"{source} returned validation data, but dataset.validation_split=0 says this run has "
            "none; drop dataset.validation_split=0 (the validation data is used as it is), or "
            "return None for it."
        )
    spec = _own_spec(train, source, "training")
    if validation is not None and not _same_structure(spec, validation.element_spec):
        raise ConfigError(
            f"{source}: its validation elements ({validation.element_spec}) are not shaped as "
            f"its training elements ({spec}); return both in the same form."
        )
    count, labels = _scan_own(train, source, "training")
    task, num_outputs = _own_task(cfg, spec, labels, source)
    train_rows, validation, validation_size, held = _own_validation(
        cfg, seed, (train, validation, count), source
    )
    if task == "classification" and held is not None:
        _check_labels(held.reshape(-1), cfg, f"{source} (validation)", num_outputs)
    if len(train_rows) < count:
        train = _held_out(train, train_rows, count)
    x_spec = spec[0]
    return DataBundle(
        train.apply(tf.data.experimental.assert_cardinality(len(train_rows))),
        validation,
        len(train_rows),
        validation_size,
        {name: tuple(part.shape) for name, part in x_spec.items()}
        if isinstance(x_spec, dict)
        else tuple(x_spec.shape),
        task,
        num_outputs,
        tuple(spec[1].shape),
        sample_name=lambda position: f"element {train_rows[position]}",
        source=source,
    )


def _own_validation(cfg, seed, parts, source):
    """(positions of the training data kept for training, the validation data, its size, its
    targets where it was read). ``parts``: (training data, validation data or None, samples in
    the training data). Without validation data, dataset.validation_split of the training data
    is held out, a seeded choice of positions."""
    train, validation, count = parts
    if validation is None and cfg.validation_split:
        kept, held = (np.sort(rows) for rows in _split_order(count, cfg.validation_split, seed))
        return kept, _held_out(train, held, count), len(held), None
    if validation is None:
        return np.arange(count), None, 0, None
    size, targets = _scan_own(validation, f"{source} (validation)", "validation")
    return np.arange(count), validation, size, targets


def _own_part(part, source, what):
    """A part of what a dataset target returned, as a ``tf.data.Dataset``."""
    if isinstance(part, tf.data.Dataset):
        if part.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ConfigError(
                f"{source}: its {what} data never ends (a repeat() without a count?); return one "
                "pass over it: ga-train makes the epochs and the order of each."
            )
        return part
    if isinstance(part, (tuple, list)) and len(part) in (2, 3):
        arrays = [
            {name: np.asarray(leaf) for name, leaf in item.items()}
            if isinstance(item, dict)
            else np.asarray(item)
            for item in part
        ]
        lengths = {len(leaf) for item in arrays for leaf in tf.nest.flatten(item) if leaf.ndim}
        if len(lengths) != 1 or any(leaf.ndim == 0 for leaf in tf.nest.flatten(arrays)):
            raise ConfigError(
                f"{source}: the {what} arrays have {sorted(lengths) or 'no'} rows; inputs, targets "
                "(and sample weights) need one row per sample, the same number in each."
            )
        floats = lambda leaf: leaf.astype("float32") if leaf.dtype == np.float64 else leaf  # noqa: E731
        try:
            return tf.data.Dataset.from_tensor_slices(tuple(tf.nest.map_structure(floats, arrays)))
        except (TypeError, ValueError) as error:
            raise ConfigError(
                f"{source}: its {what} arrays cannot be read as numbers ({_reason(error)}); "
                "return numeric NumPy arrays (x, y) or (x, y, sample_weight)."
            ) from None
    raise ConfigError(
        f"{source}: its {what} part is {'a ' + type(part).__name__}, neither a tf.data.Dataset nor "
        "a tuple of arrays (x, y) or (x, y, sample_weight); return one of those."
    )


def _own_spec(dataset, source, what):
    """The element spec of a dataset target's data, checked: (x, y) or (x, y, w), x a tensor or
    a dict of tensors, every part of one known shape (the unbatched sample's) and numeric."""
    spec = dataset.element_spec
    form = "elements (x, y) or (x, y, sample_weight), x a tensor or a dict of tensors"
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise ConfigError(f"{source}: its {what} elements are {spec}; return {form}.")
    parts = list(spec[0].values()) if isinstance(spec[0], dict) else [spec[0]]
    parts += list(spec[1:])
    for part in parts:
        if not isinstance(part, tf.TensorSpec) or not (
            part.dtype.is_floating or part.dtype.is_integer or part.dtype.is_bool
        ):
            raise ConfigError(
                f"{source}: its {what} elements hold {part}; return {form} of numbers."
            )
        if not part.shape.is_fully_defined():
            raise ConfigError(
                f"{source}: its {what} elements have a part of shape {part.shape}, not one fixed "
                "shape; return unbatched samples of one shape each (a batched dataset: "
                ".unbatch(); ga-train batches them by micro_batch_size)."
            )
    return spec


def _same_structure(spec, other):
    try:
        tf.nest.assert_same_structure(spec, other)
    except (ValueError, TypeError):
        return False
    return all(a.shape == b.shape for a, b in zip(tf.nest.flatten(spec), tf.nest.flatten(other)))


def _scan_own(dataset, source, what):
    """(samples, targets) of a dataset target's data, read once in batches; ConfigError naming
    the element for inputs, targets or sample weights that are not finite (or weights < 0)."""
    count, targets = 0, []
    weighed = 0.0  # the sum of the sample weights, where there are any
    unknown = dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    try:
        for batch in dataset.batch(1024).as_numpy_iterator():
            if unknown and count >= UNKNOWN_SIZE_LIMIT:
                raise ConfigError(
                    f"{source}: its {what} data has given {count:,} elements and not ended, and "
                    "its size is unknown: a generator that never ends? ga-train reads the data "
                    "once before training and makes the epochs itself, so return one pass over "
                    "it (a generator that stops). If it does hold more, tell tf.data its size: "
                    "return dataset.apply(tf.data.experimental.assert_cardinality(n))."
                )
            checked = [("inputs", leaf) for leaf in tf.nest.flatten(batch[0])]
            checked += [("targets", batch[1]), ("sample weights", batch[2:3] and batch[2])]
            for name, values in checked:
                _refuse_nonfinite(values, name, f"{source}: the {name} of {what} element", count)
            targets.append(batch[1])
            count += len(batch[1])
            if len(batch) == 3:
                weighed += float(np.sum(batch[2], dtype="float64"))
    except tf.errors.OpError as error:
        raise ConfigError(
            f"{source}: reading its {what} data failed after {count} elements ({_reason(error)})."
        ) from None
    if count == 0:
        raise ConfigError(f"{source}: its {what} data holds no samples; return some.")
    if len(dataset.element_spec) == 3 and weighed == 0:
        raise ConfigError(
            f"{source}: every sample weight of its {what} data is 0, so no sample counts: the "
            "loss would be 0.0 whatever the model predicts"
            + (" and no update could change the model" if what == "training" else "")
            + ". Give a weight above 0 to each sample (or position) that should count, e.g. 1 "
            "for a real token and 0 for padding, or return (x, y) without weights."
        )
    return count, np.concatenate(targets)


def _refuse_nonfinite(values, name, where, first):
    """ConfigError for the first row of a batch ``values`` (rows from ``first`` on) that holds
    inf or nan (or, for sample weights, a negative weight)."""
    values = np.asarray(values)
    if not len(values) or values.dtype.kind != "f":
        return
    bad = _nonfinite_rows(values)
    if name == "sample weights":
        bad |= (values.reshape(len(values), -1) < 0).any(axis=1)
    if bad.any():
        raise ConfigError(
            f"{where} {first + int(np.flatnonzero(bad)[0])} ({int(bad.sum())} in its batch of "
            f"{len(values)}) hold inf or nan"
            + (" or a negative weight" if name == "sample weights" else "")
            + ", which would turn every weight into nan; fix or drop those samples."
        )


def _own_task(cfg, spec, targets, source):
    """(task, num_outputs) of a dataset target's data: regression where dataset.task says so,
    segmentation for float masks of the inputs' size, else integer class labels (one a sample,
    or one a position: a sequence's tokens)."""
    x, y = spec[0], spec[1]
    per_sample = int(np.prod(y.shape))
    rows = targets.reshape(len(targets), per_sample)
    if cfg.task == "regression" and len(y.shape) > 1:
        raise ConfigError(
            f"{source}: dataset.task=regression needs targets of shape () or (k,) a sample (k "
            f"values, which the model predicts in one Dense(k)); its targets are of shape "
            f"{tuple(y.shape)} a sample. Return them flat (e.g. y.reshape(len(y), -1), then "
            f"{per_sample} values a sample), or drop dataset.task for class labels."
        )
    if cfg.task == "regression":
        return "regression", _check_targets(
            rows.astype("float32"), source, lambda r: f"element {r}"
        )
    image_like = not isinstance(x, dict) and len(y.shape) >= 2 and len(x.shape) == len(y.shape)
    if y.dtype.is_floating and image_like and x.shape[:-1] == y.shape[:-1]:
        return "segmentation", int(y.shape[-1])
    name = lambda flat: f"element {flat // per_sample}"  # noqa: E731
    return "classification", _check_labels(targets.reshape(-1), cfg, source, None, name)


def _held_out(dataset, rows, count):
    """The elements of ``dataset`` at the sorted positions ``rows`` (of ``count``), in order."""
    keep = np.zeros(count, bool)
    keep[rows] = True
    kept = tf.constant(keep)
    picked = dataset.enumerate().filter(lambda index, element: tf.gather(kept, index))
    return picked.map(lambda index, element: element).apply(
        tf.data.experimental.assert_cardinality(len(rows))
    )


def load_dataset(cfg, seed=0):
    """The :class:`DataBundle` of what the ``dataset`` section ``cfg`` names: a shipped data set
    (``dataset=digits``: ``gacli.datasets.digits``, which returns a checked bundle) or the user's
    own (``dataset._target_=my_pkg.data.make``, whose (train, validation) is read and checked
    here); ``seed``, ``validation_split``, ``task`` and ``num_classes`` are filled in where the
    target takes them."""
    task = str(getattr(cfg.task, "value", cfg.task))
    fill = {
        "seed": seed,
        "validation_split": cfg.validation_split,
        "task": task,
        "num_classes": cfg.num_classes,
    }
    made = targets.build("dataset", section_arguments(cfg, "dataset"), targets.ANYTHING, fill)
    if not isinstance(made, DataBundle):
        return _own(cfg, seed, made)
    if task == "regression" and made.task != "regression":
        raise ConfigError(
            f"dataset.task=regression, but dataset._target_={cfg._target_} gave {made.task} "
            "targets; drop dataset.task=regression, or give data with float targets."
        )
    return made
