"""The data sets ``ga-train`` ships, as plain functions of the kind a user writes for ``_target_``.

``digits`` (scikit-learn's bundled images) and ``shapes`` (seeded synthetic segmentation) need no
files and no network; ``npz``, ``image_folder`` and ``tfrecord`` read the user's data. Each
function's keyword arguments are the keys of its file under ``configs/dataset/``
(``configs/dataset/npz.yaml`` is ``_target_: gacli.datasets.npz`` and ``path``); ``ga-train``
fills in ``seed``, ``validation_split``, ``task`` and ``num_classes`` from its own keys.

Each returns a :class:`gacli.runner.builders.data.DataBundle`: its training and validation pipelines
of unbatched ``(x, y)`` pairs, already read once and checked (a missing path, a file that cannot be
decoded, a non-finite input, a label out of range is a one-paragraph error naming the file and the
sample). A function of your own may return the same, or simply ``(train, validation)``
(docs/guides/own-model.md).

Nothing here imports TensorFlow at import time: ``ga-train`` reads these signatures to check a
config's arguments before TensorFlow loads.
"""

from types import SimpleNamespace


def _load(loader, seed, **section):
    """The bundle that :mod:`gacli.runner.builders.data`'s ``loader`` makes of these settings."""
    from gacli.runner.builders import data

    section.setdefault("num_classes", 0)
    section.setdefault("task", "auto")
    return getattr(data, loader)(SimpleNamespace(name=loader, **section), seed)


def digits(validation_split=0.2, seed=0):
    """scikit-learn's 1797 handwritten 8x8 digits, scaled to [0, 1], as images (8, 8, 1) with
    labels 0-9; ``validation_split`` of them held out (a seeded choice)."""
    return _load("digits", seed, validation_split=validation_split)


def shapes(num_samples=256, image_size=32, channels=1, validation_split=0.125, seed=0):
    """Seeded synthetic segmentation: ``num_samples`` noisy images of ``image_size`` pixels a
    side, with 1 to 3 discs and squares; the mask marks the discs."""
    return _load(
        "shapes",
        seed,
        num_samples=num_samples,
        image_size=image_size,
        channels=channels,
        validation_split=validation_split,
    )


def npz(path, x_key="x", y_key="y", validation_split=0.1, task="auto", num_classes=0, seed=0):
    """Arrays from a ``.npz`` file (``numpy.savez(path, x=inputs, y=targets)``): integer labels
    classify, masks of the images' size segment, float targets regress with
    ``task="regression"``."""
    return _load(
        "npz",
        seed,
        path=path,
        x_key=x_key,
        y_key=y_key,
        validation_split=validation_split,
        task=task,
        num_classes=num_classes,
    )


def image_folder(
    path,
    image_size=64,
    channels=3,
    skip_bad_files=False,
    validation_split=0.1,
    num_classes=0,
    seed=0,
):
    """Images (png, jpg, bmp, gif) in one sub-folder of ``path`` per class, resized to
    ``image_size`` pixels a side with ``channels`` channels (1 or 3); ``skip_bad_files``: train
    without the images that cannot be decoded rather than refuse the folder."""
    return _load(
        "image_folder",
        seed,
        path=path,
        image_size=image_size,
        channels=channels,
        skip_bad_files=skip_bad_files,
        validation_split=validation_split,
        num_classes=num_classes,
    )


def tfrecord(
    path,
    features,
    input_key="image",
    label_key="label",
    validation_split=0.1,
    task="auto",
    num_classes=0,
    seed=0,
):
    """``tf.train.Example`` records in the files ``path`` matches (a glob); ``features`` maps each
    stored feature's name to ``{shape, dtype}``, ``input_key`` and ``label_key`` name the input
    and the target among them."""
    return _load(
        "tfrecord",
        seed,
        path=path,
        features=features,
        input_key=input_key,
        label_key=label_key,
        validation_split=validation_split,
        task=task,
        num_classes=num_classes,
    )
