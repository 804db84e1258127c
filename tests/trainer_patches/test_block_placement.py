"""Quantized transformer blocks go where training needs them as they are built (walls 1-2, host RAM).

Runs the real Flux2Model.load_model on the embedded tiny FLUX.2 (stopped where the text
encoder would load) with the training device set to ``cpu:0``: distinct from ``cpu`` for
torch's bookkeeping, so a move "to the GPU" is visible without one. Every Module.to(cpu:0)
of a transformer block is recorded between the loader's "block i/N" lines: each block must
reach the device before the next block is read, not the whole model at the end. The same
recorder sees the fallbacks keep every block on the CPU, so the check can fail. Under a
memory plan that streams a block, that block stays on the host and everything else is
placed as without a plan.
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
        cache_devices.append(device)
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


def one_device(place):
    """The device a cache load was asked to fill, when it is one device for every tensor (a
    placement streaming no block is)."""
    assert not getattr(place, "streamed", None), f"blocks placed on the host: {place}"
    return torch.device(getattr(place, "device", place))


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
    assert [one_device(p) for p in cache_devices] == [DEVICE], "the cache is read straight onto the training device"


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
    assert [one_device(p) for p in cache_devices] == [torch.device("cpu")], why


def test_low_vram_places_blocks_once_the_text_phase_is_done(flux2_model, tiny_assets, monkeypatch, tmp_path):
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                           text_phase_done=True, low_vram=True)
    assert all(placed for _, placed in block_order(events)), events
    assert [one_device(p) for p in cache_devices] == [DEVICE]
    assert "Moving transformer to CPU" not in events, "low_vram must not undo the placement"


def test_relaunch_from_the_cache_is_placed_too(flux2_model, tiny_assets, monkeypatch, tmp_path):
    load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path)  # writes the cache
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path)
    assert not block_order(events), "the relaunch read the checkpoint instead of the cache"
    assert [one_device(p) for p in cache_devices] == [DEVICE]


PLAN_SETTINGS = {"memory_plan": "auto", "vram_budget_gib": 24}


@pytest.fixture
def single_block_streamed(trainer_on_path, monkeypatch):
    """Every memory plan of the load keeps the double block resident and streams the single one
    (the tiny model's own plan, with one block of each kind, streams both or neither). Returns
    the events list the load records into and what carrying out the plan saw."""
    from toolkit import memory_budget
    from flux2_contract import memory_plan

    blocks = [memory_plan.BlockPlan("double_blocks.0", memory_plan.RESIDENT, memory_plan.RECOMPUTED),
              memory_plan.BlockPlan("single_blocks.0", memory_plan.STREAMED, memory_plan.RECOMPUTED)]
    plan = memory_plan.MemoryPlan(budget_bytes=24 * 2**30, blocks=blocks)
    monkeypatch.setattr(memory_budget, "plan_for", lambda *_, **__: plan)
    events, carried_out = [], {}
    real_after_load = memory_budget.after_load

    def after_load(base_model, transformer, params, plan):
        events.append("after_load")
        carried_out["transformer"] = transformer
        return real_after_load(base_model, transformer, params, plan)

    monkeypatch.setattr(memory_budget, "after_load", after_load)
    return events, carried_out


def record_moves_to_the_device(monkeypatch, events):
    """Appends ("to device", module, plain blocks in it) for every Module.to(cpu:0): a block
    already handed to block_streaming (whose tensors stay on the host) does not count."""
    from toolkit.block_streaming import StreamedBlock

    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if any(torch.device(t) == DEVICE for t in targets):
            plain = [type(m).__name__ for m in self.modules()
                     if type(m).__name__.endswith("Block") and not isinstance(m, StreamedBlock)]
            events.append(("to device", self, plain))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)


@pytest.mark.patch("memory-plan")
def test_a_plan_that_streams_places_each_block_as_it_is_built(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                                              single_block_streamed):
    events, carried_out = single_block_streamed
    record_moves_to_the_device(monkeypatch, events)
    load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, qtype="int4_fused", events=events,
                   **PLAN_SETTINGS)
    names = {id(m): n for n, m in carried_out["transformer"].named_modules()}
    window, moved = None, {}  # block or step of the load -> what went to the device during it
    for event in events:
        if isinstance(event, str) and event.startswith(("- block ", "- remaining tensors", "after_load")):
            window = event.split(": ")[-1] if event.startswith("- block ") else event.split(" (")[0]
        elif isinstance(event, tuple):
            moved.setdefault(window, []).append((names.get(id(event[1]), "?"), event[2]))
    blocks_moved = {window: [b for _, plain in got for b in plain] for window, got in moved.items()}
    assert "DoubleStreamBlock" in blocks_moved.get("double_blocks.0", []), \
        f"the resident block did not reach the device before the next block was read: {moved}"
    assert not any("SingleStreamBlock" in got for got in blocks_moved.values()), \
        f"the streamed block went to the device: {moved}"
    rest = [name for name, _ in moved.get("- remaining tensors", [])]
    assert {"img_in", "txt_in", "final_layer"} <= set(rest), \
        f"the parts outside the blocks did not go to the device as they were loaded: {moved}"


@pytest.mark.patch("memory-plan")
def test_a_relaunch_under_a_plan_reads_the_streamed_block_onto_the_host(flux2_model, tiny_assets, monkeypatch,
                                                                        tmp_path, single_block_streamed):
    load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, qtype="int4_fused", **PLAN_SETTINGS)
    events, cache_devices = load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, qtype="int4_fused",
                                           **PLAN_SETTINGS)
    assert not block_order(events), "the relaunch read the checkpoint instead of the cache"
    place = cache_devices[-1]
    assert callable(place), f"the cache was read onto one device, {place}, with a block streamed"
    wanted = {"double_blocks.0.img_attn.qkv.qweight": DEVICE, "single_blocks.0.linear1.qweight": torch.device("cpu"),
              "img_in.weight": DEVICE}
    assert {name: place(name) for name in wanted} == wanted
