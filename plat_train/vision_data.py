"""Image classification data: Fashion-MNIST from its idx files (the offline default), class-per-subfolder image
folders, or a Hub dataset. Every source becomes a DatasetDict whose splits
have an ``image`` column (PIL images) and a ``label`` ClassLabel column."""

import gzip
import logging
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_INSTALL = "apt-get install dataset-fashion-mnist"
FASHION_MNIST_LABELS = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"
]
IMAGE_EXTENSIONS = {".bmp", ".gif", ".jpeg", ".jpg", ".png", ".ppm", ".tif", ".tiff", ".webp"}


def read_idx(path, count=None):
    """The array of an idx gzip file: (N, rows, cols) uint8 images or (N,) uint8 labels; the first ``count`` only
    if given. The header holds the number of dimensions (low byte of the magic number) and each size."""
    with gzip.open(path, "rb") as handle:
        dims = int(np.frombuffer(handle.read(4), dtype=">u4")[0]) & 0xFF
        shape = [int(size) for size in np.frombuffer(handle.read(4 * dims), dtype=">u4")]
        if count is not None:
            shape[0] = min(count, shape[0])
        return np.frombuffer(handle.read(int(np.prod(shape))), dtype=np.uint8).reshape(shape)


def fashion_mnist_files(root=FASHION_MNIST_DIR):
    """{split: (images path, labels path)} of the Fashion-MNIST idx files under ``root``."""
    root = Path(root)
    return {split: (root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz")
            for split, prefix in (("train", "train"), ("test", "t10k"))}


def load_fashion_mnist(root=FASHION_MNIST_DIR):
    """The 60k train / 10k test Fashion-MNIST splits read from the idx gzip files of the Debian package."""
    files = fashion_mnist_files(root)
    missing = [str(path) for pair in files.values() for path in pair if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST is missing ({', '.join(missing)}). Install it with `{FASHION_MNIST_INSTALL}`, "
            "or pass --fashion_mnist_dir, --train_dir or --dataset_name."
        )
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=FASHION_MNIST_LABELS)}
    )
    splits = {}
    for split, (images_path, labels_path) in files.items():
        images = read_idx(images_path)  # (N, 28, 28) uint8
        # Each image as a binary PGM (a header before the raw pixels), which PIL opens as the same grayscale image:
        # arrays would be PNG-encoded one by one, 6-12 s for the 70,000 images on 2 CPU cores.
        header = f"P5 {images.shape[2]} {images.shape[1]} 255\n".encode()
        encoded = [{"bytes": header + image.tobytes(), "path": None} for image in images]
        splits[split] = datasets.Dataset.from_dict(
            {"image": encoded, "label": read_idx(labels_path).tolist()}, features=features, split=split
        )
    return datasets.DatasetDict(splits)


def _list_class_folders(folder):
    """{class name: [image paths]} for the subfolders of ``folder`` that hold images (searched recursively)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Image folder {folder} does not exist or is not a directory")
    classes = {}
    for class_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        paths = sorted(
            str(p) for p in class_dir.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        if paths:
            classes[class_dir.name] = paths
    if not classes:
        raise ValueError(
            f"No images found in {folder}: expected one subfolder per class holding image files "
            f"({', '.join(sorted(IMAGE_EXTENSIONS))}), e.g. {folder}/cat/001.jpg"
        )
    return classes


def _is_readable(example):
    try:
        with Image.open(example["image"]) as image:
            image.verify()
        return True
    except (OSError, SyntaxError, ValueError):
        return False


def _folder_dataset(classes, names, num_proc, folder):
    paths = [path for name in classes for path in classes[name]]
    labels = [names.index(name) for name in classes for _ in classes[name]]
    dataset = datasets.Dataset.from_dict({"image": paths, "label": labels})
    readable = dataset.filter(_is_readable, num_proc=num_proc, desc=f"Checking images in {folder}")
    skipped = len(dataset) - len(readable)
    if skipped:
        logger.warning(f"Skipped {skipped} of {len(dataset)} unreadable or corrupt image files in {folder}")
    if len(readable) == 0:
        raise ValueError(f"None of the {len(dataset)} image files in {folder} could be read")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return readable.cast(features)


def load_image_folders(train_dir, validation_dir=None, num_proc=None):
    """Train (and validation) splits from folders laid out as ``<dir>/<class name>/<image>``; the class names
    come from the training folder. Corrupt or unreadable files are skipped with a warning."""
    train_classes = _list_class_folders(train_dir)
    names = list(train_classes)
    if len(names) < 2:
        raise ValueError(
            f"{train_dir} holds a single class ({names[0]!r}); classification needs at least two class subfolders"
        )
    splits = {"train": _folder_dataset(train_classes, names, num_proc, train_dir)}
    if validation_dir is not None:
        validation_classes = _list_class_folders(validation_dir)
        unknown = sorted(set(validation_classes) - set(names))
        if unknown:
            raise ValueError(f"{validation_dir} has classes that {train_dir} lacks: {', '.join(unknown)}")
        splits["validation"] = _folder_dataset(validation_classes, names, num_proc, validation_dir)
    return datasets.DatasetDict(splits)


def load_hub_dataset(name, config_name=None, image_column="image", label_column="label", cache_dir=None,
                     token=None):
    """A dataset from the Hub (or a local loading script / data folder), columns renamed to image / label."""
    raw = datasets.load_dataset(name, config_name, cache_dir=cache_dir, token=token)
    first = next(iter(raw.values()))
    for column, flag in ((image_column, "--image_column_name"), (label_column, "--label_column_name")):
        if column not in first.column_names:
            raise ValueError(f"{name} has no column {column!r} (columns: {first.column_names}); set {flag}")
    raw = raw.select_columns([image_column, label_column])
    raw = raw.rename_columns({k: v for k, v in ((image_column, "image"), (label_column, "label")) if k != v})
    if not isinstance(first.features[label_column], datasets.ClassLabel):
        raw = raw.class_encode_column("label")
    return raw


def with_validation_split(raw, fraction, seed):
    """Add a validation split, a seeded random ``fraction`` of train, when the source has none."""
    if "validation" in raw:
        return raw
    if not 0 < fraction < 1:
        raise ValueError(f"No validation split: --train_val_split must lie in (0, 1) to make one; got {fraction}")
    split = raw["train"].train_test_split(test_size=fraction, seed=seed)
    return datasets.DatasetDict({**raw, "train": split["train"], "validation": split["test"]})


def label_names(dataset):
    names = dataset.features["label"].names
    if len(names) < 2:
        raise ValueError(f"The data have a single class ({names}); classification needs at least two")
    return names
