"""DeiT's training augmentations in PIL and torch, without torchvision or timm.

torchvision wheels are built against one torch release each, and the only torchvision that imports beside
our CPU torch build drags a 5 GB CUDA torch with it; timm depends on torchvision. So the recipe is written
here: per-image PIL ops (random resized crop, flip, RandAugment) and tensor ops (random erasing; Mixup and
CutMix on a whole batch). Each op takes its randomness from a ``random.Random`` or a torch generator passed
in, so a seeded pipeline repeats exactly. The defaults (``rng=random``, ``generator=None``) are the global
generators, which PyTorch's DataLoader reseeds in every worker so that workers do not repeat each other.
"""

import math
import random

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

# ---- geometry -------------------------------------------------------------------------------------------


def random_resized_crop_box(width, height, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """(left, top, right, bottom) of a crop covering a random fraction ``scale`` of the area with a random aspect
    ``ratio`` (log-uniform); falls back to the largest centred crop that fits the ratio range."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        crop_w = round(math.sqrt(target_area * aspect))
        crop_h = round(math.sqrt(target_area / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = rng.randint(0, width - crop_w)
            top = rng.randint(0, height - crop_h)
            return left, top, left + crop_w, top + crop_h
    aspect = width / height
    if aspect < ratio[0]:
        crop_w, crop_h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        crop_w, crop_h = round(height * ratio[1]), height
    else:
        crop_w, crop_h = width, height
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return left, top, left + crop_w, top + crop_h


def random_resized_crop(image, size, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), resample=Image.BICUBIC):
    box = random_resized_crop_box(*image.size, rng, scale, ratio)
    return image.resize((size, size), resample=resample, box=box)


# ---- RandAugment (Cubuk et al. 2019, with timm's "rand-mM-mstdS-inc1" magnitudes used by DeiT) -----------

_MAX_MAGNITUDE = 10.0


def _fill(image):
    bands = len(image.getbands())
    return 128 if bands == 1 else (128,) * bands


def _solarize_add(image, amount, threshold=128):
    pixels = np.asarray(image, dtype=np.int32)
    return Image.fromarray(np.where(pixels < threshold, np.minimum(pixels + amount, 255), pixels).astype(np.uint8))


def _affine(image, matrix):
    return image.transform(image.size, Image.AFFINE, matrix, resample=Image.BILINEAR, fillcolor=_fill(image))


def _signed(level, rng):
    return level if rng.random() < 0.5 else -level


# Each op: (image, level in [0, 1], rng) -> image. The level grows with the distortion ("inc" variants).
RAND_AUGMENT_OPS = {
    "AutoContrast": lambda img, level, rng: ImageOps.autocontrast(img),
    "Equalize": lambda img, level, rng: ImageOps.equalize(img),
    "Invert": lambda img, level, rng: ImageOps.invert(img),
    "Rotate": lambda img, level, rng: img.rotate(
        _signed(30.0 * level, rng), resample=Image.BILINEAR, fillcolor=_fill(img)
    ),
    # timm reaches 0 bits (a black image) at level 1; PIL keeps at least 1.
    "PosterizeIncreasing": lambda img, level, rng: ImageOps.posterize(img, max(1, 4 - int(4 * level))),
    "SolarizeIncreasing": lambda img, level, rng: ImageOps.solarize(img, 256 - int(256 * level)),
    "SolarizeAdd": lambda img, level, rng: _solarize_add(img, int(110 * level)),
    "ColorIncreasing": lambda img, level, rng: ImageEnhance.Color(img).enhance(1.0 + _signed(0.9 * level, rng)),
    "ContrastIncreasing": lambda img, level, rng: ImageEnhance.Contrast(img).enhance(
        1.0 + _signed(0.9 * level, rng)
    ),
    "BrightnessIncreasing": lambda img, level, rng: ImageEnhance.Brightness(img).enhance(
        1.0 + _signed(0.9 * level, rng)
    ),
    "SharpnessIncreasing": lambda img, level, rng: ImageEnhance.Sharpness(img).enhance(
        1.0 + _signed(0.9 * level, rng)
    ),
    "ShearX": lambda img, level, rng: _affine(img, (1, _signed(0.3 * level, rng), 0, 0, 1, 0)),
    "ShearY": lambda img, level, rng: _affine(img, (1, 0, 0, _signed(0.3 * level, rng), 1, 0)),
    "TranslateXRel": lambda img, level, rng: _affine(img, (1, 0, _signed(0.45 * level, rng) * img.width, 0, 1, 0)),
    "TranslateYRel": lambda img, level, rng: _affine(img, (1, 0, 0, 0, 1, _signed(0.45 * level, rng) * img.height)),
}


def rand_augment(image, rng, num_ops=2, magnitude=9.0, magnitude_std=0.5):
    """Apply ``num_ops`` ops drawn uniformly (with replacement), each with probability 0.5 as in timm, at a
    magnitude drawn from N(magnitude, magnitude_std) clipped to [0, 10]."""
    for name in rng.choices(list(RAND_AUGMENT_OPS), k=num_ops):
        if rng.random() > 0.5:
            continue
        level = magnitude if magnitude_std <= 0 else rng.gauss(magnitude, magnitude_std)
        level = min(max(level, 0.0), _MAX_MAGNITUDE) / _MAX_MAGNITUDE
        image = RAND_AUGMENT_OPS[name](image, level, rng)
    return image


# ---- tensor ops -----------------------------------------------------------------------------------------


def to_normalized_tensor(image, mean, std):
    """PIL image -> float tensor (C, H, W), scaled to [0, 1] then normalised per channel."""
    array = np.asarray(image, dtype=np.float32) / 255.0
    array = array[..., None] if array.ndim == 2 else array
    tensor = torch.from_numpy(array).permute(2, 0, 1)  # (C, H, W)
    mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (tensor - mean) / std


def random_erasing(tensor, rng=random, generator=None, probability=0.25, area=(0.02, 1 / 3), max_aspect=1 / 0.3):
    """Erase one random rectangle of a normalised (C, H, W) image with N(0, 1) noise per pixel (Zhong et al.,
    timm's "pixel" mode, as in DeiT)."""
    if rng.random() >= probability:
        return tensor
    channels, height, width = tensor.shape
    for _ in range(10):
        target_area = height * width * rng.uniform(*area)
        aspect = math.exp(rng.uniform(-math.log(max_aspect), math.log(max_aspect)))
        erase_h = round(math.sqrt(target_area * aspect))
        erase_w = round(math.sqrt(target_area / aspect))
        if erase_h < height and erase_w < width:
            top, left = rng.randint(0, height - erase_h), rng.randint(0, width - erase_w)
            tensor = tensor.clone()
            tensor[:, top : top + erase_h, left : left + erase_w] = torch.randn(
                channels, erase_h, erase_w, generator=generator
            )
            return tensor
    return tensor


class TrainTransform:
    """The per-image training view: random resized crop, horizontal flip, RandAugment (when ``rand_augment_ops``
    > 0), normalisation, random erasing (when ``erase_prob`` > 0). Returns a float (C, size, size) tensor."""

    def __init__(self, size, mean, std, crop_scale=(0.08, 1.0), hflip_prob=0.5, rand_augment_ops=0,
                 rand_augment_magnitude=9.0, rand_augment_magnitude_std=0.5, erase_prob=0.0):
        self.size = size
        self.mean, self.std = list(mean), list(std)
        self.crop_scale = tuple(crop_scale)
        self.hflip_prob = hflip_prob
        self.rand_augment_ops = rand_augment_ops
        self.rand_augment_magnitude = rand_augment_magnitude
        self.rand_augment_magnitude_std = rand_augment_magnitude_std
        self.erase_prob = erase_prob

    def __call__(self, image, rng=random, generator=None):
        image = random_resized_crop(image, self.size, rng, scale=self.crop_scale)
        if rng.random() < self.hflip_prob:
            image = ImageOps.mirror(image)
        if self.rand_augment_ops > 0:
            image = rand_augment(
                image, rng, self.rand_augment_ops, self.rand_augment_magnitude, self.rand_augment_magnitude_std
            )
        tensor = to_normalized_tensor(image, self.mean, self.std)
        if self.erase_prob > 0:
            tensor = random_erasing(tensor, rng, generator, probability=self.erase_prob)
        return tensor


class MixupCutmix:
    """Batch-level Mixup (Zhang et al.) or CutMix (Yun et al.) with soft targets, timm's "batch" mode.

    Each image is mixed with its mirror in the batch (index B - 1 - i); with probability ``switch_prob`` CutMix
    is chosen when both are enabled. Returns the mixed pixels and (B, num_classes) float targets; label smoothing
    is left to the loss. Only scalars are random, drawn from ``rng``, so the tensors may live on any device.
    """

    def __init__(self, num_classes, mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5):
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("MixupCutmix needs mixup_alpha > 0 or cutmix_alpha > 0")
        self.num_classes = num_classes
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        self.prob = prob
        self.switch_prob = switch_prob

    def __call__(self, pixel_values, labels, rng=random):
        targets = torch.nn.functional.one_hot(labels, self.num_classes).to(torch.float32)
        if rng.random() >= self.prob:
            return pixel_values, targets
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch_prob)
        mirrored = pixel_values.flip(0)
        if use_cutmix:
            lam = rng.betavariate(self.cutmix_alpha, self.cutmix_alpha)
            height, width = pixel_values.shape[-2:]
            cut_h, cut_w = int(height * math.sqrt(1 - lam)), int(width * math.sqrt(1 - lam))
            center_y, center_x = rng.randrange(height), rng.randrange(width)
            top, bottom = max(center_y - cut_h // 2, 0), min(center_y + cut_h // 2, height)
            left, right = max(center_x - cut_w // 2, 0), min(center_x + cut_w // 2, width)
            pixel_values = pixel_values.clone()
            pixel_values[..., top:bottom, left:right] = mirrored[..., top:bottom, left:right]
            # The box is clipped at the border: the label weight follows the area actually pasted.
            lam = 1.0 - (bottom - top) * (right - left) / (height * width)
        else:
            lam = rng.betavariate(self.mixup_alpha, self.mixup_alpha)
            pixel_values = pixel_values * lam + mirrored * (1.0 - lam)
        targets = targets * lam + targets.flip(0) * (1.0 - lam)
        return pixel_values, targets
