"""gpt/hf.py, Hugging Face's formats both ways: GPT-2's, and the Llama family's (LlamaForCausalLM,
Qwen3ForCausalLM). Out (hf.py export): a folder that transformers'
GPT2LMHeadModel.from_pretrained loads, whose logits are gpt/'s (fp32, within 1e-5) for a model trained under ddp
and one trained under fsdp 2 × tp 2 and read from its checkpoint folder; the head stays tied; a padded vocabulary
is kept or cut, and said; bad input is one line. In (train.py --init_from): a model that transformers itself
saved (random weights: no download), whose first step's loss is transformers' on the same batch, in one process
and under fsdp 2 and pp 2 (tp lays out the same whole values, as for --seed's); export then import gives the same
weights bit for bit; a folder that does not fit is one line and nothing is written. The same for a tiny Llama
(grouped-query, theta 500,000, Llama 3's scaling, an untied head, sharded into files with an index) and a tiny
Qwen3 (QK-norm, heads of their own size, theta 1e6, tied), trained under ddp and fsdp 2 × tp 2, read under one
process and fsdp 2 × tp 2."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from harness import torchrun_in_process
from launch import REPO
from test_errors import run_main
from test_gpt import text_file  # noqa: F401 (a fixture: the README and docs as one file)
from test_gpt_options import TINY
from test_gpt_sample import import_gpt
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, Qwen3Config

sys.path.insert(0, str(REPO))
from gpt.data import batch_starts, load, windows  # noqa: E402
from gpt.model import GPT, GPTConfig  # noqa: E402

ARGV = ("--max_steps", "4", "--save_every", "4", "--seq_len", "32", "--log_every", "4", "--eval_every", "4",
        "--val_tokens", "256", "--lr", "3e-3")


def export(*argv: str) -> str:
    """`python gpt/hf.py export argv`'s line (its main() run here), after checking that it exited 0."""
    code, stdout, stderr = run_main(import_gpt("hf"), "export", *argv)
    assert code == 0 and not stderr, stderr
    return stdout


def logits(model: GPT | GPT2LMHeadModel, vocab: int, seq_len: int) -> torch.Tensor:
    ids = torch.randint(vocab, (3, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.eval()(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def assert_same_model(folder: Path, ours: GPT) -> GPT2LMHeadModel:
    theirs = AutoModelForCausalLM.from_pretrained(folder)
    tied = theirs.lm_head.weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr()
    assert tied == ours.config.tie_head and type(theirs).__name__ == KINDS[ours.config.family, ours.config.qk_norm]
    c = ours.config
    expected = logits(ours, c.vocab_size, c.seq_len)
    assert expected.abs().max() > 0.1  # a model that says something, not zeros
    torch.testing.assert_close(logits(theirs, c.vocab_size, c.seq_len), expected, rtol=0, atol=1e-5)
    return theirs


KINDS = {("gpt2", False): "GPT2LMHeadModel", ("llama", False): "LlamaForCausalLM", ("llama", True): "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """{layout: folder} of 4-step runs, each with OUT_DIR (out/) and its --export (model.pt)."""
    folders = {}
    for name, nproc, layout in (("ddp 2", 2, ("--batch_size", "2", "--grad_accum", "3")),
                                ("fsdp 2 × tp 2", 4, ("--parallel", "fsdp", "--tp", "2", "--batch_size", "6")),
                                ("llama ddp 2", 2, ("--batch_size", "2", "--grad_accum", "3", "--model", "llama-tiny")),
                                ("qwen3 fsdp 2 × tp 2", 4, ("--parallel", "fsdp", "--tp", "2", "--batch_size", "6",
                                                            "--model", "qwen3-tiny"))):
        folder = folders[name] = tmp_path_factory.mktemp("run")
        result = torchrun_in_process(nproc, "gpt/train.py", *ARGV, *layout, "--out_dir", "out", "--export",
                                     "model.pt", cwd=folder, timeout=120)
        assert result.codes == [0] * nproc, result.stderr
    return folders


@pytest.mark.parametrize("layout", ["ddp 2", "fsdp 2 × tp 2", "llama ddp 2", "qwen3 fsdp 2 × tp 2"])
def test_transformers_computes_the_logits_of_the_exported_model(layout, trained, tmp_path):
    """From the --export file, and from the checkpoint folder that the same run saved at its last step (DCP's
    shards, read whole in one process): the same file, and transformers' logits within 1e-5 of GPT.load's."""
    folder = trained[layout]
    said = export(str(folder / "model.pt"), str(tmp_path / "from_file"))
    ours = GPT.load(str(folder / "model.pt"))
    kind = KINDS[ours.config.family, ours.config.qk_norm]
    assert said == f"wrote {tmp_path / 'from_file'} from {folder / 'model.pt'}: {kind}, 2 layers, vocab 64\n"
    assert kind == {"l": "LlamaForCausalLM", "q": "Qwen3ForCausalLM"}.get(layout[0], "GPT2LMHeadModel")
    assert_same_model(tmp_path / "from_file", ours)
    assert f"from {folder / 'out' / 'step_00000004'}:" in export(str(folder / "out"), str(tmp_path / "from_out"))
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "from_out" / name).read_bytes() == (tmp_path / "from_file" / name).read_bytes(), name


def test_a_padded_vocabulary_is_kept_and_said_or_cut_to_gpt2s(tmp_path):
    """GPT-2's 50257 ids padded to 50304 (a multiple of 64, as train.py pads them): kept, with a word on it; with
    --vocab_size 50257, the rows that no token uses cut, and the logits of the others unchanged."""
    config = GPTConfig(vocab_size=50304, seq_len=16, n_layer=1, n_head=2, n_embd=32)
    model = GPT(config)
    model.init_weights(seed=0)
    import_gpt("model").export(str(tmp_path / "model.pt"), config, model.state_dict())
    said = export(str(tmp_path / "model.pt"), str(tmp_path / "kept"))
    assert "vocab 50304 (GPT-2's 50257 padded: no token's id is 50257 or more; --vocab_size 50257 cuts)" in said
    assert_same_model(tmp_path / "kept", model)
    said = export(str(tmp_path / "model.pt"), str(tmp_path / "cut"), "--vocab_size", "50257")
    assert "vocab 50257 (the first 50257 of the model's 50304 rows)" in said
    config_json = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert config_json["vocab_size"] == 50257 and config_json["eos_token_id"] == 50256
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "cut").eval()
    torch.testing.assert_close(logits(theirs, 50257, 16), logits(model, 50257, 16)[..., :50257], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("argv", "error"), [
    (["no/such.pt", "{dest}"], "error: no/such.pt: No such file or directory"),
    (["{text}", "{dest}"], "error: {text}: not a model or checkpoint written by gpt/train.py (UnpicklingError)"),
    (["{empty}", "{dest}"], "error: {empty}: neither a train.py --export file, nor a checkpoint folder (with its "
                            "manifest.json), nor an OUT_DIR that holds one"),
    (["{model}", "{dest}", "--vocab_size", "65"], "error: {model}: --vocab_size 65: the model's vocab is 64"),
], ids=["missing", "not a model", "no checkpoint", "vocab too large"])
def test_bad_input_is_one_line_and_writes_nothing(argv, error, trained, tmp_path):
    names = {"dest": tmp_path / "hf", "text": REPO / "README.md", "empty": tmp_path,
             "model": trained["ddp 2"] / "model.pt"}
    code, stdout, stderr = run_main(import_gpt("hf"), "export", *(a.format(**names) for a in argv))
    assert code == 1 and stderr == error.format(**names) + "\n" and not stdout, stderr
    assert not (tmp_path / "hf").exists()


def test_without_safetensors_it_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` fails, as where it is not installed
    code, _, stderr = run_main(import_gpt("hf"), "export", "model.pt", str(tmp_path / "hf"))
    assert code == 2 and stderr.splitlines()[-1] == "hf.py: error: hf.py needs safetensors: pip install -r " \
                                                    "requirements-hf.txt", stderr


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> Path:
    """A GPT-2 of --model tiny's shape over bytes (vocab 256, 64 positions), random weights (the embedding 25
    times GPT-2's scale), saved by transformers; beside it, the same as pytorch_model.bin (as older folders,
    GPT-2's own among them, hold)."""
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(25)  # logits far from uniform: a loss that no fresh gpt/ model has
    model.save_pretrained(folder)
    (folder.parent / "bin").mkdir()
    shutil.copy(folder / "config.json", folder.parent / "bin")
    torch.save(model.state_dict(), folder.parent / "bin" / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict[str, Path]:
    """{"llama": a LlamaForCausalLM (4 q heads on 2 k and v heads, theta 500,000, Llama 3's scaling from 16 original
    positions, an untied head), "qwen3": a Qwen3ForCausalLM (QK-norm, heads of 32 on a width of 64, theta 1e6, a
    tied head)}: over bytes (vocab 256), random weights, saved by transformers (the embedding and the head, untied,
    25 times its scale); the Llama in shards of at most 200 KB with their index (model.safetensors.index.json)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    configs = {"llama": LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})}
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(25)  # logits far from uniform: the head's too, where untied
            if not config.tie_word_embeddings:
                model.get_output_embeddings().weight.mul_(25)
            for param in model.parameters():  # the norms' gains off 1, so that a norm left out shows
                if param.ndim == 1:
                    param.add_(torch.rand_like(param) - 0.5)
        folders[name] = tmp_path_factory.mktemp("hf") / name
        model.save_pretrained(folders[name], **({"max_shard_size": "200KB"} if name == "llama" else {}))
    assert (folders["llama"] / "model.safetensors.index.json").exists()
    return folders


def first_loss(nproc: int, folder: Path, text_file: Path, tmp_path: Path, *layout: str) -> float:  # noqa: F811
    """Step 1's logged loss (before its update) from --init_from FOLDER, after checking that it is transformers'
    cross-entropy over the same 8 windows (data.batch_starts, a function of the seed and the step alone), to
    fp32's rounding."""
    result = torchrun_in_process(nproc, "gpt/train.py", "--data", str(text_file), "--init_from", str(folder),
                                 "--seq_len", "32", "--max_steps", "1", "--log_every", "1", "--eval_every", "100",
                                 *layout, "--out_dir", "out", cwd=tmp_path, timeout=120)
    assert result.codes == [0] * nproc, result.stderr
    assert f"| weights from {folder}" in result.stdouts[0]
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    tokens = load(str(text_file), None, None)
    x, y = windows(tokens.train, batch_starts(0, 0, len(tokens.train), 32, 8), 32, torch.device("cpu"))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(folder).eval()(x).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert logged == pytest.approx(expected, rel=1e-5, abs=0)
    return logged


@pytest.mark.parametrize(("family", "nproc", "layout"), [
    ("llama", 1, ("--batch_size", "4", "--grad_accum", "2")), ("qwen3", 1, ("--batch_size", "4", "--grad_accum", "2")),
    ("qwen3", 4, ("--parallel", "fsdp", "--tp", "2", "--batch_size", "2", "--grad_accum", "2")),
    ("llama", 2, ("--parallel", "fsdp", "--pp", "2", "--batch_size", "4", "--grad_accum", "2")),
    ("qwen3", 2, ("--parallel", "fsdp", "--pp", "2", "--batch_size", "4", "--grad_accum", "2"))],
    ids=["llama-one process", "qwen3-one process", "qwen3-fsdp 2 × tp 2", "llama-pp 2", "qwen3-pp 2"])
def test_the_first_loss_from_a_llama_or_qwen3_is_transformers_loss(family, nproc, layout, llamas, text_file,  # noqa: F811
                                                                    tmp_path):
    """The shape from the folder's config.json (no --model): transformers' loss, and far from a fresh model's. tp
    with Qwen3 alone (its QK-norm over the heads a tp rank holds; Llama's tp is the same code less the norm)."""
    assert first_loss(nproc, llamas[family], text_file, tmp_path, *layout) > 6.5  # a fresh one's: about ln 256 = 5.5


@pytest.mark.parametrize(("nproc", "layout"), [
    (1, ("--batch_size", "4", "--grad_accum", "2")),
    (2, ("--parallel", "fsdp", "--batch_size", "2", "--grad_accum", "2")),
    (2, ("--parallel", "fsdp", "--pp", "2", "--batch_size", "4", "--grad_accum", "2"))],
    ids=["one process", "fsdp 2", "pp 2"])
def test_the_first_loss_from_a_transformers_model_is_transformers_loss(nproc, layout, theirs, text_file,  # noqa: F811
                                                                        tmp_path):
    """Step 1's logged loss (before its update): transformers' on the same batch (first_loss)."""
    assert first_loss(nproc, theirs, text_file, tmp_path, *layout) > 7  # a fresh gpt/ model's: about ln 256 = 5.545


@pytest.mark.parametrize("recipe", ["finetune-gpt2", "finetune-llama-1b", "finetune-qwen3-0.6b"])
def test_each_fine_tunes_recipe_trains_from_its_folder_at_a_tiny_size(recipe, theirs, llamas, text_file,  # noqa: F811
                                                                      tmp_path):
    """gpt/recipes/RECIPE.toml with the tests' folder of its family (transformers' tiny GPT-2, Llama, Qwen3), the
    text file for data, and tests/test_gpt_options.py's tiny sizes over it: two steps from the folder's weights."""
    folder = {"finetune-gpt2": theirs, "finetune-llama-1b": llamas["llama"], "finetune-qwen3-0.6b": llamas["qwen3"]}
    result = torchrun_in_process(1, "gpt/train.py", "--config", str(REPO / "gpt" / "recipes" / f"{recipe}.toml"),
                                 *TINY, "--data", str(text_file), "--vocab_size", "256", "--init_from",
                                 str(folder[recipe]), "--out_dir", "out", cwd=tmp_path, timeout=120)
    assert result.codes == [0] and f"| weights from {folder[recipe]}" in result.stdouts[0], result.stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line] == [1, 2]


def test_a_fine_tune_from_transformers_resumes_and_reshards_like_any_run(theirs, text_file, tmp_path):  # noqa: F811
    """--init_from under fsdp 2 for 4 steps, a checkpoint at each 2; its step 2 resumed with the same command under
    ddp on 1 rank (DCP reshards): the checkpoint's weights, not the folder's again (the log says it resumed, and
    says no weights from the folder), and every later step's loss within 1e-5 of the uninterrupted run's (a sum
    split otherwise, rounded otherwise)."""
    argv = ("--data", str(text_file), "--init_from", str(theirs), "--seq_len", "32", "--max_steps", "4",
            "--save_every", "2", "--log_every", "1", "--eval_every", "100", "--batch_size", "4", "--grad_accum", "2",
            "--out_dir", "out")
    whole = torchrun_in_process(2, "gpt/train.py", *argv, "--parallel", "fsdp", "--batch_size", "2", cwd=tmp_path,
                                timeout=120)
    assert whole.codes == [0, 0], whole.stderr
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "out" / "step_00000002", tmp_path / "resumed" / "out" / "step_00000002")
    resumed = torchrun_in_process(1, "gpt/train.py", *argv, cwd=tmp_path / "resumed", timeout=120)
    assert resumed.codes == [0], resumed.stderr
    assert "resuming from out/step_00000002: step 2 of 4" in resumed.stdouts[0]
    assert "| weights from" not in resumed.stdouts[0] and f"| weights from {theirs}" in whole.stdouts[0]
    losses = [[json.loads(line)["loss"] for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line] for folder in (tmp_path, tmp_path / "resumed")]
    assert len(losses[0]) == 4 and len(losses[1]) == 2
    assert losses[1] == pytest.approx(losses[0][2:], rel=1e-5, abs=0)


def test_export_then_import_gives_back_the_same_weights_bit_for_bit(trained, theirs, tmp_path):
    """gpt/ to transformers and back (the ddp run's model); and a folder of pytorch_model.bin reads as its
    safetensors twin does."""
    hf = import_gpt("hf")
    export(str(trained["ddp 2"] / "model.pt"), str(tmp_path / "hf"))
    ours = GPT.load(str(trained["ddp 2"] / "model.pt"))
    back = hf.from_hf(str(tmp_path / "hf"), ours.config)
    assert back.keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back[name], tensor), name
    config = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64)
    safetensors, pickled = hf.from_hf(str(theirs), config), hf.from_hf(str(theirs.parent / "bin"), config)
    assert all(torch.equal(safetensors[name], pickled[name]) for name in safetensors)


@pytest.mark.parametrize("layout", ["llama ddp 2", "qwen3 fsdp 2 × tp 2"])
def test_a_llama_or_qwen3_goes_out_and_back_bit_for_bit(layout, trained, llamas, tmp_path):
    """gpt/ to transformers and back (a trained model); and transformers' own folder to gpt/ and back out: the
    same tensors under the same names (the Llama's shards written as one file)."""
    hf = import_gpt("hf")
    export(str(trained[layout] / "model.pt"), str(tmp_path / "hf"))
    ours = GPT.load(str(trained[layout] / "model.pt"))
    back = hf.from_hf(str(tmp_path / "hf"), ours.config)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in ours.state_dict().items())
    folder = llamas[layout.split()[0]]
    config = import_gpt("model").GPTConfig(256, 32, **hf.shape(str(folder)))
    out = hf.to_hf(hf.from_hf(str(folder), config), config)
    theirs = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    if config.tie_head:
        del theirs["lm_head.weight"]  # the embedding's matrix: written once
    assert out.keys() == theirs.keys() and all(torch.equal(out[name], theirs[name]) for name in out)


@pytest.mark.parametrize(("family", "change", "argv", "error"), [
    ("llama", {"attention_bias": True}, [], "a llama model with attention_bias (config.json), which gpt/ lacks"),
    ("llama", {"hidden_act": "gelu"}, [], "a llama model with hidden_act 'gelu' (config.json), which gpt/ lacks"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, [],
     "a llama model with rope_type 'yarn' (config.json), which gpt/ lacks"),
    ("qwen3", {"use_sliding_window": True}, [], "a qwen3 model with sliding-window attention (config.json), which "
                                                "gpt/ lacks"),
    ("llama", {"model_type": "mistral"}, [], "a 'mistral' model (config.json): gpt/ reads gpt2, llama, qwen3 and "
                                             "qwen3_moe"),
    ("llama", {}, ["--model", "llama-mini"], "its n_layer is 2, --model llama-mini's 4"),
    ("qwen3", {}, ["--model", "llama-tiny"], "its head_dim is 32, --model llama-tiny's 16"),
    ("llama", {"vocab_size": 300}, [], "its vocab is 300, and the run's 256 (the data's: --vocab_size, for a folder "
                                       "of shards)"),
    ("llama", {"num_hidden_layers": "2"}, [], "its config.json's num_hidden_layers is '2', not an integer above 0"),
    ("llama", {"tie_word_embeddings": "false"}, [], "its config.json's tie_word_embeddings is 'false', not true or "
                                                    "false"),
    ("llama", {"rope_parameters": "abc"}, [], "a llama model with rope_parameters 'abc' (config.json), which gpt/ "
                                              "lacks"),
    ("qwen3", {"num_key_value_heads": 0}, [], "its config.json's num_key_value_heads is 0, not an integer above 0"),
    ("llama", "drop a shard", [], "its index names model-00001-of-00003.safetensors, which is not there"),
    ("qwen3", "cut the file", [], "model.safetensors is not a safetensors file of float weights that can be read"),
    ("qwen3", "drop q_norm", [], "its weights lack model.layers.0.self_attn.q_norm.weight"),
    ("qwen3", "int8 up_proj", [], "model.safetensors is not a safetensors file of float weights that can be read "
                                  "(model.layers.0.mlp.up_proj.weight is I8, not floats (quantized?))"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, [], "a quantized model (config.json's "
                                                                    "quantization_config): gpt/ reads float weights"),
    ("qwen3", {"intermediate_size": 128}, [], "model.layers.0.mlp.gate_proj.weight is (160, 64), where its "
                                              "config.json makes it (128, 64)"),
    ("llama", {"head_dim": 15}, [], "head_dim 15 is odd"),
], ids=["bias", "gelu", "yarn", "sliding", "mistral", "model-layers", "model-heads", "vocab", "text-int", "text-bool",
        "rope-text", "zero-kv", "no-shard", "cut", "no-q-norm", "int8", "fp8", "shape", "odd-head"])
def test_a_llama_folder_that_gpt_does_not_hold_is_one_line_and_nothing_is_written(family, change, argv, error,
                                                                                   llamas, text_file,  # noqa: F811
                                                                                   tmp_path):
    """Each found before OUT_DIR is made: config.json's fields and types (transformers refuses the same), and the
    weights' files from their headers (a shard missing, a file cut short, a weight missing)."""
    folder = tmp_path / "hf"
    shutil.copytree(llamas[family], folder)
    if change == "drop a shard":
        (folder / "model-00001-of-00003.safetensors").unlink()
    elif change == "cut the file":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    elif change in ("drop q_norm", "int8 up_proj"):
        from safetensors.torch import load_file, save_file
        weights = load_file(folder / "model.safetensors")
        if change == "drop q_norm":
            del weights["model.layers.0.self_attn.q_norm.weight"]
        else:
            weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
        save_file(weights, folder / "model.safetensors")
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
    result = torchrun_in_process(1, "gpt/train.py", "--data", str(text_file), "--init_from", str(folder), *argv,
                                 "--seq_len", "32", "--max_steps", "1", "--out_dir", "out", cwd=tmp_path, timeout=60)
    assert result.codes == [1] and result.stderr.strip().startswith(f"error: --init_from {folder}: {error}"), \
        result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_an_export_into_a_folder_of_other_weights_is_refused(trained, llamas, tmp_path):
    """A folder holding a sharded model (its index, its shards): the export would sit beside them, transformers
    reading the new file and an older reader the old shards; refused in one line, nothing written."""
    shutil.copytree(llamas["llama"], tmp_path / "dest")
    before = {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()}
    code, stdout, stderr = run_main(import_gpt("hf"), "export", str(trained["llama ddp 2"] / "model.pt"),
                                    str(tmp_path / "dest"))
    assert code == 1 and stderr == (f"error: {trained['llama ddp 2'] / 'model.pt'}: {tmp_path / 'dest'} holds another "
                                    "model's files (generation_config.json): give an empty folder, or remove "
                                    "them\n"), stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == before


def test_a_padded_run_starts_with_padding_rows_that_take_no_mass(theirs):
    """--vocab_size 320 over a model of 256: rows 256 to 319 are the mean of the others, the first 256 theirs."""
    state = import_gpt("hf").from_hf(str(theirs), GPTConfig(vocab_size=320, seq_len=32, n_layer=2, n_head=2,
                                                            n_embd=64))
    wte = GPT2LMHeadModel.from_pretrained(theirs).transformer.wte.weight.detach()
    assert torch.equal(state["wte.weight"][:256], wte)
    assert torch.equal(state["wte.weight"][256:], wte.mean(0, keepdim=True).expand(64, -1))


@pytest.mark.parametrize(("change", "error"), [
    ({"model_type": "bert"}, "a 'bert' model (config.json): gpt/ reads gpt2, llama, qwen3 and qwen3_moe"),
    ({"n_layer": 3}, "its n_layer is 3, --model tiny's 2"),
    ({"vocab_size": 300}, "64 positions and vocab 300, where the run needs 32 positions or more (--seq_len) and a "
                          "vocab of 256 or less"),
    ({"activation_function": "relu"}, "a gpt2 model with another activation or an untied head (config.json), which "
                                      "gpt/ lacks"),
    ({"scale_attn_by_inverse_layer_idx": True}, "a gpt2 model with scale_attn_by_inverse_layer_idx True "
                                                "(config.json), which gpt/ lacks"),
    (None, "No such file or directory: not a Hugging Face model folder"),
    ("no weights", "neither model.safetensors nor pytorch_model.bin"),
], ids=["bert", "layers", "vocab", "relu", "layer-scaled", "no folder", "no weights"])
def test_a_folder_that_does_not_fit_is_one_line_and_nothing_is_written(change, error, theirs, text_file,  # noqa: F811
                                                                        tmp_path):
    folder = tmp_path / "hf"
    if change is not None:
        folder.mkdir()
        config = json.loads((theirs / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **(change if isinstance(change, dict) else {})}))
        if change != "no weights":
            shutil.copy(theirs / "model.safetensors", folder)
    result = torchrun_in_process(1, "gpt/train.py", "--data", str(text_file), "--init_from", str(folder), "--model",
                                 "tiny", "--seq_len", "32", "--max_steps", "1", "--out_dir", "out", cwd=tmp_path,
                                 timeout=60)
    assert result.codes == [1] and result.stderr.strip() == f"error: --init_from {folder}: {error}", result.stderr
    assert not (tmp_path / "out").exists()
