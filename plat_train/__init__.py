"""The training side of plat: what the jobs need beyond the model package (``modeling_plat``).

- ``causal_lm``, ``image_classification``: the two jobs (``run_clm.py`` / ``plat-run-clm``,
  ``run_image_classification.py`` / ``plat-run-image-classification``); ``convert``: ``plat-convert``.
- ``arguments``: arguments shared by the jobs and how they are read (flags, or a file of them);
  ``presets``: the model configs, training recipes and Accelerate configs of ``configuration/``, by name;
  ``model_setup``: the config (``--config_overrides``) and the model a job starts from, stock checkpoints converted.
- ``trainers``: the Trainer subclasses (p-LaT model card, image trainer); ``model_cards``: the card itself;
  ``runs``: launch checks, logging, resuming, metric files, process-group teardown; ``preemption``: a checkpoint
  and a stop on SIGTERM; ``ema``: the weight average.
- ``text_data``, ``text_metrics``: language-modelling data and metrics; ``vision_data``, ``vision_augment``,
  ``vision_metrics``: image data, DeiT's augmentations, top-k accuracy.
"""
