"""ultralytics' training augmentation on a whole batch at once, in torch (any device): the random
affine/perspective warp with its box transform and box-candidate filter (``RandomPerspective``),
the HSV jitter (``RandomHSV``) and the flips (``RandomFlip``), each fed the same parameters
ultralytics' own transform draws, from the same distributions (:mod:`.params`).

Each op takes a batch of uint8 images ``(N, C, H, W)`` in BGR channel order, as ultralytics'
loaders hold them, and per-image parameters; boxes are ``(K, 4)`` xyxy pixels with the index of
their image. Where they differ from OpenCV's results on purpose (interpolation arithmetic) the
function says so; the tests hold each against ultralytics' transform on the same parameters.

``FusedDetectionTrainer(gpu_augment=True)`` takes another route, which keeps ultralytics' random
draws exactly: :mod:`.deferred` (the loader's side: ultralytics' transforms leave the pixels to the
GPU) and :mod:`.kernel` (one pass over a batch's pixels), joined by :mod:`.batch`. The ops here
stay as batched building blocks and references.
"""

from trainfuse.ultralytics.augment.color import hsv_jitter
from trainfuse.ultralytics.augment.geometry import box_candidates, flip, warp_boxes, warp_images
from trainfuse.ultralytics.augment.params import AffineParams, affine_params, flip_params, hsv_gains

__all__ = ["AffineParams", "affine_params", "box_candidates", "flip", "flip_params", "hsv_gains",
           "hsv_jitter", "warp_boxes", "warp_images"]
