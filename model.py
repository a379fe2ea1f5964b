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


MODELS = {
    "mlp": MLP,
    "linear": lambda: nn.Linear(FEATURES, 1),  # a single dense layer, as in many DDP demos
}


def build_model(name: str = "mlp") -> nn.Module:
    return MODELS[name]()
