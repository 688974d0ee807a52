"""The MindSpore "Per-sample-gradients" tutorial (TD(0) with a linear value function) on psgrad.

The tutorial's value function is ``v(theta, s) = theta . s`` with the pseudo-loss
``(stop_gradient(r + v(theta, s')) - v(theta, s))^2``; it vmaps the update over a batch of
transitions. psgrad's ``linear-value`` model is that function, and ``client.td0`` returns per
transition ``td_errors`` (delta_i) and ``updates`` (delta_i * grad v(s_i), the tutorial's
Delta theta without a learning rate). The tutorial prints ``[-4, -8, 0]`` because its
``td_loss`` reads ``s'`` where it means ``s``; psgrad follows the formula, so the same numbers give
``[3.6, 1.8, -3.6]``.

Then the same call drives TD(0) learning: the weights are sent with each request
(``weights={"theta": theta}``), so the server never needs to store them.

    python examples/mindspore_td0.py [--url http://gpu-host:8000]
"""

from __future__ import annotations

import argparse

import numpy as np

import psgrad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="the psgrad server (default: $PSGRAD_URL)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    with psgrad.Client(base_url=args.url) as client:
        # The tutorial's numbers: theta, one transition (s, r, s'), then a batch of copies.
        theta = np.array([0.2, -0.2, 0.1], dtype=np.float32)
        s = np.array([[2.0, 1.0, -2.0]], dtype=np.float32)
        s_next = np.array([[1.0, 2.0, 0.0]], dtype=np.float32)
        one = client.td0("linear-value", s, [2.0], s_next, weights={"theta": theta},
                         outputs=["updates", "td_errors", "grads"])
        print("delta:", one.td_errors, "updates:", one.updates["theta"][0])
        np.testing.assert_allclose(one.td_errors, [1.8], rtol=1e-6)
        np.testing.assert_allclose(one.updates["theta"][0], [3.6, 1.8, -3.6], rtol=1e-6)
        np.testing.assert_allclose(one.grads["theta"][0], [-7.2, -3.6, 7.2], rtol=1e-6)

        batch = client.td0("linear-value", np.repeat(s, 4, 0), [2.0] * 4,
                           np.repeat(s_next, 4, 0), weights={"theta": theta})
        assert batch.updates["theta"].shape == (4, 3)  # vmap's in_axes=(None, 0, 0, 0)
        np.testing.assert_allclose(batch.updates["theta"], np.tile([3.6, 1.8, -3.6], (4, 1)),
                                   rtol=1e-6)

        # TD(0) learning on a three-state chain A -> B -> C -> end, reward 1 at the end, gamma 1:
        # one-hot features, so theta is the value table and must reach [1, 1, 1].
        states = np.eye(3, dtype=np.float32)
        next_states = np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=np.float32)
        rewards, dones = [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]
        theta = np.zeros(3, dtype=np.float32)
        for _ in range(args.steps):
            step = client.td0("linear-value", states, rewards, next_states, dones=dones,
                              gamma=1.0, weights={"theta": theta}, outputs=["mean"])
            # "mean" of the td0 gradients is mean_i(-2 delta_i grad v): step against it.
            theta = theta - 0.5 * step.mean["theta"]
        print("learned values:", np.round(theta, 3))
        np.testing.assert_allclose(theta, [1.0, 1.0, 1.0], atol=0.02)


if __name__ == "__main__":
    main()
