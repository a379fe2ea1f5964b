"""gpt/bench_moe.py: its dense model has moe-tiny's active parameters (the routers' aside), and its product
benchmark runs both ways."""
import contextlib
import io

from test_gpt_sample import import_gpt

from gpt.model import CONFIGS, GPT, GPTConfig

bench_moe = import_gpt("bench_moe")


def test_the_dense_model_has_the_active_parameters_of_moe_tiny():
    moe, dense = (GPT(GPTConfig(64, 128, **config)) for config in (CONFIGS["moe-tiny"], bench_moe.DENSE))
    routers = sum(layer.router.weight.numel() for layer in moe.moe_layers())
    assert dense.flops_per_token() == moe.flops_per_token() - 6 * routers


def test_the_product_benchmark_times_both_ways():
    with contextlib.redirect_stdout(io.StringIO()) as out:
        bench_moe.products(64, 4, 16, 8, repeats=1)
    assert [line.split()[4] for line in out.getvalue().splitlines()] == ["grouped", "loop"]
