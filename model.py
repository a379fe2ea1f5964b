"""The models that every training script shares.

Both end in a single output trained with mean squared error. Never put cross-entropy on a
single output: log-softmax over one logit is always 0, so the loss and every gradient are 0.
"""
from torch import nn

from data import FEATURES


class MLP(nn.Module):
    """The default: one hidden layer, small enough to train in seconds on a CPU."""

    def __init__(self, in_features: int = FEATURES, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)  # (batch, 1)


class WideMLP(nn.Module):
    """bench_ddp.py's model, large enough that communication matters: 20 → 1024 → 1024 → 1024 → 1,
    2.1 million parameters, so 8.5 MB of float32 gradients to all-reduce at every step. That takes about
    8 ms at the 2-rank loopback gloo bandwidth that bench_comm.py measures (about 1 GB/s), about as long
    as a step's compute at a per-rank batch of a few dozen samples on one core: a sweep of batch sizes
    crosses from communication-bound to compute-bound. With DDP's default buckets (a first bucket of
    1 MiB, then 25 MiB) the gradients fall into two buckets, so one all-reduce can run during backward."""

    def __init__(self, in_features: int = FEATURES, width: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1),
        )

    def forward(self, x):
        return self.net(x)  # (batch, 1)


MODELS = {
    "mlp": MLP,
    "linear": lambda: nn.Linear(FEATURES, 1),  # a single dense layer, as in many DDP demos
    "wide": WideMLP,
}


def build_model(name: str = "mlp") -> nn.Module:
    return MODELS[name]()
