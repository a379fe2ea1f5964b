"""gpt/train.py whose pipeline never adds the gradients of the tied matrix's two copies (the embedding on the
first stage, the head on the last): each copy steps on its own part of the gradient, as two matrices would.
For the test that shows the pp proof can fail (tests/test_gpt.py). Run as a script of the harness: main() is
gpt/train.py's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train", "parallelize", "pipeline"):  # the root's model.py and data.py: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

train.pipeline.Pipeline.tie_gradients = lambda self: None
main = train.main
