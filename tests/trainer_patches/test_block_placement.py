"""Quantized transformer blocks go where training needs them as they are built (walls 1-2, host RAM).

Runs the real Flux2Model.load_model on the embedded tiny FLUX.2 (stopped where the text
encoder would load) with the training device set to ``cpu:0``: distinct from ``cpu`` for
torch's bookkeeping, so a move "to the GPU" is visible without one. Every Module.to(cpu:0)
of a transformer block is recorded between the loader's "block i/N" lines: each block must
reach the device before the next block is read, not the whole model at the end. The same
recorder sees the fallbacks keep every block on the CPU, so the check can fail.
"""


import pytest
import torch

DEVICE = torch.device("cpu", 0)



class StopAtTextEncoder(Exception):
    pass


def load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, qtype="uint4", text_phase_done=False,
                   events=None, **settings):
    """(events, cache devices): the loader's messages (" - block i/N: <block>") and "place" (a
    block moved to the device) in order, appended to `events` (a new list by default, or one
    the caller records into too), and the device each cache load was asked to fill."""
    from toolkit.config_modules import ModelConfig

    events = [] if events is None else events
    cache_devices = []
    real_to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if type(self).__name__.endswith("Block") and any(torch.device(t) == DEVICE for t in targets):
            events.append("place")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)

    class NoTextEncoder:
        @staticmethod
        def from_pretrained(*_, **__):
            raise StopAtTextEncoder

    monkeypatch.setattr(flux2_model, "Mistral3ForConditionalGeneration", NoTextEncoder)
    if text_phase_done:  # every prompt embedded: no encoder is loaded, so stop at the VAE instead
        monkeypatch.setattr(flux2_model, "text_phase_for_model", lambda *_, **__: object())
        monkeypatch.setattr(flux2_model, "AutoEncoder", NoTextEncoder.from_pretrained)
    cache_class = flux2_model.cache_for_model.__globals__["QuantizedCache"]
    real_load_into = cache_class.load_into

    def load_into(self, model, device=torch.device("cpu")):
        cache_devices.append(torch.device(device))
        return real_load_into(self, model, device)

    monkeypatch.setattr(cache_class, "load_into", load_into)
    low_vram = settings.pop("low_vram", False)
    config = ModelConfig(
        name_or_path=tiny_assets["name_or_path"], arch="flux2", quantize=True, qtype=qtype,
        quantize_te=False, low_vram=low_vram, layer_offloading=settings.pop("layer_offloading", False),
        model_kwargs=dict(tiny_assets["model_kwargs"], quantized_cache_dir=str(tmp_path / "cache"), **settings),
    )
    model = flux2_model.Flux2Model(device=DEVICE, model_config=config, dtype="bf16")
    model.training_folder = str(tmp_path)
    model.print_and_status_update = lambda message: events.append(message.strip())
    with pytest.raises(StopAtTextEncoder):
        model.load_model()
    return events, cache_devices


def block_order(events):
    """[(block read, moved to the device before the next block was read)] in load order."""
    order = []
    for event in events:
        if event.startswith("- block "):
            order.append([event.split(": ")[-1], False])
        elif event == "place" and order:
            order[-1][1] = True
    return order


@pytest.mark.parametrize("qtype", ["uint4", "int4_fused"])
def test_each_block_reaches_the_device_before_the_next_is_read(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                                               qtype):
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, qtype=qtype)
    order = block_order(events)
    assert len(order) >= 2, events
    assert all(placed for _, placed in order), f"blocks not placed as they were built: {order}"
    assert cache_devices == [DEVICE], "the cache is read straight onto the training device"


@pytest.mark.parametrize(
    "settings, text_phase_done, why",
    [
        ({"blocks_to_device": False}, False, "switched off: the CPU-parking fallback"),
        ({"low_vram": True}, False, "the text encoder still runs after the transformer loads"),
        ({"layer_offloading": True}, False, "layer offloading decides placement itself"),
    ],
)
def test_fallbacks_park_every_block_on_the_cpu(flux2_model, tiny_assets, monkeypatch, tmp_path, settings,
                                               text_phase_done, why):
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                           text_phase_done=text_phase_done, **settings)
    order = block_order(events)
    assert order and not any(placed for _, placed in order), f"{why}: {order}"
    assert cache_devices == [torch.device("cpu")], why


def test_low_vram_places_blocks_once_the_text_phase_is_done(flux2_model, tiny_assets, monkeypatch, tmp_path):
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                           text_phase_done=True, low_vram=True)
    assert all(placed for _, placed in block_order(events)), events
    assert cache_devices == [DEVICE]
    assert "Moving transformer to CPU" not in events, "low_vram must not undo the placement"


def test_relaunch_from_the_cache_is_placed_too(flux2_model, tiny_assets, monkeypatch, tmp_path):
    load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path)  # writes the cache
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path)
    assert not block_order(events), "the relaunch read the checkpoint instead of the cache"
    assert cache_devices == [DEVICE]
