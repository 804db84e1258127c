"""The streamed-loader and loud-quantization patches on a tiny FLUX.2: block-by-block build +
quantize, loud failures.

The streamed path (flux2_hooks.load_transformer_streamed) must give the same
quantized weights as the fork's path (load_file + load_state_dict +
quantize_model), must have quantized and released each block before it reads
the next (wall 1: peak host RAM is one bf16 block plus what is already 4-bit),
and a transformer-block Linear that cannot be quantized must stop the load
unless model_kwargs allow_unquantized_block_linears is set.
"""

import gc
import importlib
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import dense_weight, is_quantized_linear, loader_model, plain_linears
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import StorageWeakRef

TINY = dict(
    in_channels=64,
    context_in_dim=64,
    hidden_size=128,
    num_heads=2,
    depth=2,
    depth_single_blocks=2,
    axes_dim=[16, 16, 16, 16],
    mlp_ratio=3.0,
)
# hidden 96: every attention Linear is 96 wide, not a multiple of the group size 64
ODD = dict(TINY, hidden_size=96, num_heads=1, axes_dim=[24, 24, 24, 24])


@pytest.fixture(scope="module")
def trainer(trainer_on_path):
    flux2 = importlib.import_module("extensions_built_in.diffusion_models.flux2.flux2_model")
    quantize = importlib.import_module("toolkit.util.quantize")
    hooks = importlib.import_module("toolkit.flux2_hooks")
    return SimpleNamespace(flux2=flux2, quantize=quantize, hooks=hooks)


def meta_transformer(trainer, params):
    with torch.device("meta"):
        return trainer.flux2.Flux2(trainer.flux2.Flux2Params(**params))


def write_checkpoint(trainer, params, path, seed=0):
    torch.manual_seed(seed)
    model = trainer.flux2.Flux2(trainer.flux2.Flux2Params(**params))
    # fp32 on disk, so the loaders' cast to bf16 is exercised too
    state = {k: (v * 4).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return state


def fork_path(trainer, model, params, path):
    """The fork's load_model transformer steps, verbatim apart from the device."""
    transformer = meta_transformer(trainer, params)
    state = load_file(str(path), device="cpu")
    for key in state:
        state[key] = state[key].to(model.torch_dtype)
    transformer.load_state_dict(state, assign=True)
    transformer.to("cpu", dtype=model.torch_dtype)
    if model.model_config.quantize:
        trainer.flux2.patch_dequantization_on_save(transformer)
        trainer.quantize.quantize_model(model, transformer)
    return transformer


def streamed_path(trainer, model, params, path):
    transformer = meta_transformer(trainer, params)
    trainer.hooks.load_transformer_streamed(model, transformer, str(path))
    return transformer


def dense(t):
    return t.dequantize() if hasattr(t, "dequantize") else t


def forward(transformer, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 6, params["in_channels"], generator=g).bfloat16()
    ctx = torch.randn(1, 5, params["context_in_dim"], generator=g).bfloat16()
    x_ids = torch.randint(0, 4, (1, 6, 4), generator=g)
    ctx_ids = torch.randint(0, 4, (1, 5, 4), generator=g)
    t = torch.tensor([0.5]).bfloat16()
    with torch.no_grad():
        return transformer(x=x, x_ids=x_ids, timesteps=t, ctx=ctx, ctx_ids=ctx_ids, guidance=t * 8)


@pytest.mark.parametrize("qtype", ["uint4", "qint8", "qfloat8"])
def test_streamed_build_matches_fork_quantization(trainer, tmp_path, qtype):
    """torchao's uint4 and the fork's optimum-quanto qtypes (qfloat8 is its UI's default). For
    quanto the tensors outside the blocks must load into the modules that own them, never through
    the whole model, whose quantized block Linears would look for their packed weights in that
    partial state dict."""
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)
    reference = fork_path(trainer, loader_model(trainer.flux2, TINY, qtype=qtype), TINY, path)
    streamed = streamed_path(trainer, loader_model(trainer.flux2, TINY, qtype=qtype), TINY, path)

    ref_params = dict(reference.named_parameters())
    new_params = dict(streamed.named_parameters())
    assert ref_params.keys() == new_params.keys()
    for name, ref in ref_params.items():
        new = new_params[name]
        assert type(new) is type(ref), name
        assert new.device.type == "cpu", name
        assert torch.equal(dense(new), dense(ref)), name
    ref_modules, new_modules = dict(reference.named_modules()), dict(streamed.named_modules())
    linears = [name for name, m in ref_modules.items() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_quantized_linear(ref_modules[n]) for n in linears)  # each qtype takes every Linear here
    for name in linears:
        assert type(new_modules[name]) is type(ref_modules[name]), name
        assert is_quantized_linear(new_modules[name]), name
        assert torch.equal(dense_weight(new_modules[name]), dense_weight(ref_modules[name])), name
    assert torch.equal(forward(streamed, TINY), forward(reference, TINY))


@pytest.mark.parametrize("qtype", ["qint8", "uint4"])
def test_the_streamed_build_leaves_the_random_generator_as_it_was(trainer, tmp_path, qtype):
    """optimum-quanto's quantize draws random numbers; the training after the load must draw the
    same ones whatever the qtype, so that one training_seed trains comparable LoRAs."""
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    streamed_path(trainer, loader_model(trainer.flux2, TINY, qtype=qtype), TINY, path)
    assert torch.equal(torch.rand(4), expected)


def test_each_block_is_quantized_and_released_before_the_next_is_read(trainer, tmp_path, monkeypatch):
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)  # fp32 on disk: what is read is never what the model keeps
    transformer = meta_transformer(trainer, TINY)
    reader = importlib.import_module("toolkit.streamed_safetensors").StreamedSafetensors
    real_read_many = reader.read_many
    read = []  # (block prefix, weak reference to the storage of a tensor read for it)
    seen = []  # at each read: (its first name, earlier blocks with plain Linears, earlier reads still alive)

    def read_many(self, names):
        gc.collect()
        earlier = sorted({prefix for prefix, _ in read} - {""})
        plain = [prefix for prefix in earlier if plain_linears(transformer.get_submodule(prefix))]
        alive = sorted({prefix for prefix, ref in read if not ref.expired()})
        seen.append((names[0], plain, alive))
        tensors = real_read_many(self, names)
        prefix = ".".join(names[0].split(".")[:2]) if names[0].split(".")[0].endswith("_blocks") else ""
        read.extend((prefix, StorageWeakRef(tensor.untyped_storage())) for tensor in tensors.values())
        return tensors

    monkeypatch.setattr(reader, "read_many", read_many)
    trainer.hooks.load_transformer_streamed(loader_model(trainer.flux2, TINY), transformer, str(path))

    assert len(seen) == 4 + 1, seen  # 2 double + 2 single blocks, then the remaining tensors
    for first_name, plain, alive in seen:
        assert plain == [], f"reading {first_name} while {plain} still hold bf16 Linears"
        assert alive == [], f"reading {first_name} while tensors read for {alive} are still alive"
    assert plain_linears(transformer) == []


def test_streamed_build_without_quantization_keeps_cast_weights(trainer, tmp_path):
    path = tmp_path / "flux2-tiny.safetensors"
    state = write_checkpoint(trainer, TINY, path)
    transformer = streamed_path(trainer, loader_model(trainer.flux2, TINY, quantize=False), TINY, path)
    loaded = transformer.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert loaded[key].dtype == torch.bfloat16
        assert torch.equal(loaded[key], value.to(torch.bfloat16)), key


def test_streamed_build_reports_progress(trainer, tmp_path, capsys):
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)
    streamed_path(trainer, loader_model(trainer.flux2, TINY), TINY, path)
    out = capsys.readouterr().out
    assert "block 1/4: double_blocks.0" in out
    assert "block 4/4: single_blocks.1" in out


def test_checkpoint_of_another_shape_is_refused_before_reading(trainer, tmp_path):
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, dict(TINY, depth=1), path)
    with pytest.raises(ValueError, match="does not match the model.*double_blocks.1"):
        streamed_path(trainer, loader_model(trainer.flux2, TINY), TINY, path)


def test_bad_quantize_device_is_refused(trainer, tmp_path):
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)
    with pytest.raises(ValueError, match="quantize_device"):
        streamed_path(trainer, loader_model(trainer.flux2, TINY, quantize_device="npu"), TINY, path)


# -- the loud-quantization patch: Linears that cannot be quantized ----------------------------


@pytest.mark.parametrize("loader", [streamed_path, fork_path], ids=["streamed", "fork-loader"])
def test_block_linear_that_cannot_be_quantized_fails_loudly(trainer, tmp_path, loader):
    path = tmp_path / "flux2-odd.safetensors"
    write_checkpoint(trainer, ODD, path)
    model = loader_model(trainer.flux2, ODD)
    with pytest.raises(trainer.hooks.UnquantizedLinearError) as info:
        loader(trainer, model, ODD, path)
    message = str(info.value)
    assert "double_blocks.0" in message  # the first block stops the load
    assert re.search(r"img_attn\.qkv \(in 96, out 288\): \S", message)  # with the backend's reason
    assert "group size divides these widths" in message
    assert "allow_unquantized_block_linears" in message


def test_allowed_unquantized_block_linears_are_summarised(trainer, tmp_path, capsys):
    path = tmp_path / "flux2-odd.safetensors"
    write_checkpoint(trainer, ODD, path)
    model = loader_model(trainer.flux2, ODD, allow_unquantized_block_linears=True)
    transformer = streamed_path(trainer, model, ODD, path)
    skipped = {name for name, _, _ in trainer.hooks.unquantized_linears(transformer)}
    assert "double_blocks.0.img_attn.qkv" in skipped
    assert "single_blocks.0.linear1" in skipped
    assert "single_blocks.0.linear2" not in skipped  # 96 + 288 = 384 wide: quantized
    out = capsys.readouterr().out
    assert f"transformer: {len(skipped)} Linear layer(s) were not quantized" in out
    assert "double_blocks.0.img_attn.qkv (96->288)" in out


def test_quantizable_model_reports_nothing(trainer, tmp_path, capsys):
    path = tmp_path / "flux2-tiny.safetensors"
    write_checkpoint(trainer, TINY, path)
    transformer = streamed_path(trainer, loader_model(trainer.flux2, TINY), TINY, path)
    assert trainer.hooks.unquantized_linears(transformer) == []
    assert "were not quantized" not in capsys.readouterr().out
