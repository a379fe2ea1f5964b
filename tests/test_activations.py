"""gpt/activations.py: the bytes a block keeps for its backward under --activation_checkpoint, measured by what is
still alive after its forward, equal the formula in every mode at two sizes; the script prints them so."""
import contextlib
import io
import sys

import pytest
from test_gpt import import_gpt

activations = import_gpt("activations")
import_gpt("train")  # which activations.main() imports for train.py's parser, gpt/ being off the path by then
SIZES = [(activations.GPTConfig(64, 64, **activations.CONFIGS["tiny"]), 8),
         (activations.GPTConfig(96, 40, **activations.CONFIGS["mini"]), 3)]


def run_main(*argv: str) -> tuple[int, str, str]:
    """activations.main() with these arguments: (exit code, stdout, stderr)."""
    saved, sys.argv = sys.argv, ["gpt/activations.py", *argv]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            activations.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("config, batch", SIZES, ids=["tiny, 8 x 64", "mini, 3 x 40"])
@pytest.mark.parametrize("mode", activations.MODES)
def test_a_block_keeps_what_the_formula_says(config, batch, mode):
    """none 16H (and the norms' statistics, attention's log-sum-exp), selective 11H, full H: a checkpoint that
    kept everything, or saved nothing more under selective than under full, would measure otherwise."""
    assert activations.kept_per_block(config, batch, mode) == activations.formula(config, batch, mode)


def test_the_bytes_fall_as_recomputation_grows():
    config, batch = SIZES[0]
    none, selective, full = (activations.kept_per_block(config, batch, mode) for mode in ("none", "selective", "full"))
    h = 4 * batch * config.seq_len * config.n_embd
    assert none > selective > full == h


def test_the_script_prints_each_mode_measured_beside_the_formula():
    code, stdout, stderr = run_main("--bytes_only", "--", "--model", "mini", "--seq_len", "40",
                                    "--batch_size", "3")
    assert code == 0, stderr
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] and line.split()[0] in activations.MODES]
    assert [row[0] for row in rows] == activations.MODES
    assert all(row[1] == row[4] for row in rows)  # measured == by formula


@pytest.mark.parametrize("argv", [["--world_size", "0"], ["--repeats", "0"], ["--", "--batch_size", "0"]])
def test_bad_input_is_one_line(argv):
    code, _, stderr = run_main(*argv)
    assert code == 2 and "must be at least 1" in stderr.splitlines()[-1] and "Traceback" not in stderr


def test_a_llama_shape_is_refused_in_one_line():
    """The formula is GPT-2's block's (a 4 · n_embd GELU MLP, q, k and v each n_embd wide): a Llama shape's bytes
    would be printed beside a formula that does not count them."""
    code, _, stderr = run_main("--bytes_only", "--", "--model", "llama-tiny")
    assert code == 2 and "the formula counts GPT-2's block" in stderr.splitlines()[-1] and "Traceback" not in stderr
