"""The synthetic regression task that every training script shares.

Targets come from a fixed hidden function plus Gaussian noise of known variance, so the best
loss any model can reach is known in advance: the mean squared error of the hidden function
itself, NOISE_STD ** 2. "The model learned" is then a number: how close the validation loss gets
to LOSS_FLOOR.

The data are generated from a fixed seed, so every rank builds the same tensors with no
communication and nothing to download.
"""
import torch
from torch.utils.data import TensorDataset

FEATURES = 20
TRAIN_SIZE = 4096  # 4096 / (32 per rank × 4 ranks) = 32 steps per epoch, as in common DDP demos
VAL_SIZE = 1024
NOISE_STD = 0.5
LOSS_FLOOR = NOISE_STD**2  # expected MSE of the hidden function: no model can do better
DATA_SEED = 0  # fixed: the task is the same whatever --seed the training run uses


def _hidden_function(generator: torch.Generator):
    """A linear part plus two tanh units: mostly linear, with a bend that a linear model misses."""
    w = torch.randn(FEATURES, generator=generator) / FEATURES**0.5
    u = torch.randn(FEATURES, 2, generator=generator) / FEATURES**0.5
    c = torch.randn(2, generator=generator)
    return lambda x: x @ w + torch.tanh(x @ u) @ c


def make_datasets(train_size: int = TRAIN_SIZE, val_size: int = VAL_SIZE) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, validation) sets of (x, y) with x: (FEATURES,) and y: (1,), float32."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    hidden = _hidden_function(generator)

    def sample(n: int) -> TensorDataset:
        x = torch.randn(n, FEATURES, generator=generator)  # (n, FEATURES)
        noise = NOISE_STD * torch.randn(n, generator=generator)
        return TensorDataset(x, (hidden(x) + noise).unsqueeze(1))  # y: (n, 1)

    return sample(train_size), sample(val_size)
