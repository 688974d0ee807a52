"""What a store append takes: the request contract's per-sample fields, every one of them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from psgrad._contract import SAMPLE_FIELDS
from psgrad._errors import Conflict, InvalidInput
from service.stores.requests import rows_requests
from service.stores.spec import StoreSpec

SPEC = StoreSpec(id="s", model="gpt@abc", loss="next_token", params=("w",), projection_dim=8,
                 projection_seed=0, projection_kind="tensorsketch", dtype="float32")


def test_an_append_takes_every_per_sample_field_of_the_contract() -> None:
    """A padded text batch's ``mask`` goes into the store's projection request with the rest
    (the store's own list of sample fields had drifted from the contract's and refused it)."""
    batch = {k: np.zeros((2, 3)) for k in SAMPLE_FIELDS}
    [fields] = rows_requests(SPEC, "s", batch, "POST /stores/s/samples")
    assert all(fields[k] is batch[k] for k in SAMPLE_FIELDS)
    assert (fields["model"], fields["loss"]) == ("gpt@abc", "next_token")


def test_an_append_names_what_it_does_not_take() -> None:
    with pytest.raises(InvalidInput, match="leave out clip_norm"):
        rows_requests(SPEC, "s", {"inputs": np.zeros((2, 3)), "clip_norm": 1.0}, "an append")


def test_an_ensemble_asks_each_checkpoint_for_the_same_batch() -> None:
    """One request per checkpoint, in order, each naming its own version; the batch's
    ``model`` may name any of them, and is checked once against the whole store."""
    spec = replace(SPEC, checkpoints=("gpt@abc", "gpt@def"))
    batch = {"inputs": np.zeros((2, 3)), "model": "gpt@def"}
    requests = rows_requests(spec, "s", batch, "an append")
    assert [r["model"] for r in requests] == ["gpt@abc", "gpt@def"]
    assert all(r["inputs"] is batch["inputs"] and r["outputs"] == ["projection"]
               and r["projection_dim"] == 8 for r in requests)
    with pytest.raises(Conflict, match="names 'other@abc'"):
        rows_requests(spec, "s", {**batch, "model": "other@abc"}, "an append")
