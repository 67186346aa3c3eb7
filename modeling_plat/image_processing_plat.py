"""PlatImageProcessor: ViT preprocessing that can also feed single-channel (grayscale) models.

The image-classification pipeline opens every image as RGB before the processor sees it, so a model trained
on grayscale images (``num_channels=1``, e.g. Fashion-MNIST) would receive three channels. With
``do_grayscale=True`` this processor folds RGB(A) input to one luma channel (ITU-R 601, PIL's "L" weights)
before resizing and normalising. This file imports only numpy and transformers: saved models carry a copy of
it, so ``AutoImageProcessor`` / ``pipeline`` load it with ``trust_remote_code=True``.
"""

import numpy as np
from transformers.image_processing_utils import ImagesKwargs
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

LUMA_WEIGHTS = np.array([0.299, 0.587, 0.114], dtype=np.float32)


class PlatImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    do_grayscale (`bool`, *optional*, defaults to `self.do_grayscale`):
        Fold colour images to one luma channel, for models with `num_channels=1`.
    """

    do_grayscale: bool


class PlatImageProcessor(ViTImageProcessorPil):
    valid_kwargs = PlatImageProcessorKwargs
    do_grayscale = False

    def process_image(self, image, *args, do_grayscale=None, **kwargs):
        image = super().process_image(image, *args, **kwargs)  # (C, H, W)
        do_grayscale = self.do_grayscale if do_grayscale is None else do_grayscale
        if do_grayscale and image.shape[0] in (3, 4):
            luma = np.tensordot(LUMA_WEIGHTS, image[:3].astype(np.float32), axes=1)  # (H, W)
            image = np.clip(np.rint(luma), 0, 255).astype(np.uint8)[None] if image.dtype == np.uint8 else luma[None]
        return image

    def to_dict(self):
        # The Pil backend would strip its own suffix; keep our class name so Auto classes find this class.
        return {**super().to_dict(), "image_processor_type": type(self).__name__}


PlatImageProcessor.register_for_auto_class("AutoImageProcessor")
