#!/usr/bin/env python
"""Train or fine-tune p-LaT image classifiers: the job lives in ``plat_train.image_classification`` (see its
docstring); installed, the same command is ``plat-run-image-classification``.

    python run_image_classification.py plat-fmnist-tiny.yaml
"""

from plat_train.image_classification import main

if __name__ == "__main__":
    main()
