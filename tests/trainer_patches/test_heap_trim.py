"""The streamed load hands the freed heap back to the OS after each block and after the extras (wall 1).

Runs the real Flux2Model.load_model on the embedded tiny FLUX.2 (stopped where the text encoder
would load, as test_block_placement.py does) with the heap trim of toolkit/host_memory.py
(malloc_trim(0) on glibc, _heapmin on Windows) replaced by a recorder, and checks its place among
the loader's messages: one trim after every block, before the next block is read, and one after
the remaining tensors. Deterministic: it counts calls, where a comparison of peak RSS at two depths
(test_load_host_memory.py) cannot tell the trim apart from the allocator's own trimming; without
the hooks no trim runs at all.
"""

import importlib

import pytest
from test_block_placement import load_recording

TRIM = "heap trim"


@pytest.fixture
def trims_recorded(trainer_on_path, monkeypatch):
    """An event list that gets TRIM each time release_freed_memory() trims the heap."""
    events = []
    monkeypatch.setattr(importlib.import_module("toolkit.host_memory"), "_trimmer", lambda: events.append(TRIM))
    return events


def trims_per_step(events):
    """[(loader line, trims before the next loader line)] for the block and remaining-tensor lines."""
    steps = []
    for event in events:
        if event.startswith(("- block ", "- remaining tensors")):
            steps.append([event, 0])
        elif event == TRIM and steps:
            steps[-1][1] += 1
    return steps


@pytest.mark.parametrize("settings", [{}, {"blocks_to_device": False}], ids=["placed", "parked"])
def test_heap_is_trimmed_after_each_block_and_the_extras(flux2_model, tiny_assets, monkeypatch, tmp_path,
                                                         trims_recorded, settings):
    load_recording(flux2_model, tiny_assets, monkeypatch, tmp_path, events=trims_recorded, **settings)
    steps = trims_per_step(trims_recorded)
    blocks = [line for line, _ in steps if line.startswith("- block ")]
    assert len(blocks) >= 2 and steps[-1][0].startswith("- remaining tensors"), trims_recorded
    untrimmed = [line for line, trims in steps if trims == 0]
    assert not untrimmed, f"no heap trim after {untrimmed} (of {len(blocks)} blocks and the extras)"
