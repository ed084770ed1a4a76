"""`accum_optimizers.torch_distributed` without ranks: the buckets, and
the arguments refused before any process group is needed."""

import keras
import pytest

pytestmark = pytest.mark.backends("torch")


def test_buckets_split_by_size_and_dtype():
    import torch

    from accum_optimizers._backend.torch import _buckets

    tensors = [
        torch.zeros(4),  # 16 bytes
        torch.zeros(2),  # 8
        torch.zeros(3),  # 12: over 32 with the first two
        torch.zeros(1, dtype=torch.float64),
        torch.zeros(20),  # 80: larger than a bucket, alone
    ]
    sizes = [[t.numel() for t in b] for b in _buckets(tensors, 32)]
    assert sizes == [[4, 2], [3], [1], [20]]


def test_sync_windows_refuses_what_it_cannot_sync():
    import torch.distributed as dist

    from accum_optimizers import AdamAccumulate
    from accum_optimizers._backend.torch import window_sync
    from accum_optimizers.torch_distributed import sync_windows
    from accum_optimizers.torch_distributed import weigh_next_backward

    with pytest.raises(ValueError, match="accum_iters=1"):
        sync_windows(AdamAccumulate(accum_iters=1))
    with pytest.raises(ValueError, match="optimizer="):
        sync_windows(keras.optimizers.Adam())
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        sync_windows(AdamAccumulate(accum_iters=2), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="bucket_cap_mb=True"):
        sync_windows(AdamAccumulate(accum_iters=2), bucket_cap_mb=True)
    with pytest.raises(ValueError, match="model=<object"):
        sync_windows(AdamAccumulate(accum_iters=2), model=object())
    with pytest.raises(ValueError, match="weigh_next_backward"):
        weigh_next_backward(AdamAccumulate(accum_iters=2), 3)
    with pytest.raises(ValueError, match="no trainable variables"):
        sync_windows(AdamAccumulate(accum_iters=2), model=keras.Sequential())
    assert not dist.is_initialized()
    optimizer = AdamAccumulate(accum_iters=2)
    with pytest.raises(ValueError, match="init_process_group"):
        sync_windows(optimizer)
    assert window_sync(optimizer) is None


def test_the_overlap_with_the_noise_scale_is_refused_naming_both():
    from accum_optimizers import AdamAccumulate
    from accum_optimizers._backend.torch import window_sync
    from accum_optimizers.torch_distributed import sync_windows

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = AdamAccumulate(accum_iters=2, measure_noise_scale=True)
    with pytest.raises(ValueError, match="measure_noise_scale=True"):
        sync_windows(optimizer, model=model)
    assert window_sync(optimizer) is None
