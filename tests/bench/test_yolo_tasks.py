"""The yolo benchmark's pieces for other tasks, on CPU (the runs need a GPU): which synthetic data a
model gets, the results' name, and each task's headline metrics."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from trainfuse.bench import yolo
from trainfuse.bench.yolo_harness import final_map

pytest.importorskip("ultralytics")


@pytest.mark.parametrize("model,task,made", [("yolov5n.yaml", "detect", "data.yaml"),
                                             ("yolo11n-seg.yaml", "segment", "data.yaml"),
                                             ("yolo11n-pose.yaml", "pose", "data.yaml"),
                                             ("yolo11n-obb.yaml", "obb", "data.yaml"),
                                             ("yolo11n-cls.yaml", "classify", None)])
def test_each_task_gets_its_own_synthetic_data(model, task, made, tmp_path):
    from trainfuse.ultralytics.tasks import task_of

    assert task_of(model) == task
    args = types.SimpleNamespace(model=model, imgsz=64, images=4, val_images=2, seed=0,
                                 data_dir=str(tmp_path), photo=False)
    data = Path(yolo._dataset(args, task))
    if made:
        assert data.name == made and (task in data.parent.name or task == "detect")
    else:  # classification trains from the folder of class folders
        assert (data / "train").is_dir() and (data / "val").is_dir()


def test_results_are_named_by_model_optimizer_fused_loss_and_gpus():
    assert yolo.family("yolov5n.yaml") == "yolo"
    assert yolo.family("yolo11n-seg.yaml", fused_loss=True) == "yolo-yolo11n-seg-fused-loss"
    assert yolo.family("yolo11n-pose.yaml", gpu_augment=True) == "yolo-yolo11n-pose-gpu-augment"
    assert yolo.family("yolo11m.yaml", fuse_blocks=True) == "yolo-yolo11m-fuse-blocks"
    concat = yolo.family("yolo11s.yaml", fuse_blocks=True, fuse_concat=True)
    assert concat == "yolo-yolo11s-fuse-blocks-fuse-concat"
    timed = yolo.family("yolo11m.yaml", fuse_blocks=True, cudnn_benchmark=True)
    assert timed == "yolo-yolo11m-fuse-blocks-cudnn-benchmark"
    assert yolo.family("yolo11n.yaml", "MuSGD", "0,1") == "yolo-yolo11n-MuSGD-2gpus"
    assert yolo.family("yolo11s.yaml", fuse_blocks=False) == "yolo-yolo11s-no-fuse-blocks"
    assert yolo.family("yolov5n.yaml", batch=64) == "yolo-batch64"
    assert yolo.family("yolo11n-cls.yaml", batch=64) == "yolo-yolo11n-cls"  # its default batch
    assert yolo.family("yolo11n-cls.yaml", batch=16) == "yolo-yolo11n-cls-batch16"


@pytest.mark.parametrize("task,keys", [("detect", ("metrics/mAP50(B)", "metrics/mAP50-95(B)")),
                                       ("obb", ("metrics/mAP50(B)", "metrics/mAP50-95(B)")),
                                       ("segment", ("metrics/mAP50(M)", "metrics/mAP50-95(M)")),
                                       ("pose", ("metrics/mAP50(P)", "metrics/mAP50-95(P)")),
                                       ("classify", ("metrics/accuracy_top1", "metrics/accuracy_top5"))])
def test_each_tasks_headline_metrics(task, keys):
    metrics = {"metrics/mAP50(B)": 0.1, "metrics/mAP50-95(B)": 0.2, "metrics/mAP50(M)": 0.3,
               "metrics/mAP50-95(M)": 0.4, "metrics/mAP50(P)": 0.5, "metrics/mAP50-95(P)": 0.6,
               "metrics/accuracy_top1": 0.7, "metrics/accuracy_top5": 0.8}
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(task=task), metrics=metrics)
    assert final_map(trainer) == (metrics[keys[0]], metrics[keys[1]])


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_nhwckrsc_nhwc", "convolution"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<__half, float, 512, true, 1>", "batchnorm"),
    ("bn_silu_apply_kernel", "batchnorm"),
    ("into_grad_sums_kernel", "batchnorm"),  # the BatchNorm kernels writing into a concatenation
    ("void at::native::(anonymous namespace)::upsample_nearest2d_nhwc_out_frame<c10::Half>", "upsample/pool"),
    ("up_concat_fwd_kernel", "upsample/pool"),
    ("void at::native::(anonymous namespace)::max_pool_forward_nhwc<c10::Half, float>", "upsample/pool"),
    ("pool_chain_bwd_kernel", "upsample/pool"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>, unsigned int>",
     "copy/cat"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", "matmul"),
    ("nvjet_sm90_hsh_128x160_64x5_2x1_v_ssched_bz_TNT", "matmul"),
    ("Memcpy DtoH (Device -> Pageable)", "to host"),
    ("Memcpy DtoD (Device -> Device)", "copy/cat"),
    ("void at::native::scatter_add_kernel", "other"),  # "scatter" is not a concatenation
    ("_adamw_chunk_kernel", "other"),
])
def test_kernel_kinds_by_name(name, kind):
    from trainfuse.bench.yolo_harness import kernel_kind

    assert kernel_kind(name) == kind


def test_top_kernels_add_up_by_name_longest_first():
    """The bench's list of the longest kernels sums each name's GPU time and calls, leaves host
    events out and cuts long names."""
    import types

    import torch

    from trainfuse.bench.yolo_harness import top_kernels

    def event(name, us, device=torch.autograd.DeviceType.CUDA):
        return types.SimpleNamespace(name=name, device_type=device,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))

    long = "k" * 120
    prof = types.SimpleNamespace(events=lambda: [
        event("bn_stats_kernel", 300.0), event(long, 1000.0), event("bn_stats_kernel", 900.0),
        event("aten::add", 5000.0, torch.autograd.DeviceType.CPU), event("silu", 100.0)])
    assert top_kernels(prof) == [("bn_stats_kernel", 1.2, 2), ("k" * 90, 1.0, 1), ("silu", 0.1, 1)]
    assert top_kernels(prof, n=1) == [("bn_stats_kernel", 1.2, 2)]
