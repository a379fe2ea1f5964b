"""zero_by_hand.py: each ZeRO stage trains what singlenode_cpu.py trains, each rank holds the bytes of its
slices and no more, and the classes on their own train what one process trains, in a loop of the test's own."""
import re
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ARGV
from harness import spawn
from test_train import TOLERANCE
from torch import nn
from workers import train_script, train_scripts

import ddp_by_hand
import zero_by_hand
from model import build_model

BYTES_LINE = re.compile(r"^\[rank (\d+)/(\d+)\] stage (\d) bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                        r"optimizer state ([\d,]+)$", re.MULTILINE)
STEPS, BATCH = 3, 4  # per rank
HOWS = ("same batch", "stage 1", "stage 2", "stage 2 accumulated", "stage 3")
OPTIMIZERS = {"SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def toy_model(seed: int) -> nn.Sequential:
    """A layer called twice, a weight tied across two layers, and a frozen bias; sizes no rank count divides."""
    torch.manual_seed(seed)
    a, b, c, d = nn.Linear(5, 5), nn.Linear(5, 7), nn.Linear(7, 5), nn.Linear(5, 5)
    d.weight = a.weight
    b.bias.requires_grad_(False)
    return nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), c, nn.Tanh(), d, nn.Tanh(), a)


def batches(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, world_size × BATCH, 5): rank r takes rows r × BATCH to (r + 1) × BATCH of each."""
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS, world_size * BATCH, 5, generator=generator),
            torch.randn(STEPS, world_size * BATCH, 5, generator=generator))


def forward(model: nn.Sequential, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The toy model's forward; with dtype, as FSDP's compute_dtype does: each layer call casts its fp32
    weights, so a weight's gradients from its several calls are cast to fp32 before they are added."""
    if dtype is None:
        return model(x)
    for layer in model:
        x = F.linear(x, layer.weight.to(dtype), layer.bias.to(dtype)) if isinstance(layer, nn.Linear) else layer(x)
    return x.float()


def one_process(name: str, world_size: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The toy model trained in this process on the global batch. With dtype, as FSDP's compute_dtype does:
    each rank's share computed in that dtype, its fp32 gradient divided by the ranks and summed."""
    model, (xs, ys) = toy_model(0), batches(world_size)
    optimizer_cls, kwargs = OPTIMIZERS[name]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(params, **kwargs)
    for x, y in zip(xs, ys, strict=True):
        shares = [slice(0, len(x))] if dtype is None else [slice(r * BATCH, (r + 1) * BATCH) for r in range(world_size)]
        grads = [torch.zeros_like(p) for p in params]
        for share in shares:
            model.zero_grad()
            F.mse_loss(forward(model, x[share].to(dtype or x.dtype), dtype), y[share]).backward()
            grads = [g + p.grad / len(shares) for g, p in zip(grads, params, strict=True)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}  # tied: both names


def count(names: list[str], fn) -> dict[str, int]:
    """Run fn() and return how many times each of zero_by_hand's collectives in `names` started."""
    counts, originals = dict.fromkeys(names, 0), {n: getattr(dist, n) for n in names}

    def counting(name):
        def collective(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return collective

    for name in names:
        setattr(zero_by_hand.dist, name, counting(name))
    try:
        fn()
    finally:
        for name in names:
            setattr(zero_by_hand.dist, name, originals[name])
    return counts


def train_classes(rank: int, world_size: int, name: str, how: str, dtype=None) -> dict[str, torch.Tensor]:
    """The toy model, seeded differently on every rank, trained on this rank's share of each global batch."""
    model, (xs, ys) = toy_model(rank), batches(world_size)
    optimizer_cls, kwargs = OPTIMIZERS[name]
    share = slice(0, world_size * BATCH) if how == "same batch" else slice(rank * BATCH, (rank + 1) * BATCH)
    if how == "stage 1":
        model = ddp_by_hand.DDP(model)  # whole gradients, averaged in buckets
    for p in model.parameters() if how in ("same batch", "stage 2", "stage 2 accumulated") else []:
        if not p.requires_grad:  # ShardedOptimizer broadcasts the parameters it is given; the frozen one is not
            dist.broadcast(p.detach(), src=0)
    if how == "stage 3":
        model = zero_by_hand.FSDP(model, dtype)
        optimizer = optimizer_cls(model.parameters(), **kwargs)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = zero_by_hand.ShardedOptimizer(params, optimizer_cls, reduce_scatter=how.startswith("stage 2"),
                                                  **kwargs)
    for x, y in zip(xs, ys, strict=True):
        optimizer.zero_grad()
        if how == "stage 2 accumulated":  # two micro-batches: the first's gradients wait in the open bucket
            for half in (slice(share.start, share.start + BATCH // 2), slice(share.start + BATCH // 2, share.stop)):
                (F.mse_loss(model(x[half]), y[half]) / 2).backward()
        else:
            F.mse_loss(model(x[share]), y[share]).backward()
        getattr(model, "finish_gradient_synchronization", lambda: None)()
        optimizer.step()
    if how == "stage 3":
        return model.gather_full_params()
    return {n: p.detach() for n, p in getattr(model, "module", model).named_parameters(remove_duplicate=False)}


def fsdp_step_facts(rank: int, world_size: int) -> dict:
    """One FSDP step of the toy model: the collectives of its forward and of its backward, and how many of
    the whole weights they gathered are still alive after each."""
    model, gathered = zero_by_hand.FSDP(toy_model(0)), []
    original = zero_by_hand.gather

    def gather(shard, shape):
        gathered.append(weakref.ref(whole := original(shard, shape)))
        return whole

    def alive() -> int:
        return sum(ref() is not None for ref in gathered)

    facts, zero_by_hand.gather = {}, gather
    try:
        loss = model(torch.randn(BATCH, 5))
        facts["after forward"] = alive()
        facts["backward"] = count(["all_gather_single", "reduce_scatter_single"],
                                  lambda: loss.square().mean().backward())
        facts["after backward"] = alive()
    finally:
        zero_by_hand.gather = original
    model.finish_gradient_synchronization()
    for bucket_mb in (25, 1e-5):  # all in one bucket; a bucket per tensor (each has more than 10 bytes)
        optimizer = zero_by_hand.ShardedOptimizer([p for p in toy_model(0).parameters() if p.requires_grad],
                                                  torch.optim.SGD, reduce_scatter=True, bucket_mb=bucket_mb, lr=0.1)
        facts["stage 2", bucket_mb] = count(["reduce_scatter_single", "all_gather_single"],
                                            lambda o=optimizer: (sum(p.sum() for p in o.params).backward(), o.step()))
    facts["forward"] = count(["all_gather_single"], lambda: model(torch.randn(BATCH, 5)))
    facts["whole"] = list(model.gather_full_params())
    saved = optimizer.state_dict()  # the last stage-2 optimizer, SGD at lr 0.1
    saved["param_groups"][0]["lr"] = 0.01  # as a scheduler would have left it
    optimizer.load_state_dict(saved)
    optimizer.step()  # the step passes the outer groups' lr on to the wrapped optimizer
    facts["lr after load"] = optimizer.param_groups[0]["lr"], optimizer.inner.param_groups[0]["lr"]
    return facts | {"gathered": len(gathered), "shards": [p.numel() for p in model.parameters()]}


def everything(rank: int, world_size: int, folder: str) -> dict:
    results = {"scripts": train_scripts(rank, world_size, [("zero_by_hand", [*ARGV, "--stage", str(stage)])
                                                           for stage in (1, 2, 3)])}
    # Two epochs at stage 3, the third resumed at stage 1 from the same file: whole tensors, any stage.
    argv = [*ARGV, "--checkpoint", f"{folder}/ckpt.pt"]
    train_script(rank, world_size, "zero_by_hand", [*argv, "--stage", "3", "--max_epochs", "2"])
    dist.barrier()  # rank 0 has written the file: two launches in a row, here in one process group
    results["resumed"] = train_script(rank, world_size, "zero_by_hand", [*argv, "--stage", "1"])
    results["checkpoint"] = torch.load(f"{folder}/ckpt.pt", weights_only=True) if rank == 0 else None
    for name in OPTIMIZERS:
        for how in HOWS:
            results[name, how] = train_classes(rank, world_size, name, how)
        results[name, "stage 3 fp16"] = train_classes(rank, world_size, name, "stage 3", torch.float16)
    return results | {"facts": fsdp_step_facts(rank, world_size)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[list[dict], list[str]]]:
    return {n: spawn(everything, n, str(tmp_path_factory.mktemp(f"zero{n}")), timeout=120) for n in (2, 3, 4)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_trains_what_singlenode_cpu_trains(runs, ddp_runs, world_size, stage):
    """Bit for bit at 2 ranks (a sum of two numbers has one order). At 3, to 1e-6: gloo's reduce-scatter and
    per-tensor all-reduces add the three ranks' values in another order than DDP's bucketed all-reduce."""
    results, _ = runs[world_size]
    reference, _ = ddp_runs[world_size]
    for rank in range(world_size):
        mine = results[rank]["scripts"][stage - 1]
        for name, tensor in reference[0].items():
            if world_size == 2:
                assert torch.equal(mine[name], tensor), name
            torch.testing.assert_close(mine[name], tensor, **TOLERANCE, msg=name)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_checkpoint_of_stage_3_resumes_at_stage_1_in_singlenode_cpus_form(runs, world_size):
    """The checkpoint holds the whole model and the whole Adam state, as singlenode_cpu.py's does: a plain
    model and a plain Adam load it. Resumed at another stage, training ends where the run without a stop
    ends (to 1e-6, bit for bit at 2 ranks, as the stages do)."""
    results, stdouts = runs[world_size]
    checkpoint = results[0]["checkpoint"]
    assert checkpoint.keys() == {"model", "optimizer", "epoch"} and checkpoint["epoch"] == 3
    model = build_model()
    model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    for p in model.parameters():
        assert optimizer.state[p]["exp_avg"].shape == p.shape
    assert "resuming from" in stdouts[0] and "2 of 3 epochs done" in stdouts[0]
    for rank in range(world_size):
        for name, tensor in results[rank]["scripts"][0].items():
            if world_size == 2:
                assert torch.equal(results[rank]["resumed"][name], tensor), name
            torch.testing.assert_close(results[rank]["resumed"][name], tensor, **TOLERANCE, msg=name)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_holds_the_bytes_of_its_slices(runs, world_size):
    """Each parameter padded to a multiple of the ranks, one slice each: the small model's 320 + 16 + 16 + 1
    parameters give every rank S = Σ ceil(n / N) floats. Stage 1: whole parameters and gradients; optimizer
    state the fp32 slices, Adam's two moments of them, and a step count per tensor. Stage 2: gradients S.
    Stage 3: parameters S too, and the slices are the optimizer's own parameters."""
    _, stdouts = runs[world_size]
    whole = sum(p.numel() for p in build_model().parameters())
    sliced = sum(-(-p.numel() // world_size) for p in build_model().parameters())
    tensors = len(list(build_model().parameters()))
    expected = {1: (whole, whole, 3 * sliced + tensors), 2: (whole, sliced, 3 * sliced + tensors),
                3: (sliced, sliced, 2 * sliced + tensors)}
    for rank, out in enumerate(stdouts):
        lines = BYTES_LINE.findall(out)
        assert [int(m[2]) for m in lines] == [1, 2, 3, 3, 1]  # the stages, then the stop and the resume
        for line in lines:
            assert (int(line[0]), int(line[1])) == (rank, world_size)
            assert tuple(int(n.replace(",", "")) for n in line[3:]) == tuple(4 * n for n in expected[int(line[2])])


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_classes_train_what_one_process_trains(runs, world_size, how, name):
    """With SGD (momentum, weight decay) and AdamW, a tied weight and a frozen bias, ranks seeded differently:
    ShardedOptimizer with every rank on the global batch and no gradient averaging (each rank updates its
    slices only), with the hand-written DDP (stage 1) and reduce-scattering (stage 2), and FSDP (stage 3),
    each on its share of the global batch, end where one process ends with the global batch, to 1e-6
    (N means averaged where one process takes one mean)."""
    results, _ = runs[world_size]
    expected = one_process(name, world_size)
    for rank in range(world_size):
        mine = results[rank][name, how]
        assert mine.keys() == expected.keys()
        for key, tensor in expected.items():
            torch.testing.assert_close(mine[key], tensor, **TOLERANCE, msg=key)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp_in_fp16_trains_what_one_process_casting_the_same_way_trains(runs, world_size, name):
    """compute_dtype=float16: the weights cast before the gather, forward and backward in fp16, the slices,
    their gradients and the optimizer's state fp32. One process casting the same way ends within 1e-6; one
    in fp32 differs by more than ten times that (else the test would pass with compute_dtype ignored)."""
    results, _ = runs[world_size]
    expected, fp32 = one_process(name, world_size, torch.float16), one_process(name, world_size)
    for rank in range(world_size):
        mine = results[rank][name, "stage 3 fp16"]
        for key, tensor in expected.items():
            torch.testing.assert_close(mine[key], tensor, **TOLERANCE, msg=key)
        assert any((mine[k] - t).abs().max() > 10 * TOLERANCE["atol"] for k, t in fp32.items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_gathers_each_layer_twice_and_frees_it(runs, world_size):
    """One step of the toy model, 5 layer calls of 2 weights each (the tied weight is gathered at each of
    its 3 calls, the frozen bias is sharded too). Forward: an all-gather per weight per call. Backward: one
    per weight that autograd saved (a Linear keeps its weight to compute its input's gradient: every call
    but the first, whose input needs none), and a reduce-scatter per trainable weight per call. No gathered
    weight outlives the forward or the backward that used it. Stage 2: a reduce-scatter per bucket
    in backward (one, or one per tensor with buckets of 10 bytes), one all-gather of every slice in the step."""
    results, _ = runs[world_size]
    facts = results[0]["facts"]
    assert facts["forward"] == {"all_gather_single": 5 * 2}
    assert facts["backward"] == {"all_gather_single": 4, "reduce_scatter_single": 5 * 2 - 1}
    assert facts["gathered"] == 5 * 2 + 4
    assert facts["after forward"] == facts["after backward"] == 0
    assert facts["stage 2", 25] == {"reduce_scatter_single": 1, "all_gather_single": 1}
    assert facts["stage 2", 1e-5] == {"reduce_scatter_single": 6, "all_gather_single": 1}
    assert facts["shards"] == [-(-n // world_size) for n in (25, 5, 35, 7, 35, 5, 5)]  # the frozen bias too
    assert facts["whole"] == list(toy_model(0).state_dict())  # what a plain model loads: the tied weight twice
    assert facts["lr after load"] == (0.01, 0.01)  # the saved learning rate, not the constructor's


def own_slice_only(out: torch.Tensor, flat: torch.Tensor, async_op: bool = False):
    """A broken reduce-scatter: each rank keeps its own gradient's slice, not the sum of every rank's."""
    out.copy_(flat.view(dist.get_world_size(), -1)[dist.get_rank()])
    return ORIGINAL_REDUCE_SCATTER(torch.empty_like(out), flat, async_op=async_op)


ORIGINAL_REDUCE_SCATTER = dist.reduce_scatter_single


def broken(rank: int, world_size: int) -> dict:
    zero_by_hand.dist.reduce_scatter_single = own_slice_only
    return train_classes(rank, world_size, "SGD", "stage 3")


def test_a_broken_reduce_scatter_is_caught():
    """The proof can fail: with each rank's own gradient in place of the sum, FSDP ends elsewhere."""
    results, _ = spawn(broken, 2, timeout=60)
    expected = one_process("SGD", 2)
    assert any(not torch.allclose(results[0][k], t, rtol=0, atol=1e-3) for k, t in expected.items())
