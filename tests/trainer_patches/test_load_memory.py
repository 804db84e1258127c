"""The loading patches of walls 2-4: loading never puts a whole bf16 model on the GPU.

Runs the real Flux2Model.load_model on the embedded tiny FLUX.2 with the
device set to ``cpu:0``: a device distinct from ``cpu`` for torch's
bookkeeping, so every move "to the GPU" can be seen without one. The test
records each Module.to(cpu:0) and checks that what moves is already 4-bit,
and that the bf16 transformer tensors are gone before the text encoder loads.
"""

import gc

import pytest
import torch
from conftest import plain_linears
from torch.multiprocessing.reductions import StorageWeakRef

DEVICE = torch.device("cpu", 0)



@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "fork-loader"])
def test_only_quantized_models_move_to_the_device(flux2_model, tiny_assets, monkeypatch, streamed):
    from toolkit.config_modules import ModelConfig

    moves = []
    real_to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if any(torch.device(t) == DEVICE for t in targets) and self.__class__.__name__ in (
            "Flux2",
            "Mistral3ForConditionalGeneration",
        ):
            moves.append((self.__class__.__name__, plain_linears(self)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)

    # weak references to the storage of every tensor read from the transformer file
    read = []
    if streamed:
        from toolkit.streamed_safetensors import StreamedSafetensors as reader
        real_read = reader.read
        monkeypatch.setattr(
            reader, "read", lambda self, name: keep(read, name, real_read(self, name))
        )
    else:
        real_load_file = flux2_model.load_file

        def load_file(path, device="cpu"):
            state = real_load_file(path, device=device)
            if path.endswith("flux2-dev.safetensors"):
                for name, value in state.items():
                    keep(read, name, value)
            return state

        monkeypatch.setattr(flux2_model, "load_file", load_file)

    alive_at_te_load = []
    real_te = flux2_model.Mistral3ForConditionalGeneration

    class TextEncoder:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            gc.collect()
            alive_at_te_load.extend(n for n, ref in read if not ref.expired() and is_linear_weight(n))
            return real_te.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(flux2_model, "Mistral3ForConditionalGeneration", TextEncoder)

    config = ModelConfig(
        name_or_path=tiny_assets["name_or_path"],
        arch="flux2",
        quantize=True,
        qtype="uint4",
        quantize_te=True,
        qtype_te="uint4",
        low_vram=False,  # so the end of load_model moves the transformer too
        model_kwargs=dict(tiny_assets["model_kwargs"], streamed_loader=streamed),
    )
    model = flux2_model.Flux2Model(device=DEVICE, model_config=config, dtype="bf16")
    model.load_model()

    assert read, "the transformer file was not read through the patched hooks"
    assert alive_at_te_load == [], "bf16 transformer weights still referenced when the TE loads"
    moved = {name for name, _ in moves}
    assert moved == {"Flux2", "Mistral3ForConditionalGeneration"}
    for name, plain in moves:
        assert plain == [], f"{name} moved to the device with bf16 Linears: {plain[:5]}"
    assert plain_linears(model.model) == []
    assert plain_linears(model.text_encoder[0]) == []


LINEAR_SUFFIXES = ("qkv.weight", "proj.weight", "linear1.weight", "linear2.weight", "lin.weight")


def is_linear_weight(name):
    return name.endswith(LINEAR_SUFFIXES) or ("_mlp." in name and name.endswith(".weight"))


def keep(refs, name, tensor):
    refs.append((name, StorageWeakRef(tensor.untyped_storage())))
    return tensor
