"""The JPEGs a deferred loader leaves encoded: which files qualify, ultralytics' buffer and resize
rule kept on stand-ins, the decoder's kept images, and batches of mixed files against stock (the
CPU decodes as OpenCV does: bit for bit there; nvJPEG on the GPU within a few levels)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")
pytest.importorskip("torchvision")
cv2 = pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")

from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data.build import build_yolo_dataset  # noqa: E402
from ultralytics.data.utils import check_det_dataset  # noqa: E402

from tests.ultralytics._augment import seeded_batch  # noqa: E402
from trainfuse.losses.detection.targets import add_padded_targets  # noqa: E402
from trainfuse.ultralytics.augment import deferred  # noqa: E402
from trainfuse.ultralytics.augment.batch import finish_batch  # noqa: E402
from trainfuse.ultralytics.augment.decode import (  # noqa: E402
    JPEG,
    RAW,
    Encoded,
    JpegDecoder,
    pack_sources,
    probe_jpeg,
    stand_in,
    why_not_gpu_decoding,
)
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


def _photo(seed=0, h=48, w=64):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def test_only_jpegs_opencv_and_the_gpu_decode_alike_qualify(tmp_path):
    img = _photo()
    rgb = Image.fromarray(img[..., ::-1])
    rgb.save(tmp_path / "plain.jpg", quality=90)
    rgb.convert("L").save(tmp_path / "grey.jpg")
    rgb.save(tmp_path / "progressive.jpg", progressive=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: OpenCV turns it, the GPU decoder would not
    rgb.save(tmp_path / "rotated.jpg", exif=exif)
    rgb.save(tmp_path / "image.png")
    rgb.convert("CMYK").save(tmp_path / "cmyk.jpg")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    data, h, w = probe_jpeg(str(tmp_path / "plain.jpg"))
    assert (h, w) == (48, 64) and data.dtype == np.uint8
    assert data.size == (tmp_path / "plain.jpg").stat().st_size
    assert probe_jpeg(str(tmp_path / "grey.jpg"))[1:] == (48, 64)
    for name in ("progressive.jpg", "rotated.jpg", "image.png", "cmyk.jpg", "broken.jpg", "missing.jpg"):
        assert probe_jpeg(str(tmp_path / name)) is None, name


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A photo dataset of 96 x 72 JPEGs, two of them re-saved as PNG (decoded by the workers)."""
    root = tmp_path_factory.mktemp("decode")
    yaml = make_shapes_dataset(root, n_train=8, n_val=2, imgsz=96, photo=True)
    images = sorted((Path(yaml).parent / "images" / "train").glob("*.jpg"))
    for jpg in images[:2]:
        cv2.imwrite(str(jpg.with_suffix(".png")), cv2.imread(str(jpg)))
        jpg.unlink()
    return check_det_dataset(str(yaml))


def _pair(data, imgsz=96, **overrides):
    cfg = get_cfg(overrides={"imgsz": imgsz, **overrides})
    stock = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    ours = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    deferred.install(ours, copy.copy(cfg), pad=True, decode=True)
    return stock, ours


@pytest.mark.parametrize("imgsz", [96, 64, 128], ids=["as-is", "smaller", "larger"])
def test_stand_ins_keep_ultralytics_shapes_and_buffer(mixed, imgsz):
    stock, ours = _pair(mixed, imgsz)
    stock.max_buffer_length = ours.max_buffer_length = 3  # evictions within a few loads
    for i in (0, 3, 5, 2, 7, 3, 1, 6, 0, 4):
        im, hw0, hw = stock.load_image(i)
        im2, hw0_2, hw_2 = ours.load_image(i)
        assert (hw0, hw, im.shape) == (hw0_2, hw_2, im2.shape)
        assert isinstance(im2, Encoded) == ours.im_files[i].endswith(".jpg")  # the PNGs are decoded
        assert stock.buffer == ours.buffer
        assert [x is None for x in stock.ims] == [x is None for x in ours.ims]


def _batch(dataset, seed):
    return seeded_batch(dataset, seed, images=(0, 1, 3, 5))


@pytest.mark.parametrize("imgsz", [96, 64], ids=["as-is", "resized"])
def test_mixed_batches_equal_stock(mixed, imgsz, kernels, device, stock_decodes_as_the_gpu):
    stock_decodes_as_the_gpu(device.type == "cuda")
    stock, ours = _pair(mixed, imgsz)
    decoder = JpegDecoder(capacity=64)
    for seed in range(3):
        out = _batch(ours, seed)
        assert out["aug_jpeg"].pin_memory() is out["aug_jpeg"]  # the DataLoader's pinning passes it by
        kinds = out["aug_sources"].tensor[:, 0]
        assert (kinds == RAW).any() and (kinds == JPEG).any()  # PNG tiles ride along as pixels
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in out.items()}
        got = finish_batch(moved, decoder)["img"].cpu()
        want = add_padded_targets(_batch(stock, seed))
        assert torch.equal(out["bboxes"], want["bboxes"]) and torch.equal(out["cls"], want["cls"])
        diff = (got.int() - want["img"].int()).abs()
        if imgsz == 96:  # stock decodes as the decoder does: the stock pixels
            assert (diff == 0).float().mean() > 0.99 and (diff <= 1).float().mean() > 0.9999
        else:  # the resize a level apart where OpenCV's fixed point rounds apart, moved by the HSV jitter
            assert diff.float().mean() < 0.5 and (diff <= 1).float().mean() > 0.97, diff.float().mean()
    assert decoder.decoded > 0 and decoder.reused > 0


@pytest.mark.parametrize("hw", [(32, 43), (60, 80), (97, 129), (48, 64)], ids=str)
def test_resizing_is_opencvs_bilinear_within_a_level(hw):
    from trainfuse.ultralytics.augment.decode import _to_hwc_bgr

    img = _photo(3)
    want = cv2.resize(img, hw[::-1], interpolation=cv2.INTER_LINEAR)
    got = _to_hwc_bgr(torch.from_numpy(img[..., ::-1].copy()).permute(2, 0, 1), *hw).numpy()
    diff = np.abs(got.astype(int) - want)
    assert got.shape == (*hw, 3) and diff.max() <= 1 and (diff == 0).mean() > 0.8
    if hw == (48, 64):  # the decoded size: no resize, the pixels as they are
        assert diff.max() == 0


def test_the_decoder_keeps_the_latest_images_and_checks_the_header(tmp_path):
    paths = []
    for k in range(3):
        cv2.imwrite(str(tmp_path / f"{k}.jpg"), _photo(k))
        paths.append(str(tmp_path / f"{k}.jpg"))
    probed = [probe_jpeg(p) for p in paths]
    images = [stand_in(h, w, (k, data, h, w)) for k, (data, h, w) in enumerate(probed)]
    raw = np.full((2, 3, 3), 7, np.uint8)
    decoder = JpegDecoder(capacity=2)
    table, pixels, jpeg = pack_sources([images[0], raw, images[1]])
    assert table.tensor[:, 0].tolist() == [JPEG, RAW, JPEG] and pixels.numel() == 18
    packed = decoder.pack(table, pixels, jpeg)
    first = torch.from_numpy(cv2.imread(paths[0])).reshape(-1)
    assert packed.numel() == 2 * first.numel() + 18 and torch.equal(packed[:first.numel()], first)
    assert torch.equal(packed[first.numel():first.numel() + 18], torch.full((18,), 7, dtype=torch.uint8))
    assert (decoder.decoded, decoder.reused) == (2, 0)
    decoder.pack(*pack_sources([images[2], images[1]]))  # 2 decoded, 1 kept; 0 goes (capacity 2)
    assert (decoder.decoded, decoder.reused, sorted(decoder.kept)) == (3, 1, [1, 2])
    lying = stand_in(10, 10, (5, probed[0][0], 10, 10))
    with pytest.raises(ValueError, match=r"image 5 decoded to \(48, 64\), its header said \(10, 10\)"):
        decoder.pack(*pack_sources([lying]))
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        JpegDecoder(capacity=-1)


def test_without_torchvisions_decode_jpeg_the_workers_decode(monkeypatch):
    """torchvision deprecates its image decoding from 0.29 (for TorchCodec): where ``decode_jpeg``
    is gone, the GPU path says why and the workers decode (the rest stays on the GPU)."""
    import torchvision.io

    assert why_not_gpu_decoding() == ""
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    assert why_not_gpu_decoding().startswith("torchvision.io has no decode_jpeg here")


def test_resident_images_reach_the_batch_without_their_bytes_or_their_file(mixed, tmp_path):
    """Images the decoder keeps for good are marked in the shared index: a load of one then
    reads no file and sends a stand-in without bytes, which the decoder serves from what it
    keeps; the same pixels as with the bytes. Release clears the index."""
    from trainfuse.ultralytics.augment.decode import NO_BYTES, ResidentIndex
    from trainfuse.ultralytics.device_cache import CacheBudget

    stock, ours = _pair(mixed)
    index = ResidentIndex(len(ours.im_files))
    deferred.install(ours, get_cfg(overrides={"imgsz": 96}), pad=True, decode=True, resident=index)
    ours.max_buffer_length = 1  # every load below reads its image again
    jpgs = [i for i, f in enumerate(ours.im_files) if f.endswith(".jpg")]
    decoder = JpegDecoder(capacity=1, budget=CacheBudget(2**30), index=index)
    first, loaded = {}, {}
    for i in jpgs:  # the budget has room: each kept for good, marked with its sizes
        assert index.sizes(i) is None
        loaded[i], hw0, hw = ours.load_image(i)
        assert loaded[i].source[1].size > 0
        first[i] = decoder.pack(*pack_sources([loaded[i]], index))
    assert sorted(decoder.resident) == jpgs and not decoder.kept
    for i in jpgs:
        hw0, hw = stock.load_image(i)[1:]
        assert index.sizes(i) == (*hw0, *hw)
    # a stand-in loaded before (a worker's buffered one) still holds its bytes: they stay home now
    table, raw, jpeg = pack_sources(list(loaded.values()), index)
    assert jpeg.tensor.numel() == 0 and pack_sources(list(loaded.values()))[2].tensor.numel() > 0
    assert torch.equal(decoder.pack(table, raw, jpeg), torch.cat([first[i] for i in jpgs]))

    moved = tmp_path / "moved"  # the resident images' files gone: nothing reads them
    moved.mkdir()
    for i in jpgs:
        Path(ours.im_files[i]).rename(moved / Path(ours.im_files[i]).name)
    try:
        for i in jpgs:
            ours.buffer.clear()
            ours.ims[i] = None
            im, hw0, hw = ours.load_image(i)
            assert isinstance(im, Encoded) and im.source[1] is NO_BYTES
            assert (hw0, hw) == stock.load_image(i)[1:]
            again = decoder.pack(*pack_sources([im]))
            assert torch.equal(again, first[i])
        decoder.release()
        assert all(index.sizes(i) is None for i in jpgs)
        with pytest.raises(ValueError, match=rf"image {jpgs[0]} came without its bytes, as one kept"):
            decoder.pack(*pack_sources([stand_in(*hw, (jpgs[0], NO_BYTES, *hw0))]))
    finally:
        for i in jpgs:
            (moved / Path(ours.im_files[i]).name).rename(ours.im_files[i])
