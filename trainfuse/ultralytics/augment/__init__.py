"""ultralytics' training augmentation with its pixels on the GPU (``FusedDetectionTrainer``'s
``gpu_augment``: by default on CUDA for images read from disk; docs/design/augmentation.md):

- :mod:`.deferred`: the loader's side. ultralytics' own transforms draw every random number and
  move the labels; the pixels are only cropped to what the warp reads and packed.
- :mod:`.decode`: the JPEGs left encoded by the workers, decoded on the GPU and kept there.
- :mod:`.kernel`: one pass over a batch's pixels (warp, HSV jitter, flips, channel order), with its
  torch reference.
- :mod:`.color`: OpenCV's 8-bit HSV conversions in torch, the reference's colour half.
- :mod:`.batch`: a deferred batch finished where its tensors are.

:mod:`.deferred` imports ultralytics; this package's ``__init__`` does not.
"""
