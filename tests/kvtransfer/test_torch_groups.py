"""The torch backend's pair process groups (gloo on loopback, both ranks in this process): one
rendezvous however many receives race for a new peer, a failed group is never reused, and only a
holder of the cluster token joins a pair's group."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.cluster_token import TOKEN_ENV, rendezvous_namespace
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.torch_backend import PairGroups, host_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store_address():
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=20)
    yield f"127.0.0.1:{port}"
    del store


def test_concurrent_receives_share_one_rendezvous(store_address):
    sender_groups, receiver_groups = PairGroups(timeout_s=20), PairGroups(timeout_s=20)
    cpu = torch.device("cpu")
    tensors = [torch.arange(64, dtype=torch.float32) + i for i in range(8)]

    def send_all():
        group = sender_groups.get(store_address, "prefill-a/0", 0, cpu)
        works = [group.send([t], 1, tag) for tag, t in enumerate(tensors)]
        for w in works:
            w.wait()

    def receive(tag: int) -> tuple[object, torch.Tensor]:
        group = receiver_groups.get(store_address, "prefill-a/0", 1, cpu)
        buf = torch.empty(64)
        group.recv([buf], 0, tag).wait()
        return group, buf

    with ThreadPoolExecutor(9) as pool:
        received = [pool.submit(receive, tag) for tag in reversed(range(8))]  # eight threads race for the group
        sent = pool.submit(send_all)
        results = [f.result(timeout=60) for f in received]
        sent.result(timeout=60)
    assert len({id(group) for group, _ in results}) == 1
    for (_, buf), tag in zip(results, reversed(range(8))):
        assert torch.equal(buf, tensors[tag])


def test_a_failed_group_is_not_made_again(store_address):
    groups = PairGroups(timeout_s=1)
    groups.fail(store_address, "prefill-b/0")
    with pytest.raises(TransferError, match="failed earlier") as info:
        groups.get(store_address, "prefill-b/0", 1, torch.device("cpu"))
    assert info.value.reason == "peer_group"


def test_only_a_holder_of_the_cluster_token_joins_a_pair_group(store_address):
    cpu = torch.device("cpu")
    ours = rendezvous_namespace({TOKEN_ENV: "the-cluster-secret"})
    assert "the-cluster-secret" not in ours and ours != rendezvous_namespace({TOKEN_ENV: "another-secret"})
    receiver, sender = PairGroups(timeout_s=30, namespace=ours), PairGroups(timeout_s=30, namespace=ours)
    tensor = torch.arange(16, dtype=torch.float32)

    def receive() -> torch.Tensor:
        buf = torch.empty(16)
        receiver.get(store_address, "prefill-a/0", 1, cpu).recv([buf], 0, 7).wait()
        return buf

    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receive)  # waits in the rendezvous for its rank 0
        for outsider in (rendezvous_namespace({}), rendezvous_namespace({TOKEN_ENV: "another-secret"})):
            with pytest.raises(RuntimeError):  # under its keys no rank 1 ever comes: it times out
                PairGroups(timeout_s=1, namespace=outsider).get(store_address, "prefill-a/0", 0, cpu)
        assert not received.done()
        sender.get(store_address, "prefill-a/0", 0, cpu).send([tensor], 1, 7).wait()
        assert torch.equal(received.result(timeout=60), tensor)
