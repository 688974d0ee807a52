"""The PyTorch "Per-sample-gradients" tutorial, with the gradients computed by a psgrad server.

The tutorial builds a small CNN, takes a batch of 64 MNIST-shaped samples, computes per-sample
gradients with ``vmap(grad(...))`` and checks them against a loop over the batch. Here the server
computes them (its ``simple-cnn`` is the tutorial's CNN); this script downloads the server's
weights into the tutorial's own module, runs the tutorial's per-sample loop locally and checks the
server's answer against it with the tutorial's tolerance (``atol=3e-3, rtol=1e-5``).

    psgrad serve &                      # or point PSGRAD_URL at a GPU host
    python examples/pytorch_tutorial.py [--batch-size 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import psgrad


class SimpleCNN(nn.Module):  # the tutorial's model, unchanged
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def loss_fn(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(predictions, targets)


def per_sample_loop(model: nn.Module, data: torch.Tensor,
                    targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tutorial's reference: one backward pass per sample."""
    grads: list[tuple[torch.Tensor, ...]] = []
    for x, t in zip(data, targets, strict=True):
        loss = loss_fn(model(x.unsqueeze(0)), t.unsqueeze(0))
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    names = [name for name, _ in model.named_parameters()]
    return {name: torch.stack([g[i] for g in grads]) for i, name in enumerate(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--url", help="the psgrad server (default: $PSGRAD_URL)")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = torch.randn(args.batch_size, 1, 28, 28)  # MNIST-shaped, as in the tutorial
    targets = torch.randint(10, (args.batch_size,))

    with psgrad.Client(base_url=args.url) as client:
        model = SimpleCNN()
        model.load_state_dict(client.models.download_weights("simple-cnn", as_torch=True))
        result = client.per_sample_grads("simple-cnn", data, targets,
                                         outputs=["grads", "losses"], as_torch=True)

    expected = per_sample_loop(model, data, targets)
    for name, grad in expected.items():
        assert result.grads[name].shape == (args.batch_size, *grad.shape[1:])
        assert torch.allclose(result.grads[name], grad, atol=3e-3, rtol=1e-5), name
    losses = F.nll_loss(model(data), targets, reduction="none").detach()
    assert torch.allclose(result.losses, losses, atol=1e-5, rtol=1e-5)
    print(f"{result.model}: per-sample gradients of {args.batch_size} samples match the "
          f"per-sample loop for all {len(expected)} parameters "
          f"(server compute {result.timing.get('compute_ms', 0.0):.0f} ms)")


if __name__ == "__main__":
    main()
