"""Labelling a folder of training images with models: captions (`<image>.txt`) from an image-to-text
or image-text-to-text checkpoint, and loss masks (`<image>-masklabel.png`) from a text-prompted
segmentation model (CLIPSeg). `launch.py caption` and `launch.py mask` run these as child
processes of the dataset tool (docs/data.md, "Auto-captioning and generated masks")."""
