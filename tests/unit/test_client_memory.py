"""The client reads a large answer into memory of an earlier answer only once nothing refers to it.

Through the SDK against a numpy server (httpx.MockTransport) whose answer's grads are the
inputs themselves: each answer is checked equal to its own request, and no array the test still
holds (a whole answer, one tensor, a slice, a torch tensor made from one) is ever overwritten.
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import torch

import psgrad
from psgrad import _memory
from psgrad._wire import REQUEST_KEY, RESPONSE_KEY, fields_from_safetensors, fields_to_safetensors

D = 300_000  # 1.2 MB a sample of float32: above the pool's minimum


def grads_server(request: httpx.Request) -> httpx.Response:
    fields = fields_from_safetensors(request.content, REQUEST_KEY)
    x = fields["inputs"]
    answer = {"model": "echo@1", "batch_size": len(x), "loss": "mse",
              "grads": {"w": x, "b": x[:, :10].copy()}, "norms": np.linalg.norm(x, axis=1),
              "meta": {}}
    return httpx.Response(200, content=fields_to_safetensors(answer, RESPONSE_KEY),
                          headers={"content-type": "application/x-safetensors"})


def client() -> psgrad.Client:
    return psgrad.Client("http://psgrad.test", transport=httpx.MockTransport(grads_server),
                         max_batch_size=64)


def batch(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(2, D)).astype(np.float32)


def address(arr: Any) -> int:
    return int(np.asarray(arr).__array_interface__["data"][0])


def ask(c: psgrad.Client, seed: int) -> Any:
    return c.per_sample_grads("echo", batch(seed), np.zeros(2, np.float32), loss="mse",
                              outputs=["grads", "norms"])


def test_a_dropped_answer_s_memory_serves_a_later_answer() -> None:
    with client() as c:
        first = ask(c, 0)
        seen = address(first.grads["w"])
        del first
        res = ask(c, 1)
        for step in range(2, 6):  # a loop: the previous answer is held while the next arrives
            res = ask(c, step)
            np.testing.assert_array_equal(res.grads["w"], batch(step))
            np.testing.assert_array_equal(res.grads["b"], batch(step)[:, :10])
        assert address(res.grads["w"]) == seen or address(ask(c, 9).grads["w"]) == seen


@pytest.mark.parametrize("keep", ["answer", "tensor", "slice", "torch"])
def test_memory_the_caller_still_refers_to_is_never_written(keep: str) -> None:
    with client() as c:
        first = ask(c, 0)
        held: Any = {"answer": first, "tensor": first.grads["w"],
                     "slice": first.grads["w"][1, 5:], "torch": torch.from_numpy(first.grads["w"])
                     }[keep]
        del first

        def values() -> np.ndarray:
            return np.asarray(held.grads["w"] if keep == "answer" else held)

        want = values().copy()
        later = [ask(c, seed) for seed in range(1, 6)]
        np.testing.assert_array_equal(values(), want)
        addresses = {address(r.grads["w"]) for r in later}
        assert len(addresses) == 5  # every later answer in its own memory while all are held


def test_small_tensors_are_never_pooled_and_close_lets_go(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    with client() as c:
        ask(c, 0)
        ask(c, 1)
        kept = c._memory._buffers
        assert kept and all(b.nbytes >= _memory.MIN_BYTES for _, b in kept)
    assert c._memory._buffers == []
    monkeypatch.setattr(_memory, "_ALONE", -1)  # no reference counts (not CPython): no reuse
    with client() as c:
        ask(c, 0)
        ask(c, 1)
        assert c._memory._buffers == []
