"""gpt/train.py whose pipeline loss also divides by the number of micro-batches, as a loss under gradient
accumulation does without a pipeline: torch's schedules divide the gradients by it already (scale_grads), so
they come out that many times too small. For the test that shows the pp proof can fail (tests/test_gpt.py).
Run as a script of the harness: main() is gpt/train.py's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train", "parallelize", "pipeline"):  # the root's model.py and data.py: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

built = train.pipeline.Pipeline.__init__


def scaled_twice(self, *args, **kwargs) -> None:
    built(self, *args, **kwargs)
    self.schedule._loss_fn = lambda logits, targets: train.pipeline.loss(logits, targets) / self.micro_batches


train.pipeline.Pipeline.__init__ = scaled_twice
main = train.main
