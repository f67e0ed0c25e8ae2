"""Bucket plans and the gloo broadcast of rollout/wire/collective.py, between this process and a spawned one (no vLLM)."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from hpc_rl.rollout.wire.collective import broadcast_buckets, join_group, make_plan, plan_bytes, plan_hash, receive_buckets


def test_make_plan_groups_by_dtype_and_size():
    specs = [("a", (4, 4), torch.float32), ("b", (8,), torch.bfloat16), ("c", (10,), torch.float32),
             ("d", (100,), torch.float32), ("e", (2,), torch.int64)]
    plan = make_plan(specs, bucket_bytes=100)
    # a (64 B) + c (40 B) > 100 -> c starts a new fp32 bucket; d (400 B) alone; one tensor never splits.
    assert plan == [
        {"dtype": "float32", "items": [["a", [4, 4]]]},
        {"dtype": "float32", "items": [["c", [10]]]},
        {"dtype": "bfloat16", "items": [["b", [8]]]},
        {"dtype": "float32", "items": [["d", [100]]]},
        {"dtype": "int64", "items": [["e", [2]]]},
    ]
    assert plan_bytes(plan) == 64 + 40 + 16 + 400 + 16
    assert plan_hash(plan) == plan_hash([dict(b) for b in plan]) and 0 <= plan_hash(plan) < 2 ** 63
    assert plan_hash(plan) != plan_hash(plan[:-1])


def _receiver(port, plan, q):
    pg = join_group("127.0.0.1", port, 2, 1, "gloo", 30)
    got = {}
    for named in receive_buckets(pg, plan, 7):
        got.update({n: t.clone() for n, t in named})
    q.put({n: t.tolist() for n, t in got.items()})


def test_gloo_broadcast_roundtrip():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7, "b": torch.tensor([1.5, -2.0]),
               "i": torch.tensor([3, 4, 5])}
    specs = [("w", (3, 4), torch.bfloat16), ("b", (2,), torch.bfloat16), ("i", (3,), torch.int64)]
    plan = make_plan(specs, bucket_bytes=16)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port, plan, q))
    p.start()
    try:
        pg = join_group("127.0.0.1", port, 2, 0, "gloo", 30)
        broadcast_buckets(pg, plan, tensors, 7)
        got = q.get(timeout=60)
    finally:
        p.join(timeout=30)
    assert got["w"] == tensors["w"].to(torch.bfloat16).tolist()
    assert got["b"] == [1.5, -2.0] and got["i"] == [3, 4, 5]


def test_header_mismatch_is_named():
    from hpc_rl.rollout.wire.collective import CollectiveError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = make_plan([("x", (2,), torch.float32)])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_bad_receiver, args=(port, plan, q))
    p.start()
    try:
        pg = join_group("127.0.0.1", port, 2, 0, "gloo", 30)
        try:
            broadcast_buckets(pg, plan, {"x": torch.zeros(2)}, 1)
        except CollectiveError as e:  # the receiver may leave before the bucket is sent
            assert "broadcast of version 1 failed" in str(e)
        msg = q.get(timeout=60)
    finally:
        p.join(timeout=30)
    assert "does not match the announced update" in msg


def _bad_receiver(port, plan, q):
    from hpc_rl.rollout.wire.collective import CollectiveError

    pg = join_group("127.0.0.1", port, 2, 1, "gloo", 30)
    try:
        for _ in receive_buckets(pg, plan, 2):  # expects version 2, the sender sends 1
            pass
        q.put("no error")
    except CollectiveError as e:
        q.put(str(e))
