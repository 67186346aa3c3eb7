"""Utilities shared by run_clm.py and run_image_classification.py."""
