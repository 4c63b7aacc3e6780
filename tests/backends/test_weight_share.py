"""The pieces of weights sent by broadcast (``ModelConfig.weight_transport="nccl"``; gloo where
the weights are CPU tensors, as here), in threads of this process: packing, snapshots, groups, and
the refusals. The engine on Ray is in engine/test_weight_transport.py, the GPU variants in
engine/test_gpu.py."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import numpy as np
import pytest

import flowrl
from flowrl._backends.weight_share import Groups, Sender, pack, unpack

torch = pytest.importorskip("torch")


def test_pack_and_unpack_keep_every_dtype_shape_and_value():
    weights = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "d": torch.randn(7),
        "e": torch.tensor(1.5),
    }
    layout, flats = pack(weights)
    assert set(flats) == {"float32", "int64", "bfloat16"}  # one flat per dtype
    out = unpack(layout, flats)
    for name, value in weights.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name


def run_all(*jobs: tuple[Any, ...]) -> list[Any]:
    """Run each (fn, *args) on a thread of its own (ranks of one group); their results, or raise."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def one(i: int, fn: Any, *args: Any) -> None:
        try:
            results[i] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i, *job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank of the broadcast hangs"
    if errors:
        raise errors[0]
    return results


def test_a_snapshot_reaches_every_receiver_and_the_group_serves_the_next_one():
    sender = Sender()
    weights = {"w": torch.randn(4, 3), "half": torch.randn(3).to(torch.bfloat16)}
    first = sender.snapshot(weights, "trainer")
    expected = {k: v.clone() for k, v in weights.items()}
    with torch.no_grad():
        weights["w"].add_(1.0)  # a later train step: the snapshot keeps the values it took
    group = sender.groups.serve("127.0.0.1", 3, first.backend, 30.0)
    receivers = [Groups(), Groups()]  # each replica's own, as in its process

    def receive(share: Any, rank: int) -> dict[str, Any]:
        addressed = msgspec.structs.replace(share, group=group, rank=rank)
        return addressed.receive(torch.device("cpu"), receivers[rank - 1], f"replica {rank}")

    got = run_all((sender.send, group, first.snapshot, []), (receive, first, 1), (receive, first, 2))
    assert first.backend == "gloo"
    for rank in (1, 2):
        for name, value in expected.items():
            assert torch.equal(got[rank][name], value), (rank, name)
    # groups served since (replicas joining, other targets) do not close it while the driver
    # names it; those it does not name are closed at the next send
    others = [sender.groups.serve("127.0.0.1", 2, "gloo", 30.0) for _ in range(3)]
    second = sender.snapshot(weights, "trainer")  # the next sync, over the same group (its ranks are joined)
    got = run_all((sender.send, group, second.snapshot, [others[0].id]), (receive, second, 1), (receive, second, 2))
    assert all(torch.equal(got[r]["w"], weights["w"]) for r in (1, 2))
    assert set(sender.groups._open) == {group.id, others[0].id}
    sender.snapshot(weights, "trainer")
    with pytest.raises(flowrl.ConfigError, match="snapshot 1 is no longer kept"):
        sender.values(first.snapshot)  # the last two are kept, for replicas joining mid-sync
    assert torch.equal(sender.values(second.snapshot)["w"], weights["w"])


def test_cuda_weights_by_nccl_to_a_replica_without_a_gpu_are_refused_by_name():
    share = msgspec.structs.replace(Sender().snapshot({"w": torch.ones(2)}, "trainer"), backend="nccl")
    group = flowrl._backends.weight_share.Group(
        id="g", address="127.0.0.1", port=1, world=2, backend="nccl", timeout_s=1.0
    )
    with pytest.raises(flowrl.ConfigError, match=r"replica 0 of 'policy'.*weight_transport='nccl'.*computes on cpu"):
        msgspec.structs.replace(share, group=group, rank=1).receive(
            torch.device("cpu"), Groups(), "replica 0 of 'policy'"
        )


def test_ranks_of_an_nccl_broadcast_sharing_a_gpu_all_fail_by_name_instead_of_hanging():
    import torch.distributed as dist

    from flowrl._backends.weight_share import _one_rank_per_gpu

    store = dist.HashStore()

    def rank_of(rank: int, gpu: str) -> str:
        with pytest.raises(flowrl.ConfigError, match=r"ranks \[0, 2\] of the weight broadcast .* one rank per GPU"):
            _one_rank_per_gpu(store, rank, 3, gpu)
        return gpu

    assert run_all(*((rank_of, r, gpu) for r, gpu in enumerate(["GPU-a", "GPU-b", "GPU-a"]))) == [
        "GPU-a",
        "GPU-b",
        "GPU-a",
    ]
    _one_rank_per_gpu(dist.HashStore(), 0, 1, "GPU-a")  # one rank per GPU: fine


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int64", "float8_e4m3fn"])
def test_weights_by_host_travel_as_numpy_arrays_in_every_dtype(dtype: str) -> None:
    """Host weights are numpy arrays (read zero-copy from Ray's object store), even in a dtype
    numpy lacks (bf16 goes as its bytes), and arrive bit for bit in their own dtype."""
    import pickle

    from flowrl._backends.weight_arrays import Viewed, to_arrays, to_tensors

    torch_dtype = getattr(torch, dtype)
    weights = {"w": torch.randn(4, 3).to(torch_dtype), "step": 7}
    sent = to_arrays(weights)
    assert isinstance(sent["w"], (np.ndarray, Viewed)) and sent["step"] == 7
    array = sent["w"] if isinstance(sent["w"], np.ndarray) else sent["w"].array
    assert isinstance(array, np.ndarray) and array.nbytes == weights["w"].numel() * weights["w"].element_size()
    got = to_tensors(pickle.loads(pickle.dumps(sent, protocol=5)))
    assert got["w"].dtype == torch_dtype
    assert torch.equal(got["w"].view(torch.uint8), weights["w"].view(torch.uint8)) and got["step"] == 7
