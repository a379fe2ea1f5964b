"""gpt/train.py --config FILE.toml (gpt/options.py): a file's options train what the same flags train, the command
line's winning; the options a run resolved, written to OUT_DIR/config.toml, run it again; the recipes in
gpt/recipes/ load and train at tiny sizes; a bad file is one line, nothing written."""
import tomllib

import pytest
from harness import torchrun_in_process
from test_gpt import REPO, import_gpt, strict_records, train

RECIPES = sorted((REPO / "gpt" / "recipes").glob("*.toml"))
# What makes any recipe tiny, on a CPU: the flags win over the file
TINY = ["--data", "synthetic", "--seq_len", "32", "--batch_size", "2", "--grad_accum", "1", "--max_steps", "2",
        "--warmup_steps", "1", "--val_tokens", "64", "--precision", "fp32", "--no-compile", "--log_every", "1"]


def trained(records: list[dict]) -> list[dict]:
    """What a run trained, of metrics.jsonl's records (not their times or memory)."""
    return [{k: r[k] for k in ("step", "loss", "lr", "grad_norm", "val_loss") if k in r} for r in records]


def test_a_config_file_trains_what_its_flags_train_and_the_written_one_runs_it_again(tmp_path):
    """llama-tiny for 6 steps from flags; from a file that says 99 steps and another lr, overridden on the
    command line; and from the config.toml that the second run wrote: the same records, to the bit (one
    process each)."""
    flags = ["--model", "llama-tiny", "--seq_len", "32", "--batch_size", "2", "--lr", "2e-3", "--max_steps", "6",
             "--log_every", "1", "--eval_every", "3", "--val_tokens", "128"]
    (tmp_path / "run.toml").write_text('model = "llama-tiny"\nseq_len = 32\nbatch_size = 2\nlr = 1e-2\n'
                                       'max_steps = 99\nlog_every = 1\neval_every = 3\nval_tokens = 128\n'
                                       'compile = false\n')
    by_flags = train(1, *flags)
    folder = tmp_path / "from_file"
    result = torchrun_in_process(1, "gpt/train.py", "--config", str(tmp_path / "run.toml"), "--max_steps", "6",
                                 "--lr", "2e-3", "--out_dir", "out", cwd=folder.mkdir() or folder, timeout=120)
    assert result.codes == [0], result.stderr
    by_file = strict_records(folder / "out" / "metrics.jsonl")
    assert trained(by_file) == trained(by_flags[0]) and [r["step"] for r in by_file if "loss" in r] == list(range(1, 7))
    written = (folder / "out" / "config.toml").read_text()
    assert "max_steps = 6\n" in written and "lr = 0.002\n" in written and 'model = "llama-tiny"\n' in written
    again = train(1, "--config", str(folder / "out" / "config.toml"))  # its out_dir "out" again, in a new folder
    assert trained(again[0]) == trained(by_flags[0])


@pytest.mark.parametrize(("text", "error"), [
    ("max_steps = 4\nmodel 'tiny'\n", "not TOML: Expected '=' after a key in a key/value pair (at line 2, column 7)"),
    ("max_step = 4\n", "'max_step' is not an option of train.py (did you mean 'max_steps'?)"),
    ("max_steps = '4'\n", 'max_steps = "4": max_steps takes an integer'),
    ("lr = true\n", "lr = true: lr takes a number"),
    ("compile = 1\n", "compile = 1: compile takes true or false"),
    ("parallel = 'fdsp'\n", 'parallel = "fdsp": parallel takes one of ddp, fsdp, hsdp'),
    ("[model]\nname = 'tiny'\n", 'model = {"name": "tiny"}: model takes a string'),
    ("config = 'other.toml'\n", "'config' is not an option of train.py"),
    (None, "No such file or directory"),
], ids=["not-toml", "unknown", "int", "float", "switch", "choice", "table", "config", "missing"])
def test_a_bad_config_file_is_one_line_naming_its_key_or_line(text, error, tmp_path, capsys, monkeypatch):
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr("sys.argv", ["train.py"])  # the parser's prog, as torchrun runs it
    with pytest.raises(SystemExit) as stopped:
        import_gpt().parse_args(["--config", str(path)])
    said = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and said == [f"train.py: error: --config {path}: {error}"], said


def test_what_a_file_may_hold_reads_back_as_given(tmp_path):
    """A value that starts with a dash, a path of any script, a switch off (tensorboard = false), and --config
    given twice (refused: which one would win is not obvious)."""
    gpt_train, options = import_gpt(), import_gpt("options")
    (tmp_path / "run.toml").write_text('out_dir = "-x ünï😀"\ntensorboard = false\nmax_steps = 3\n', encoding="utf-8")
    args = gpt_train.parse_args(["--config", str(tmp_path / "run.toml")])
    assert (args.out_dir, args.tensorboard, args.max_steps) == ("-x ünï😀", None, 3)
    options.save(args, gpt_train.parser(), str(tmp_path / "written.toml"))
    again = gpt_train.parse_args(["--config", str(tmp_path / "written.toml")])
    assert vars(again) == {**vars(args), "config": str(tmp_path / "written.toml")}
    with pytest.raises(SystemExit) as stopped:
        gpt_train.parse_args(["--config", str(tmp_path / "run.toml"), "--config", str(tmp_path / "written.toml")])
    assert stopped.value.code == 2


def test_a_bad_config_file_under_torchrun_writes_nothing(tmp_path):
    (tmp_path / "bad.toml").write_text("max_steps = 4.5\n")
    result = torchrun_in_process(2, "gpt/train.py", "--config", "bad.toml", cwd=tmp_path, timeout=60)
    assert result.codes == [2, 2] and result.stderr.strip() == \
        "train.py: error: --config bad.toml: max_steps = 4.5: max_steps takes an integer", result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["bad.toml"]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if "finetune" not in r.name], ids=lambda r: r.stem)
def test_each_recipe_trains_at_a_tiny_size(recipe):
    """Its options, all of them train.py's (or the parse fails), with TINY's over them and --model tiny: two
    steps. The fine-tunes' recipes run in tests/test_gpt_hf.py, from folders that transformers saves."""
    records, _, stdout = train(1, "--config", str(recipe), *TINY, "--model", "tiny")
    assert [r["step"] for r in records if "loss" in r] == [1, 2], stdout


def test_every_recipe_is_read_whole():
    """Each key of each recipe reaches train.py's options with its value."""
    gpt_train = import_gpt()
    for recipe in RECIPES:
        args = gpt_train.parse_args(["--config", str(recipe)])
        for key, value in tomllib.loads(recipe.read_text()).items():
            assert getattr(args, key) == value, (recipe.name, key)
